"""Attacks on `rft dashboard` over real HTTP (uvicorn in this process): with a key set, no route answers without it
(401), a browser that opened `/?key=KEY` once gets an HttpOnly, SameSite=Strict cookie its page's requests carry;
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


def test_a_browser_gives_the_key_once_and_keeps_it_in_a_strict_cookie(dashboard):
    with httpx.Client(base_url=dashboard, timeout=10) as browser:
        page = browser.get(f"/?key={KEY}")
        assert page.status_code == 200
        cookie = page.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert browser.get("/api/runs").status_code == 200  # the page's own requests: the cookie, no header
    assert httpx.get(dashboard + "/?key=wrong", timeout=10).status_code == 401


def test_a_rebound_host_name_is_refused(dashboard):
    reply = httpx.get(dashboard + "/api/runs", timeout=10,
                      headers={"Authorization": f"Bearer {KEY}", "Host": "attacker.example"})
    assert reply.status_code == 400 and "attacker.example" in reply.json()["detail"]
