"""`rft bench modes`: the same RFT workload in sync, off_policy (k=1, k=2) and async, in one invocation.

Each mode is one whole `rft run` (its own local broker, `--explorers` vLLM explorers, the Megatron trainer under
torchrun) on the same model, task (`copy_char`), batch and sampling settings, for `--steps` steps. Per mode:
- samples/s: samples trained per second of steady state (from the end of step 1 to the end of the last step;
  engine and trainer start-up are excluded);
- trainer idle: the fraction of the trainer's step time spent waiting for experiences (`data_wait_s` of
  `step_time_s`, steps 2..N);
- explorer idle: 1 - (time spent generating and scoring) / (time since joining), averaged over explorers;
- the staleness histogram of the samples trained (staleness -> samples) and the samples dropped as stale.
The reference row runs TRL's `GRPOTrainer` (when `trl` is installed) on the same config, hence the same model,
tasks, reward, batch (groups x samples per step), sampling and learning rate, in a child process with Hugging Face
generate (tools/trl_reference.py, shared with `rft bench learn`).

On a 2-core machine the stages overlap only if each uses one core: `--threads 1` (the default) sets
OMP_NUM_THREADS for every part. Targets (see the README): async >= 1.6x sync, off_policy k=1 >= 1.4x sync, when
generation and training take comparable time per step (the `gen/train` column shows sync's ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tools.trl_reference import run_trl, trl_missing

MODES = [("sync", "sync", 0), ("off_policy k=1", "off_policy", 1), ("off_policy k=2", "off_policy", 2),
         ("async", "async", 0)]


def workload(args: argparse.Namespace, model: str, out: Path, name: str, mode: str, k: int) -> dict:
    return {
        "run": {"name": name, "mode": mode, "max_staleness": k, "max_steps": args.steps, "seed": args.seed,
                "output_dir": str(out)},
        "model": {"path": model, "max_prompt_len": 8, "max_response_len": args.max_tokens},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 4},
        "explorer": {"replicas": args.explorers, "n_samples": args.samples, "max_tokens": args.max_tokens,
                     "temperature": 1.0, "tasks_per_batch": args.tasks_per_batch, "reward": "char_accuracy"},
        "trainer": {"groups_per_step": args.groups, "micro_batch_size": args.groups * args.samples, "lr": args.lr,
                    "checkpoint_every": 10_000},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 4000},
        "monitor": {"progress": False},
    }


def run_mode(args: argparse.Namespace, model: str, out: Path, label: str, mode: str, k: int, env: dict) -> dict:
    name = f"bench-{mode}-{k}"
    config = out / f"{name}.yaml"
    config.write_text(yaml.safe_dump(workload(args, model, out, name, mode, k)))
    print(f"[bench] {label}: rft run {config}", file=sys.stderr, flush=True)
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{label}: rft run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"mode": label, "wall_s": round(time.time() - started, 1), **summarise(out / name)}


def summarise(run_dir: Path) -> dict:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = steps[1:]
    seconds = steps[-1]["time"] - steps[0]["time"]
    hist: dict[str, int] = {}
    for m in steps:
        for staleness, count in m.get("staleness_hist", {}).items():
            hist[str(staleness)] = hist.get(str(staleness), 0) + count
    explorers = [stats for log in sorted((run_dir / "logs").glob("explorer-*.log")) for stats in _final_stats(log)]
    explorer_idle = [1 - s["explore_s"] / s["joined_s"] for s in explorers if s.get("joined_s")]
    return {
        "samples_per_s": sum(m["samples"] for m in steady) / seconds,
        "trainer_idle": sum(m["data_wait_s"] for m in steady) / sum(m["step_time_s"] for m in steady),
        "explorer_idle": sum(explorer_idle) / len(explorer_idle) if explorer_idle else None,
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "dropped_stale": sum(m.get("dropped_stale", 0) for m in steps),
        "train_s_per_step": sum(m["step_time_s"] - m["data_wait_s"] for m in steady) / len(steady),
        "reward_first": steps[0]["reward_mean"], "reward_last": steps[-1]["reward_mean"],
    }


def _final_stats(log: Path) -> list[dict]:
    return [json.loads(line.split("final stats: ", 1)[1]) for line in log.read_text().splitlines()
            if "final stats: " in line]


def run_trl_row(args: argparse.Namespace, model: str, out: Path, env: dict) -> dict:
    """TRL's GRPOTrainer on the same workload for `--steps` steps (tools/trl_reference.py: a child process)."""
    label = "trl GRPOTrainer"
    missing = trl_missing()
    if missing:
        return {"mode": label, "skipped": missing}
    print(f"[bench] {label}", file=sys.stderr, flush=True)
    config = out / "bench-trl.yaml"
    config.write_text(yaml.safe_dump(workload(args, model, out, "bench-trl", "sync", 0)))
    result = run_trl(config, out=out / "trl", env=env, timeout_s=args.timeout, steps=args.steps)
    if "error" in result:
        return {"mode": label, "error": result["error"]}
    ends, batch = result["step_end_s"], result["samples_per_step"]
    return {"mode": label, "samples_per_s": batch * (len(ends) - 1) / (ends[-1] - ends[0]), "trainer_idle": None,
            "explorer_idle": None, "staleness_hist": {"0": batch * len(ends)}, "dropped_stale": 0}


