"""The gpu-check `mismatch` row's verdict on a run's metrics (rft.ops.gpu_check.check_mismatch). The run itself is
real in tests/e2e/test_gpu_check.py; here the row reads given metrics.jsonl rows, so each way it must fail is shown."""
from __future__ import annotations

import argparse
import math
import subprocess

import pytest

from rft.ops.gpu_check import Context, check_mismatch

GOOD = {"logprob_mismatch_mean": 2e-7, "logprob_mismatch_max": 5e-7, "logprob_mismatch_kl": 4e-14,
        "logprob_mismatch_frac": 0.0, "logprob_mismatch_stale0_mean": 2e-7, "importance_weight_mean": 1.0,
        "importance_weight_truncated_frac": 0.0, "reward_mean": 0.1}


def verdict(tmp_path, steps: list[dict], cpu: bool = True) -> tuple[str, str]:
    ctx = Context(argparse.Namespace(cpu=cpu, steps=len(steps)), tmp_path)
    done = subprocess.CompletedProcess([], 0, "", "")
    ctx.reports["run"] = {"engine": "transformers", "seconds": 1.0, "result": done, "steps": steps, "trainer_log": ""}
    return check_mismatch(ctx)


def test_agreeing_steps_pass_and_say_their_numbers(tmp_path):
    status, detail = verdict(tmp_path, [GOOD, {**GOOD, "logprob_mismatch_mean": 3e-7,
                                               "logprob_mismatch_stale0_mean": 3e-7}])
    assert status == "pass", detail
    assert "mean abs dlogp 3.00e-07 (allowed 0.001)" in detail and "in float32" in detail


@pytest.mark.parametrize("change, says", [
    ({"logprob_mismatch_mean": 5e-3, "logprob_mismatch_stale0_mean": 5e-3}, "exceeds 0.001"),
    ({"logprob_mismatch_stale0_mean": 1e-7}, "stale0 does not hold every token"),
    ({"logprob_mismatch_kl": math.nan}, "not finite"),
    ({"importance_weight_mean": None}, "lacks importance_weight_mean"),
])
def test_each_fault_fails_the_row(tmp_path, change, says):
    status, detail = verdict(tmp_path, [GOOD, {**GOOD, **change}])
    assert status == "FAIL" and says in detail, detail


def test_bfloat16_has_its_own_bound(tmp_path):
    step = {**GOOD, "logprob_mismatch_mean": 0.02, "logprob_mismatch_stale0_mean": 0.02}
    assert verdict(tmp_path, [step], cpu=False)[0] == "pass"  # bfloat16 on a GPU: 0.02 is its rounding
    assert verdict(tmp_path, [step], cpu=True)[0] == "FAIL"


def test_no_step_is_a_failure_not_a_pass(tmp_path):
    assert verdict(tmp_path, [])[0] == "FAIL"
