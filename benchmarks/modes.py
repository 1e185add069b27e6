"""`rft bench modes`: each stage alone, then the same RFT workload in sync, off_policy (k=1, k=2) and async, in one
invocation, each mode against the bound its stages allow.

Workloads (`--workload`): `real` (the default) is the flagship's (configs/smollm2-arithmetic.yaml: SmolLM2-135M-Instruct
through its chat template on reasoning-gym arithmetic, 8 samples x <= 8 tokens per task, GRPO) with
`trainer.operators: []` so every generated group is trained and generation and training count the same samples;
`tiny` is a fresh 0.3 M-parameter model on the one-token-answer `copy_char` task (per-step overheads dominate).
`--groups`, `--samples`, `--max-tokens`, `--tasks-per-batch`, `--lr` override the workload's values.

Every run is a whole `rft run` on one local broker that outlives them (so the control topic can be read afterwards).
1. The stages alone (the bounds), with the same thread budget as in the modes:
   - generation: `run.mode: explore` over `steps x groups` tasks, `--explorers` explorers, no trainer. Its rate is
     measured from the experiences topic: the samples published after the first batch (`tasks_per_batch` groups per
     explorer) over the time from that batch to the last group (start-up excluded); tokens/s likewise.
   - training: `run.mode: train` on that filled topic, no explorer: samples/s over its steady state, as below.
   The bounds: sync `1 / (1/gen + 1/train)` (the stages take turns), the overlapped modes (off_policy, async)
   `min(gen, train)`.
2. Each mode, for `--steps` steps. Per mode:
   - samples/s: samples trained per second of steady state (from the end of step 1 to the end of the last step;
     engine and trainer start-up are excluded), and the efficiency: samples/s over the mode's bound;
   - trainer idle: the fraction of the trainer's step time spent waiting for experiences (`data_wait_s` of
     `step_time_s`, steps 2..N);
   - explorer idle: 1 - (time spent generating and scoring) / (time since joining), averaged over explorers;
   - weight sync, per version (means over versions 1..N, from the trainer's metrics and the control topic):
     publish = the trainer's copy of the weights (`weights_s`, on its critical path) + the store write and
     announcement (`weights_write_s`); notice = from the `weights` announcement to the first explorer's reload start;
     reload = that explorer's reload seconds (its `explorer_weights` message). In sync mode the sum is the per-step
     coordination cost on the critical path;
   - the staleness histogram of the samples trained (staleness -> samples) and the samples dropped as stale;
   - simulated: the fleet simulator's samples/s for the mode (benchmarks/simulate.py), driven by this invocation's stage
     times (`simulator_stages`), and its error against the measurement: the simulator's validation here.
The reference row runs TRL's `GRPOTrainer` (when `trl` is installed) on the same config, hence the same model,
tasks, reward, batch (groups x samples per step), sampling and learning rate, in a child process with Hugging Face
generate (benchmarks/trl_reference.py, shared with `rft bench learn`).

Threads: on a 2-core machine the stages overlap only if each uses one core: `--threads 1` (the default) sets
OMP_NUM_THREADS for every part, in the stage-alone runs too, so each bound is what one core per stage allows.
Targets on the 2-core CPU (docs/benchmarks.md): sync and async efficiency >= 0.85, off_policy k=1 >= 0.8.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import yaml

from benchmarks.simulate import BENCH_MODES, Stages, simulate
from benchmarks.trl_reference import run_trl, trl_missing
from rft.broker.local import LocalBroker
from rft.modes import MODES as RUN_MODES
from rft.schema import decode_group
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.control import ExplorerWeights, Weights, control_messages, parse

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIG = REPO / "configs" / "smollm2-arithmetic.yaml"
MODES = [(label, mode, k) for label, (mode, k) in BENCH_MODES.items()]  # (label, run.mode, run.max_staleness)
TINY_DEFAULTS = {"groups": 16, "samples": 8, "max_tokens": 16, "tasks_per_batch": 8, "lr": 3e-3}


def workload(args: argparse.Namespace, model: str, out: Path, name: str, mode: str, k: int, *,
             bootstrap: str) -> dict:
    """The `rft run` config of one run of the benchmark (`mode` may also be explore or train: the stages alone)."""
    if args.workload == "real":
        body = yaml.safe_load(REAL_CONFIG.read_text())
        body.pop("eval", None)
        body["trainer"]["operators"] = []  # every generated group trains: both stages count the same samples
    else:
        body = {"model": {"max_prompt_len": 8}, "explorer": {"temperature": 1.0, "reward": "char_accuracy"},
                "trainer": {}, "data": {"format": "generated", "path": "copy_char"}}
    groups, samples, max_tokens = args.groups, args.samples, args.max_tokens
    # async without flow control: the benchmark measures how far the stages overlap, unbounded (rft.modes)
    body["run"] = {"name": name, "mode": mode, "max_staleness": k, "async_max_staleness": None, "max_steps": args.steps,
                   "seed": args.seed, "output_dir": str(out), "groups_per_step": groups}
    body["model"].update(path=model, max_response_len=max_tokens)
    body["kafka"] = {"bootstrap_servers": bootstrap, "partitions": 4}
    body["explorer"].update(replicas=args.explorers, n_samples=samples, max_tokens=max_tokens,
                            tasks_per_batch=args.tasks_per_batch, exit_when_idle_s=5 if mode == "explore" else 0)
    body["trainer"].update(micro_batch_size=args.micro_batch_size or groups * samples, lr=args.lr,
                           checkpoint_every=10_000)
    # explore-alone generates exactly the groups train-alone trains on; the modes may run ahead of the trainer
    body["data"]["generated_tasks"] = args.steps * groups if mode == "explore" else 4000
    body["monitor"] = {"progress": False}
    return body


def rft_run(args: argparse.Namespace, model: str, out: Path, label: str, name: str, mode: str, k: int, env: dict, *,
            bootstrap: str) -> Path:
    """One whole `rft run`; its run directory."""
    config = out / f"{name}-{mode}.yaml"
    config.write_text(yaml.safe_dump(workload(args, model, out, name, mode, k, bootstrap=bootstrap)))
    print(f"[bench] {label}: rft run {config}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "rft.cli", "run", str(config)], env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{label}: rft run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out / name


def generation_rate(groups: list[tuple[int, int, int]], *, first_batch: int) -> dict:
    """Generation alone, from the experiences topic: `groups` is (timestamp ms, samples, response tokens) per group.
    The first `first_batch` groups (by time) end the start-up; the rate is what was published after them over the
    time from the last of them to the last group."""
    groups = sorted(groups)
    if len(groups) <= first_batch:
        raise RuntimeError(f"generation alone published {len(groups)} groups, need more than the first batch "
                           f"({first_batch}) to measure a rate: raise --steps or --groups")
    span_s = (groups[-1][0] - groups[first_batch - 1][0]) / 1000
    after = groups[first_batch:]
    return {"samples_per_s": sum(g[1] for g in after) / max(span_s, 1e-9),
            "tokens_per_s": sum(g[2] for g in after) / max(span_s, 1e-9), "groups": len(groups), "span_s": span_s}


def bounds(gen: float, train: float) -> dict:
    """Samples/s each mode's stages allow: sync takes turns, the overlapped modes run both at once."""
    return {"sync": 1 / (1 / gen + 1 / train), "overlapped": min(gen, train)}


