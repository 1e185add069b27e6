"""Attacks on `rft dashboard` over real HTTP (uvicorn in this process): with a key set, no route answers without it
(401), a browser that opened `/?key=KEY` once gets an HttpOnly, SameSite=Strict cookie its page's requests carry
and a redirect to the page without the key;
a Host that is not the server's (DNS rebinding) is refused on every route."""
from __future__ import annotations

import httpx
import pytest

from rft.dashboard.model import RunIndex
from rft.dashboard.server import create_app
from rft.observability.access import DASHBOARD_COOKIE, Access, allowed_hosts
from rft.observability.app_thread import AppThread
from rft.run.config import config_from_dict

KEY = "d-" + "fedcba9876543210" * 2


@pytest.fixture
def dashboard(tmp_path, tiny_model):
    cfg = config_from_dict({"run": {"name": "dash", "output_dir": str(tmp_path / "runs")},
                            "model": {"path": str(tiny_model)}})
    index = RunIndex(cfg)
    thread = AppThread(create_app(index, Access(frozenset({KEY}), allowed_hosts([], "127.0.0.1"),
                                                cookie=DASHBOARD_COOKIE))).start()
    yield thread.url
    thread.stop()
    index.close()


@pytest.mark.parametrize("path", ["/", "/api/runs", "/api/runs/dash/snapshot", "/static/app.js"])
def test_no_route_answers_without_the_key(dashboard, path):
    assert httpx.get(dashboard + path, timeout=10).status_code == 401
    assert httpx.get(dashboard + path, timeout=10, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(dashboard + path, timeout=10, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_browser_gives_the_key_once_and_keeps_it_in_a_strict_cookie_not_the_url(dashboard):
    """`/?key=KEY` answers with the cookie and a redirect to the same page without the key (its other parameters
    kept), so the key leaves the address bar, the history and the Referer of the page's requests; the key is
    taken from the URL on that page only."""
    with httpx.Client(base_url=dashboard, timeout=10) as browser:
        login = browser.get(f"/?run=a&key={KEY}&run=b")
        assert login.status_code == 303, login.status_code
        target = login.url.join(login.headers["location"])
        assert target.path == "/" and target.query == b"run=a&run=b" and KEY not in str(target)
        assert login.headers["cache-control"] == "no-store"
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        page = browser.get(target)  # the page's own requests: the cookie, no header
        assert page.status_code == 200 and KEY not in str(page.url)
        assert browser.get("/api/runs").status_code == 200
        assert browser.get("/?key=wrong").headers["location"] == "./"  # any key is taken out of the URL
    assert httpx.get(dashboard + "/?key=wrong", timeout=10).status_code == 401
    assert httpx.get(dashboard + f"/api/runs?key={KEY}", timeout=10).status_code == 401


def test_a_rebound_host_name_is_refused(dashboard):
    reply = httpx.get(dashboard + "/api/runs", timeout=10,
                      headers={"Authorization": f"Bearer {KEY}", "Host": "attacker.example"})
    assert reply.status_code == 400 and "attacker.example" in reply.json()["detail"]
