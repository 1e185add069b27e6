"""Issue 29, item 3, the attack as the issue ran it: feedback with `reward: 1e308` on `rft serve` (real HTTP, a real
broker, the tiny model on the transformers engine). Two such calls on one prompt's completions made the joiner's
group mean overflow and GRPO's advantages NaN; now each is refused (400 naming run.reward_max) and nothing
reaches the feedback topic, while a reward in range is still taken."""
from __future__ import annotations

import time

import httpx
import pytest

from rft.run.config import config_from_dict
from rft.schema import Feedback, decode
from rft.serve.app import ServerThread
from rft.serve.server import build_service
from rft.transport import connect

pytestmark = [pytest.mark.integration]


def test_feedback_rewards_outside_the_range_are_refused(broker, tiny_model, tmp_path):
    cfg = config_from_dict({
        "run": {"name": f"serve-poison-{int(time.time() * 1000) % 10**8}", "mode": "serve",
                "output_dir": str(tmp_path / "runs"), "reward_min": -10, "reward_max": 10},
        "model": {"path": str(tiny_model), "max_prompt_len": 32, "max_response_len": 8},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
        "explorer": {"engine": "transformers"},
        "serve": {"group_size": 2, "group_wait_s": 1.0},
        "sync": {"weight_store": str(tmp_path / "store")},
    })
    service = build_service(cfg)
    thread = ServerThread(service).start()
    try:
        chat = {"model": cfg.run.name, "messages": [{"role": "user", "content": ":7"}], "max_tokens": 4, "n": 2}
        answer = httpx.post(thread.url + "/v1/chat/completions", json=chat, timeout=120).json()
        post = lambda body: httpx.post(thread.url + "/v1/feedback", json=body, timeout=30)  # noqa: E731
        for index in (0, 1):  # the attack: two feedback calls of 1e308
            refused = post({"id": answer["id"], "reward": 1e308, "index": index})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert "run.reward_max" in error["message"] and error["param"] == "feedback.reward", error
        assert post({"id": answer["id"], "reward": 10.5, "index": 0}).status_code == 400  # just past the end
        assert post({"id": answer["id"], "reward": -10.0, "index": 0}).json()["accepted"] == 1  # its end: taken
        assert post({"id": answer["id"], "reward": 1.0, "index": 1}).json()["accepted"] == 1
    finally:
        thread.stop()
        service.worker.stop()
        service.sink.close()
    source = connect(cfg.kafka).source()
    try:
        taken = [decode(m.value, m.headers) for m in source.read_range(cfg.topic("feedback"), idle_timeout_s=3.0)]
    finally:
        source.close()
    assert sorted(f.reward for f in taken if isinstance(f, Feedback)) == [-10.0, 1.0]