def weight_sync(steps: list[dict], control: Iterable) -> dict:
    """Per-version weight-sync seconds (means over the versions an explorer loaded): publish (trainer copy + store
    write and announcement), notice (announcement -> the first explorer's reload start) and reload; see the module
    docstring. `control` is the run's control messages, typed (`rft.transport.control.parse`)."""
    announced: dict[int, float] = {}
    loaded: dict[int, tuple[float, float]] = {}  # version -> (reload start, reload seconds) of the first explorer
    for created_at, kind in control:
        if isinstance(kind, Weights) and kind.version > 0:
            announced.setdefault(kind.version, created_at)
        elif isinstance(kind, ExplorerWeights) and kind.seconds is not None:
            start = created_at - kind.seconds
            if kind.version not in loaded or start < loaded[kind.version][0]:
                loaded[kind.version] = (start, kind.seconds)
    versions = sorted(v for v in announced if v in loaded)
    publish = [m.get("weights_s", 0.0) + m.get("weights_write_s", 0.0) for m in steps if "weights_s" in m]
    if not versions or not publish:
        return {"publish_s": None, "copy_s": None, "notice_s": None, "reload_s": None, "weight_sync_s": None,
                "versions": 0}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    copy = [m["weights_s"] for m in steps if "weights_s" in m]
    result = {"publish_s": mean(publish), "copy_s": mean(copy),
              "notice_s": mean([max(0.0, loaded[v][0] - announced[v]) for v in versions]),
              "reload_s": mean([loaded[v][1] for v in versions]), "versions": len(versions)}
    result["weight_sync_s"] = result["publish_s"] + result["notice_s"] + result["reload_s"]
    return result