def print_table(result: dict) -> None:
    sync = next(r for r in result["rows"] if r["mode"] == "sync")["samples_per_s"]
    print(f"{result['steps']} steps of {result['groups']} groups x {result['samples']} samples, "
          f"<= {result['max_tokens']} tokens, {result['explorers']} explorers, OMP_NUM_THREADS={result['threads']}; "
          f"sync gen/train time per step: {result['sync_gen_train_ratio']:.2f}")
    print(f"  {'mode':<16} {'samples/s':>10} {'vs sync':>8} {'trainer idle':>13} {'explorer idle':>14}  staleness")
    for r in result["rows"]:
        if "samples_per_s" not in r:
            print(f"  {r['mode']:<16} {r.get('skipped') or 'failed: ' + r.get('error', '')[-200:]}")
            continue
        idle = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
        print(f"  {r['mode']:<16} {r['samples_per_s']:>10.1f} {r['samples_per_s'] / sync:>7.2f}x "
              f"{idle(r['trainer_idle']):>13} {idle(r['explorer_idle']):>14}  {r['staleness_hist']} "
              f"(dropped {r['dropped_stale']})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench modes", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny model)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=16, help="groups (tasks) per trainer step")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tasks-per-batch", type=int, default=8, help="explorer batch (tasks)")
    parser.add_argument("--explorers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every part (0: leave as is)")
    parser.add_argument("--modes", default="sync,off_policy k=1,off_policy k=2,async,trl",
                        help="comma-separated subset of: sync, off_policy k=1, off_policy k=2, async, trl")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    wanted = [m.strip() for m in args.modes.split(",")]
    unknown = set(wanted) - {label for label, _, _ in MODES} - {"trl"}
    if unknown or "sync" not in wanted:
        parser.error(f"--modes: unknown {sorted(unknown)}" if unknown else "--modes: sync is the baseline; keep it")
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="rft-bench-modes-") as tmp:
        out = Path(tmp)
        model = args.model
        if model is None:
            from rft.tiny_model import make_tiny_model
            model = str(make_tiny_model(out / "tiny"))
        rows = [run_mode(args, model, out, label, mode, k, env) for label, mode, k in MODES if label in wanted]
        if "trl" in wanted:
            rows.append(run_trl_row(args, model, out, env))
    sync = rows[0]
    result = {"steps": args.steps, "groups": args.groups, "samples": args.samples, "max_tokens": args.max_tokens,
              "explorers": args.explorers, "threads": args.threads,
              # in sync mode the trainer waits exactly while the explorers generate
              "sync_gen_train_ratio": sync["trainer_idle"] / max(1e-9, 1 - sync["trainer_idle"]), "rows": rows,
              "speedup_vs_sync": {r["mode"]: r["samples_per_s"] / sync["samples_per_s"]
                                  for r in rows if "samples_per_s" in r}}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
