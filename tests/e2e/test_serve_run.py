"""Serve mode end to end (`rft run` with run.mode: serve: a real broker, `rft serve` on the tiny model, the joiner, the
Megatron trainer under torchrun): requests and feedback over HTTP become experience groups, the trainer steps on them
and publishes weights, and the server's next responses report the new version. The broker outlives the run, so the
topics are read after it. The joiner is SIGKILLed while it holds a rewarded completion waiting for a peer and after it
emitted a group, then started again by hand: no rewarded completion is lost and none is emitted twice (by completion id
and by group id)."""
from __future__ import annotations

import collections
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from benchmarks.runs import REPO, rft_run, steps_done, write_config
from rft.processes import free_port, kill_matching, matching
from rft.run.config import load_config
from rft.schema import decode_group
from rft.serve.joiner import emitted_completions
from rft.transport import connect
from tests.support.runs import finish, wait_for_step
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.integration]

GROUPS_PER_STEP = 2


class Client:
    def __init__(self, url: str):
        self.url = url
        self.rewarded: list[str] = []  # completion ids given a reward

    def ask(self, content: str, n: int = 1) -> dict:
        reply = httpx.post(self.url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": content}], "n": n, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def reward(self, answer: dict, *rewards: float) -> None:
        items = [{"id": answer["id"], "index": i, "reward": r} for i, r in enumerate(rewards)]
        reply = httpx.post(self.url + "/v1/feedback", json={"feedback": items}, timeout=60)
        assert reply.status_code == 200, reply.text
        self.rewarded += [f"{answer['id']}/{i}" for i in range(len(rewards))]


def joined(cfg) -> tuple[list[str], list[str]]:
    """(group ids, completion ids) of the joiner's groups on the experiences topic, in log order."""
    source = connect(cfg.kafka).source()
    try:
        groups = [decode_group(m.value, m.headers)
                  for m in source.read_range(cfg.topic("experiences"), idle_timeout_s=3.0)]
    finally:
        source.close()
    return [g.group_id for g in groups], [c for g in groups for c in emitted_completions(g)]


def test_traffic_trains_the_served_model_and_a_killed_joiner_loses_and_repeats_nothing(tiny_model, tmp_path, bootstrap,
                                                                                     topic_prefix):
    port = free_port()
    config = write_config(tmp_path, tiny_model, "serve-e2e",
                          run={"mode": "serve", "max_steps": 2, "groups_per_step": GROUPS_PER_STEP},
                          kafka={"partitions": 1, "bootstrap_servers": bootstrap, "topic_prefix": topic_prefix},
                          explorer={"engine": "transformers"},
                          trainer={"checkpoint_every": 100},
                          serve={"port": port, "group_size": 2, "group_wait_s": 600})
    raw = yaml.safe_load(config.read_text())
    raw["model"].update(max_prompt_len=16, max_response_len=2)
    config.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "serve-e2e"
    log = tmp_path / "run.log"
    process = rft_run(config, log)
    client = Client(f"http://127.0.0.1:{port}")

    def healthy() -> bool:
        try:
            return httpx.get(client.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        watch = {"alive": [process], "context": tail_of(log), "interval": 0.5}  # the run must not end meanwhile
        wait_until(healthy, what="the server to answer", timeout=180, **watch)
        cfg = load_config(run_dir / "config.yaml")  # the run's broker address
        first = client.ask(":3")
        assert first["policy_version"] == 0
        client.reward(first, 1.0)  # a single: held by the joiner until a peer of its prompt comes
        pair = client.ask(":5", n=2)
        client.reward(pair, 1.0, 0.0)  # a request group: emitted at once
        wait_until(lambda: f"serve-e2e/serve/{pair['id']}" in joined(cfg)[0], what="the first group", timeout=120,
                   **watch)

        [joiner_pid] = matching("rft.cli", "joiner", str(run_dir))
        assert kill_matching("rft.cli", "joiner", str(run_dir)) == [joiner_pid]
        peer = client.ask(":3")
        client.reward(peer, 0.0)
        again = subprocess.Popen([sys.executable, "-m", "rft.cli", "joiner", str(run_dir / "config.yaml")], cwd=REPO,
                                 stdout=open(tmp_path / "joiner-2.log", "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            wait_for_step(process, run_dir, 1, log, timeout_s=240)
            wait_until(lambda: client.ask(":5")["policy_version"] >= 1, what="version 1 served", timeout=120, **watch)
            for k in range(GROUPS_PER_STEP):  # the second step's groups
                client.reward(client.ask(f":{k}", n=2), 0.5, 1.0)
            assert finish(process, log, timeout_s=300) == 0
        finally:
            again.send_signal(signal.SIGTERM)
            again.wait(timeout=30)
    finally:
        if process.poll() is None:
            kill_matching("rft.cli", str(run_dir))
            process.kill()

    group_ids, completions = joined(cfg)
    repeated = [c for c, k in collections.Counter(completions).items() if k > 1]
    assert not repeated, f"completions emitted twice: {repeated}"
    assert len(set(group_ids)) == len(group_ids)
    assert sorted(completions) == sorted(client.rewarded)  # none lost
    assert f"{first['id']}/0" in completions and f"{peer['id']}/0" in completions
    steps = steps_done(run_dir)
    assert [m["step"] for m in steps][-1] == 2