def read_groups(bootstrap: str, prefix: str) -> list[tuple[int, int, int]]:
    """The run's experience groups as (timestamp ms, samples, response tokens)."""
    source = connect(KafkaConfig(), bootstrap).source()
    try:
        groups = []
        for m in source.read_range(f"{prefix}.experiences", idle_timeout_s=3):
            g = decode_group(m.value, m.headers)
            groups.append((m.timestamp_ms, len(g.samples), sum(len(s.response_tokens) for s in g.samples)))
    finally:
        source.close()
    return groups


def read_control(bootstrap: str, prefix: str) -> list[tuple[float, object]]:
    """The run's typed control messages as (created_at, kind)."""
    source = connect(KafkaConfig(), bootstrap).source()
    try:
        messages = control_messages(source.read_range(f"{prefix}.control", idle_timeout_s=3))
        return [(m.created_at, kind) for m in messages if (kind := parse(m)) is not None]
    finally:
        source.close()


def stages_alone(args: argparse.Namespace, model: str, out: Path, env: dict, bootstrap: str) -> dict:
    """Generation alone, then training alone on what it generated; their rates and the bounds."""
    name = "bench-stages"
    rft_run(args, model, out, "generation alone", name, "explore", 0, env, bootstrap=bootstrap)
    groups = read_groups(bootstrap, name)
    gen = generation_rate(groups, first_batch=args.tasks_per_batch * args.explorers)
    train_dir = rft_run(args, model, out, "training alone", name, "train", 0, env, bootstrap=bootstrap)
    train = summarise(train_dir)
    return {"generation": gen, "training": {"samples_per_s": train["samples_per_s"],
                                            "train_s_per_step": train["train_s_per_step"]},
            "bounds": bounds(gen["samples_per_s"], train["samples_per_s"])}


def simulator_stages(args: argparse.Namespace, stages: dict, sync_row: dict, model: str) -> Stages:
    """The fleet simulator's stage times (benchmarks/simulate.py) from this invocation's measurements: a group's
    generation time from generation alone (per explorer, with a core to itself: the explorers of generation alone
    shared `cores` when there were more of them), the trainer step from training alone less its critical-path
    publish, and publish / notice / reload from the sync run (where explorers wait idle for each version, so
    notice is the announcement's latency, not a batch in flight). `cores`: the machine's cores over the threads
    each part uses, the compute every part shares."""
    samples = args.samples
    cores = (os.cpu_count() or 1) / args.threads
    copy_s = sync_row.get("copy_s") or 0.0
    step_s = args.groups * samples / stages["training"]["samples_per_s"]
    weights_gb = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 1e9
    shared = args.explorers * samples / stages["generation"]["samples_per_s"]
    return Stages(gen_group_s=shared * min(1.0, cores / args.explorers),
                  tasks_per_batch=args.tasks_per_batch, samples_per_group=samples, groups_per_step=args.groups,
                  train_s=max(step_s - copy_s, 0.0), publish_s=copy_s, notice_s=sync_row.get("notice_s") or 0.0,
                  reload_s=sync_row.get("reload_s") or 0.0, weights_gb=weights_gb, rebalance_s=0.0, cores=cores)


