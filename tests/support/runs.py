"""Waiting on and checking whole `rft run`s in the e2e tests (tests/e2e/test_run_faults.py, test_durable_run.py,
...); starting them and reading their files is benchmarks/runs.py's, shared with `rft chaos`.

Failures (a run that ends early, a step that does not come, a run that does not finish) raise an AssertionError
(`RunFailed`, or tests.waiting's `WaitTimeout`) with the tail of the run's log.
"""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from benchmarks.runs import GROUPS_PER_STEP, consumed, last_step, latest_checkpoint_state, log_tail, read_topic
from rft.processes import signal_group
from tests.waiting import wait_until


class RunFailed(AssertionError):
    pass


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout_s: float = 300) -> None:
    """Until the run's metrics reach `step`; WaitTimeout (an AssertionError) with the log's tail when the run ends
    first or `timeout_s` passes."""
    wait_until(lambda: last_step(run_dir) >= step, timeout=timeout_s, what=f"step {step}", interval=0.5,
               alive=[process], context=lambda: log_tail(log))


def finish(process: subprocess.Popen, log: Path, timeout_s: float = 400) -> int:
    """The exit status of `process`; after `timeout_s`, its whole session is SIGKILLed and RunFailed raised."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(process, signal.SIGKILL)  # the run and every part it started
        raise RunFailed(f"run did not finish in {timeout_s} s:\n{log_tail(log)}") from None


def assert_trained_exactly_once(run_dir: Path, bootstrap: str, topic: str, steps: int) -> list[str]:
    """Every step 1..`steps` full (GROUPS_PER_STEP groups), no group trained twice (by group id), and every group
    the trainer's last checkpointed offsets cover on `topic` was trained (nothing lost; async mode drops none as
    stale). Returns the trained group ids."""
    from rft.schema import decode_group  # heavy: numpy

    records = consumed(run_dir)
    assert sorted({r["step"] for r in records}) == list(range(1, steps + 1))
    assert len(records) == steps * GROUPS_PER_STEP
    trained = [r["group_id"] for r in records]
    assert len(set(trained)) == len(trained), "a group was trained twice"
    state = latest_checkpoint_state(run_dir)
    assert state is not None, f"no checkpoint in {run_dir}"
    covered = {decode_group(m.value, m.headers).group_id
               for m in read_topic(bootstrap, topic, end=state["feed"]["offsets"])}
    assert covered == set(trained), f"lost: {sorted(covered - set(trained))[:5]}"
    return trained


def run_to_the_end(config: Path, run_dir: Path, log: Path, steps: int, *, model: dict,
                   timeout_s: float = 300) -> list[dict]:
    """`rft run` of `config` (a write_config file) with its `model` section updated by `model` (write_config's
    `model` argument is only the path), to a 0 exit; the training steps' metrics records, asserted to be steps
    1..`steps`."""
    import yaml

    from benchmarks.runs import rft_run, steps_done

    body = yaml.safe_load(config.read_text())
    body["model"].update(model)
    config.write_text(yaml.safe_dump(body))
    assert finish(rft_run(config, log), log, timeout_s=timeout_s) == 0, log_tail(log)
    records = [r for r in steps_done(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), log_tail(log)
    return records