def add_predictions(args: argparse.Namespace, rows: list[dict], stages: Stages) -> None:
    """Each mode's simulated samples/s beside the measured one (`predicted`, `prediction_error` = predicted /
    measured - 1): the simulator's validation on this machine."""
    for row in rows:
        if row["mode"] in {label for label, _, _ in MODES} and "samples_per_s" in row:
            predicted = simulate(stages, explorers=args.explorers, partitions=4, mode=row["mode"],
                                 steps=args.steps).samples_per_s
            row["predicted"] = predicted
            row["prediction_error"] = predicted / row["samples_per_s"] - 1


def run_mode(args: argparse.Namespace, model: str, out: Path, label: str, mode: str, k: int, env: dict,
             bootstrap: str, bound: dict | None) -> dict:
    name = f"bench-{mode}-{k}"
    started = time.time()
    run_dir = rft_run(args, model, out, label, name, mode, k, env, bootstrap=bootstrap)
    row = {"mode": label, "wall_s": round(time.time() - started, 1), **summarise(run_dir)}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row.update(weight_sync(steps, read_control(bootstrap, name)))
    if bound is not None:
        row["bound"] = bound["sync" if RUN_MODES[mode].bound == "zero" else "overlapped"]  # sync: stages take turns
        row["efficiency"] = row["samples_per_s"] / row["bound"]
    return row


def summarise(run_dir: Path) -> dict:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(steps) < 2:
        raise RuntimeError(f"{run_dir}: {len(steps)} trainer steps logged; the steady state needs at least 2")
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
    """TRL's GRPOTrainer on the same workload for `--steps` steps (benchmarks/trl_reference.py: a child process)."""
    label = "trl GRPOTrainer"
    missing = trl_missing()
    if missing:
        return {"mode": label, "skipped": missing}
    print(f"[bench] {label}", file=sys.stderr, flush=True)
    config = out / "bench-trl.yaml"
    config.write_text(yaml.safe_dump(workload(args, model, out, "bench-trl", "sync", 0, bootstrap="embedded")))
    result = run_trl(config, out=out / "trl", env=env, timeout_s=args.timeout, steps=args.steps)
    if "error" in result:
        return {"mode": label, "error": result["error"]}
    ends, batch = result["step_end_s"], result["samples_per_step"]
    return {"mode": label, "samples_per_s": batch * (len(ends) - 1) / (ends[-1] - ends[0]), "trainer_idle": None,
            "explorer_idle": None, "staleness_hist": {"0": batch * len(ends)}, "dropped_stale": 0}


def print_table(result: dict) -> None:
    sync = next(r for r in result["rows"] if r["mode"] == "sync")["samples_per_s"]
    print(f"{result['workload']} workload: {result['steps']} steps of {result['groups']} groups x {result['samples']} "
          f"samples, <= {result['max_tokens']} tokens, {result['explorers']} explorers, "
          f"OMP_NUM_THREADS={result['threads']}")
    stages = result.get("stages")
    if stages:
        gen, train, b = stages["generation"], stages["training"], stages["bounds"]
        print(f"  alone: generation {gen['samples_per_s']:.2f} samples/s ({gen['tokens_per_s']:.1f} tokens/s), "
              f"training {train['samples_per_s']:.2f} samples/s; bounds: sync {b['sync']:.2f}, "
              f"overlapped {b['overlapped']:.2f} samples/s")
    print(f"  {'mode':<16} {'samples/s':>10} {'bound':>7} {'effic.':>7} {'vs sync':>8} {'trainer idle':>13} "
          f"{'explorer idle':>14} {'sync s/version':>25} {'simulated':>10}  staleness")
    num = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in result["rows"]:
        if "samples_per_s" not in r:
            print(f"  {r['mode']:<16} {r.get('skipped') or 'failed: ' + r.get('error', '')[-200:]}")
            continue
        sync_s = ("-" if r.get("weight_sync_s") is None else
                  f"{r['weight_sync_s']:.2f} ({r['publish_s']:.2f}+{r['notice_s']:.2f}+{r['reload_s']:.2f})")
        print(f"  {r['mode']:<16} {r['samples_per_s']:>10.2f} {num(r.get('bound'), '.2f'):>7} "
              f"{num(r.get('efficiency'), '.2f'):>7} {r['samples_per_s'] / sync:>7.2f}x "
              f"{num(r['trainer_idle'], '.0%'):>13} {num(r['explorer_idle'], '.0%'):>14} {sync_s:>25} "
              f"{num(r.get('predicted'), '.2f'):>10}  "
              f"{r['staleness_hist']} (dropped {r['dropped_stale']})")
    print("  sync s/version: publish + notice + reload, seconds per weights version; simulated: "
          "benchmarks/simulate.py's "
          "samples/s from the stages-alone times")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench modes", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["real", "tiny"], default="real",
                        help="real: the flagship's SmolLM2 arithmetic (default); tiny: a fresh tiny model, copy_char")
    parser.add_argument("--model", default=None, help="HF model directory (default: assets/smollm2-135m-instruct "
                        "for real, a fresh tiny model for tiny)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=None, help="groups (tasks) per trainer step (real: 4, tiny: 16)")
    parser.add_argument("--samples", type=int, default=None, help="samples per group (real: 8, tiny: 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="real: 8, tiny: 16")
    parser.add_argument("--tasks-per-batch", type=int, default=None, help="explorer batch in tasks (real: 4, tiny: 8)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="trainer micro-batch rows (default: real 8 as the flagship, tiny a whole step)")
    parser.add_argument("--explorers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=None, help="real: 3e-5, tiny: 3e-3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every part (0: leave as is)")
    parser.add_argument("--modes", default="sync,off_policy k=1,off_policy k=2,async,trl",
                        help="comma-separated subset of: sync, off_policy k=1, off_policy k=2, async, trl")
    parser.add_argument("--no-bounds", action="store_true",
                        help="skip the stages-alone runs (no bounds, no efficiency)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    wanted = [m.strip() for m in args.modes.split(",")]
    unknown = set(wanted) - {label for label, _, _ in MODES} - {"trl"}
    if unknown or "sync" not in wanted:
        parser.error(f"--modes: unknown {sorted(unknown)}" if unknown else "--modes: sync is the baseline; keep it")
    defaults = _real_defaults() if args.workload == "real" else TINY_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="rft-bench-modes-") as tmp, \
            LocalBroker(log_path=Path(tmp) / "broker.log") as broker:
        out = Path(tmp)
        model = args.model or _default_model(args.workload, out)
        bootstrap = broker.bootstrap_servers
        stages = None if args.no_bounds else stages_alone(args, model, out, env, bootstrap)
        rows = [run_mode(args, model, out, label, mode, k, env, bootstrap, stages and stages["bounds"])
                for label, mode, k in MODES if label in wanted]
        if "trl" in wanted:
            rows.append(run_trl_row(args, model, out, env))
        sim_stages = simulator_stages(args, stages, rows[0], model) if stages else None
    if sim_stages is not None:
        add_predictions(args, rows, sim_stages)
    sync = rows[0]
    result = {"workload": args.workload, "steps": args.steps, "groups": args.groups, "samples": args.samples,
              "max_tokens": args.max_tokens, "explorers": args.explorers, "threads": args.threads, "stages": stages,
              "rows": rows, "speedup_vs_sync": {r["mode"]: r["samples_per_s"] / sync["samples_per_s"]
                                                for r in rows if "samples_per_s" in r},
              "efficiency": {r["mode"]: r["efficiency"] for r in rows if "efficiency" in r},
              "simulator_stages": dataclasses.asdict(sim_stages) if sim_stages else None}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def _real_defaults() -> dict:
    body = yaml.safe_load(REAL_CONFIG.read_text())
    return {"groups": body["run"]["groups_per_step"], "samples": body["explorer"]["n_samples"],
            "max_tokens": body["explorer"]["max_tokens"], "tasks_per_batch": body["explorer"]["tasks_per_batch"],
            "lr": body["trainer"]["lr"], "micro_batch_size": body["trainer"]["micro_batch_size"]}


def _default_model(workload: str, out: Path) -> str:
    if workload == "real":
        model = REPO / "assets" / "smollm2-135m-instruct"
        if not (model / "config.json").is_file():
            raise SystemExit(f"rft bench modes: {model} is missing; `make smollm2` builds it (or pass --model)")
        return str(model)
    from rft.models.tiny import make_tiny_model  # heavy: torch
    return str(make_tiny_model(out / "tiny"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
