"""`rft bench learn`: held-out accuracy against wall-clock for rft (async, sync) and TRL's GRPOTrainer, trained on
the same config for the same wall-clock budget, one after another on this machine.

Method.
- One config (`--config`, default the flagship configs/smollm2-arithmetic.yaml) says everything: model, task sets,
  prompt template, chat template and system prompt, reward, samples per task, groups per step, learning rate,
  sampling, eval set. It must have `eval.sets` (the held-out tasks).
- rft systems: each is one whole `rft run` of the config with `run.mode` as the config has it (`rft`), async
  (`rft-async`, `rft-async-push`, and `rft-async-inflight`: the continuous explorer with in-flight weight updates and
  the decoupled objective's off-policy correction, `SYSTEM_SETTINGS`) or sync (`rft-sync`), `sync.method` pull, or
  push for `rft-async-push`; `--system-set SYSTEM:KEY=VALUE` adds a config override to one system (e.g. the
  correction: `rft-async-inflight:algorithm.importance_sampling=mis`) and `--set KEY=VALUE` one to every system, TRL
  and the evaluation included (e.g. `model.dtype=bfloat16`); `run.max_steps` unlimited, no evaluator
  during training (`eval.every_steps: 0`: evaluation must not take CPU from training), its own embedded broker and
  weight store under `--out`. Its clock starts when `rft run` is launched: start-up (broker, engines, trainer) is
  part of the user's wall-clock and counts. When the budget has elapsed the run is stopped (SIGTERM to its process
  group; `rft run` stops every part).
- A race of algorithms: `rft:<algorithm>` (e.g. `--systems rft:grpo,rft:sapo,rft:topr`) is the config's own mode
  over pull with `algorithm.name` = <algorithm> (a registered name or an import path), in a copy of the config
  (`<out>/<stem>-algorithm-<algorithm>.yaml`, its run under `<out>/algorithm-<algorithm>`): each key of the config's
  `algorithm:` section that the algorithm takes keeps the config's value, each it does not take (another
  algorithm's) is dropped, and the report says which (`algorithm.dropped`); the rest are the algorithm's defaults.
  Everything else, the budget included, is the same config. `algorithm_race` compares every other `rft:<algorithm>`
  with `rft:grpo` at each mark and at the end: the difference of accuracies, "better" or "worse" when it exceeds
  1.96 standard errors of the difference, else "within noise". TRL's targets are printed only when TRL ran.
- Variants and their own configs: `<system>@<label>` (e.g. `rft:grpo@openenv`) is the rft system `<system>` (its
  mode, sync method, settings and algorithm) run again under its own name and directory; `--system-config
  SYSTEM=PATH` makes an rft system run PATH instead of `--config` (the same `--seed`, `--eval-tasks` and `--set`
  applied; the same model.path, and one stage). A variant of `rft:<algorithm>` races against `rft:grpo` like any
  other algorithm system: `--systems rft:grpo,rft:grpo@openenv --system-config
  rft:grpo@openenv=configs/smollm2-arithmetic-openenv.yaml` is the same task, algorithm and budget with the rollouts
  played on an OpenEnv server against rft's own path (docs/benchmarks.md, "Issue 57's race"). Every snapshot is
  still evaluated on `--config`'s held-out tasks by its rewards (below): the same questions and the same scorer.
- TRL: `GRPOTrainer` on the same config (benchmarks/trl_reference.py says what is mapped to what, and what is not), HF
  generate, in a child process whose clock starts when it is launched.
- Accuracy against wall-clock without evaluating during training: at each of `--marks` times budget x i / marks,
  the newest weights are snapshotted. rft: the weight store's newest complete version (LATEST), hard-linked file
  by file into `<out>/<system>/mark-<i>` (the store never rewrites a file; a version garbage-collected while it is
  being linked is retried with the new LATEST). The push path stores no versions, so `rft-async-push` reports its
  steps and weight-sync costs but no accuracy. TRL: the weights that were the newest at the mark, saved by a
  callback; the seconds spent taking snapshots are taken off TRL's clock. Version 0 (the initial model) is
  evaluated once and shared; marks that hold the same version share one evaluation.
- After every system has run, every snapshot is evaluated by `rft eval --checkpoint ...` (rft's own evaluation:
  the eval sets, `eval` sampling settings, the explorer engine and the sets' rewards), in one process with one
  engine. A snapshot's accuracy is the mean of its sets' `eval/<set>/accuracy`.
- Reported per system: steps trained within the budget, seconds to the first step, accuracy at each mark, final
  accuracy (the last mark), and the time at which it first reached TRL's final accuracy (0 when the initial model
  already did). Weight synchronisation per rft system (from metrics.jsonl and the logs; "-" when absent): median
  seconds per step the trainer spent publishing on its critical path (`weights_s`), median background write
  (`weights_write_s`, pull path with write-behind), median explorer reload per version (explorer logs), and the
  size of one version.
- Targets, for the system `--target` (default rft-async). `verdicts`: it reaches TRL's final accuracy within half
  the time TRL took to reach it (TRL's first mark at its final accuracy), and its final accuracy is at least TRL's at
  the same budget. `race_verdicts`: it reaches TRL's final accuracy within a quarter of TRL's time; its final
  accuracy is at least `rft`'s (the config's own mode) within noise (less than 1.96 standard errors of the
  difference below, the standard error of an accuracy p on n held-out tasks being sqrt(p (1 - p) / n)); and at every
  mark the best rft system is at or above TRL's accuracy. The time resolution is the mark spacing.
- With `--out`, the report is also written to `<out>/result.json` and the curve (accuracy against wall-clock, each
  system with a band of +-1.96 standard errors) to `<out>/accuracy.png`.
- `--seed N` sets `run.seed` for every system (TRL's too), `--eval-tasks N` makes every eval set generate N held-out
  tasks (300: a standard error of about 2.7 points at an accuracy of 0.35); both write a copy of the config into
  the output directory, which every system and the evaluation use. Each rft system's report also has its
  training-inference mismatch (`mismatch`: medians over its steps of the logprob_mismatch metrics, and by staleness).
- Where the time went (`signal`), per quarter of the budget: steps; for an rft system the seconds its trainer waited
  for experiences and trained, the share of groups its filter kept and the policy's entropy; for TRL (from its
  per-step log, `trl/metrics.jsonl`) the steps without a gradient (every group's samples scored alike), the share of
  groups with one, and the entropy. A policy whose entropy collapses samples a group's answers alike: a filtering
  trainer waits, TRL trains steps that change nothing.

Threads: `--threads N` sets OMP_NUM_THREADS for every process of every system; 0 (default) leaves it as is.
Disk: each snapshot of a real model is a full version (the SmolLM2 flagship: ~270 MB in bfloat16, ~540 MB in
float32; TRL's are float32). Before anything runs, the race's largest footprint (`disk_needed`) is checked against
the free space where `--out` (or the temporary directory) is, and the race is refused when it would not fit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from benchmarks.trl_reference import TRLReferenceError, check_trl_config, run_trl, step_note, trl_missing, within_budget
from rft.algorithms import option_keys
from rft.config import ConfigError, load_yaml
from rft.config.loader import apply_override
from rft.data.tasks import IMAGE_FORMATS
from rft.processes import signal_group
from rft.run.config import Config
from rft.run.loading import load_run_config
from rft.weights.store import ADAPTER_CONFIG, LATEST, WeightStore, is_adapter_version, store_root, version_dirname

RFT_SYSTEMS = {"rft": (None, "pull"), "rft-async": ("async", "pull"), "rft-sync": ("sync", "pull"),
               "rft-async-push": ("async", "push"), "rft-lora": (None, "pull"),
               "rft-async-inflight": ("async", "pull")}  # mode None: the config's own `run.mode`
# what a system sets besides its mode and sync method (before --system-set)
SYSTEM_SETTINGS = {"rft-async-inflight": ["explorer.continuous=true", "explorer.inflight_updates=true",
                                          "algorithm.off_policy_correction=true"]}
LORA_SYSTEMS = ("rft-lora",)  # run `--lora-config` (model.lora) instead of `--config`
SYSTEMS = (*RFT_SYSTEMS, "trl")
ALGORITHM_PREFIX = "rft:"  # `rft:<algorithm>`: the config's own mode with that algorithm (`algorithm_section`)
RACE_BASELINE = "rft:grpo"  # what every other `rft:<algorithm>` system is compared with (`algorithm_race`)
VARIANT = "@"  # `<system>@<label>`: the rft system `<system>` under its own name (`base_system`)
LABEL = re.compile(r"[A-Za-z0-9._-]+")
UNLIMITED_STEPS = 1_000_000
GENERATED_FORMATS = ("generated", "reasoning_gym", *IMAGE_FORMATS)  # task sets whose size is `generated_tasks`
POLL_S = 0.5
STOP_GRACE_S = 120.0  # `rft run` gives its parts 15 s, then kills them; the broker stops after
PREFIX = "[bench learn]"
DISK_SLACK_BYTES = 1 << 30  # beyond the snapshots: logs, the broker's topics, metrics, the evaluation's records
SIGNAL_WINDOWS = 4  # parts of the budget over which each system's learning signal is reported
RELOAD_LINES = (re.compile(r"loaded weights version (\d+) in ([\d.]+) s"),  # pull (rft/weights/subscriber.py)
                re.compile(r"received pushed weights version (\d+) in ([\d.]+) s"))  # push (rft/engine/)


def note(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# rft systems


def base_system(system: str) -> str:
    """The system a variant `<system>@<label>` is (the system itself when it is not a variant)."""
    return system.partition(VARIANT)[0]


def algorithm_of(system: str) -> str | None:
    """The algorithm of the system `rft:<algorithm>` (or a variant of it); None for any other system."""
    base = base_system(system)
    return base[len(ALGORITHM_PREFIX):] if base.startswith(ALGORITHM_PREFIX) else None


def is_rft_system(system: str) -> bool:
    """An `rft run`: a named rft system (RFT_SYSTEMS), `rft:<algorithm>`, or a variant `<either>@<label>`."""
    base, sep, label = system.partition(VARIANT)
    return (base in RFT_SYSTEMS or algorithm_of(base) is not None) and (not sep or bool(LABEL.fullmatch(label)))


def is_lora(system: str) -> bool:
    """A LoRA system (or a variant of one): it runs `--lora-config` unless `--system-config` gives its own."""
    return base_system(system) in LORA_SYSTEMS


def system_dir(system: str) -> str:
    """The directory under `--out` of a system's run and snapshots: its name, `algorithm-<algorithm>` for
    `rft:<algorithm>` (characters other than letters, digits, '.', '_', '-' as '_': an import path's ':'), then a
    variant's `@<label>`."""
    base, sep, label = system.partition(VARIANT)
    algorithm = algorithm_of(base)
    own = base if algorithm is None else "algorithm-" + re.sub(r"[^A-Za-z0-9._-]", "_", algorithm)
    return own + sep + label


def check_algorithm_system(system: str) -> str | None:
    """Why `rft:<algorithm>` names no algorithm (None: it names one, or the system is not an algorithm system)."""
    algorithm = algorithm_of(system)
    if algorithm is None:
        return None
    try:
        option_keys(algorithm)
    except (ValueError, ImportError, AttributeError) as e:
        return f"{system}: {e}"
    return None


def algorithm_section(section: dict, algorithm: str) -> tuple[dict, dict]:
    """The config's `algorithm:` section (raw, as written) for the system `rft:<algorithm>`, and the keys dropped:
    `name` is `algorithm`; each other key of `section` that `algorithm` takes (its options' fields) is kept with the
    config's value (the same config otherwise); a key it does not take (another algorithm's, e.g. GRPO's
    `clip_eps` for raft) is dropped and returned with its value; keys the section does not write take the
    algorithm's defaults. ValueError naming algorithm.name for an unknown algorithm."""
    owned = option_keys(algorithm)
    kept = {k: v for k, v in section.items() if k != "name" and k in owned}
    dropped = {k: v for k, v in section.items() if k != "name" and k not in owned}
    return {"name": algorithm, **kept}, dropped


def algorithm_config(config: str, system: str, out: Path, overrides: Sequence[str] = ()) -> tuple[str, dict]:
    """A copy of `config` in `out` (`<stem>-<system_dir>.yaml`) with `overrides` (`a.b=value`) applied, then its
    `algorithm:` section made the system `rft:<algorithm>`'s (`algorithm_section`); (its path, the keys dropped)."""
    raw = load_yaml(Path(config).read_text()) or {}
    for item in overrides:
        apply_override(raw, item)
    section = raw.get("algorithm") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{config}: algorithm: expected a section, got {section!r}")
    raw["algorithm"], dropped = algorithm_section(section, algorithm_of(system) or "")
    path = out / f"{Path(config).stem}-{system_dir(system)}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path), dropped


def dropped_note(system: str, dropped: dict) -> str:
    """The line that says which of the config's algorithm keys the system `rft:<algorithm>` dropped."""
    algorithm = algorithm_of(system)
    if not dropped:
        return f"{system}: algorithm.name={algorithm}, the config's other algorithm keys kept"
    keys = ", ".join(f"algorithm.{k}={v!r}" for k, v in dropped.items())
    pronoun = "it" if len(dropped) == 1 else "them"
    return f"{system}: algorithm.name={algorithm}; dropped {keys} ({algorithm} does not take {pronoun})"


def rft_overrides(system: str, out: Path, extra: list[str] = ()) -> list[str]:
    """The `--set` overrides that make the config system `system` (see the module docstring), then `extra` (the
    command line's `--system-set` for it). `rft:<algorithm>` is the config's own mode over pull; its algorithm is
    in its config (`algorithm_config`)."""
    mode, method = RFT_SYSTEMS.get(base_system(system), (None, "pull"))
    return [*([f"run.mode={mode}"] if mode else []), f"sync.method={method}", f"run.max_steps={UNLIMITED_STEPS}",
            "eval.every_steps=0", f"run.output_dir={out / system_dir(system)}", "sync.weight_store=",
            "kafka.bootstrap_servers=embedded", "monitor.progress=false",
            *SYSTEM_SETTINGS.get(base_system(system), []), *extra]


def run_rft(system: str, config: str, *, out: Path, budget_s: float, marks: int, env: dict,
            extra: list[str] = (), dropped: dict | None = None) -> dict:
    """One rft system for `budget_s` seconds from launch; its steps, marks and weight-sync costs (`dropped`: the
    algorithm keys `algorithm_config` dropped for `rft:<algorithm>`, reported)."""
    overrides = rft_overrides(system, out, extra)
    cfg = load_run_config(config, overrides)
    run_out = out / system_dir(system)
    run_out.mkdir(parents=True, exist_ok=True)
    log_path = run_out / "rft-run.log"
    note(f"{system}: rft run {config} {' '.join('--set ' + o for o in overrides[:2])} (log {log_path})")
    command = [sys.executable, "-m", "rft.cli", "run", config, *(a for o in overrides for a in ("--set", o))]
    started = time.time()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        taken = take_marks(system, process, cfg, out=run_out, started=started, budget_s=budget_s, count=marks)
    finally:
        code = stop_run(process)
    steps = trained_steps(cfg.run_dir)
    within = [s for s in steps if within_budget(s["time"] - started, budget_s)]
    result = {"system": system, "steps": len(within), "first_step_s": _first_step(steps, started),
              "step_times_s": [round(s["time"] - started, 1) for s in within], "marks": taken,
              "weights": weight_sync_costs(cfg.run_dir, steps, taken), "mismatch": mismatch_summary(within),
              "signal": rft_signal(within, started, budget_s),
              "settings": [*SYSTEM_SETTINGS.get(base_system(system), []), *extra], "run_dir": str(cfg.run_dir)}
    if algorithm_of(system) is not None:
        result["algorithm"] = {"name": cfg.algorithm.name, "options": cfg.algorithm.options,
                               "dropped": dropped or {}}
    if code not in (0, 130, -signal.SIGTERM):
        result["error"] = f"rft run exited with code {code}; see {log_path}"
    return result


def take_marks(system: str, process: subprocess.Popen, cfg: Config, *, out: Path, started: float, budget_s: float,
               count: int) -> list[dict]:
    """At budget x i / count seconds after `started` (or at once, once the run has ended), snapshot the store's
    newest version into `out/mark-<i>` (the push path, which stores none: no snapshot, version None); prints a
    progress line per trained step meanwhile."""
    root, shown, taken = store_root(cfg.sync, cfg.run_dir), 0, []
    stores = cfg.sync.method == "pull"
    for i in range(1, count + 1):
        due = started + budget_s * i / count
        while time.time() < due and process.poll() is None:
            shown = _show_steps(system, cfg.run_dir, started, shown, budget_s)
            time.sleep(min(POLL_S, max(0.0, due - time.time())))
        previous = (taken[-1]["version"], taken[-1]["path"]) if taken else (0, None)
        version, path = snapshot(root, out / f"mark-{i}", previous) if stores else (None, None)
        taken.append({"mark": i, "time_s": budget_s * i / count, "version": version, "path": path})
    _show_steps(system, cfg.run_dir, started, shown, budget_s)
    return taken


def snapshot(root: Path, dest: Path, previous: tuple[int, str | None]) -> tuple[int, str | None]:
    """(version, directory) of the store's newest version: `previous` when it is still the newest, else its files
    hard-linked into `dest`; (0, None) for the initial model."""
    if latest_version(root) == previous[0]:
        return previous
    return link_version(root, dest)


def _show_steps(system: str, run_dir: Path, started: float, shown: int, budget_s: float) -> int:
    steps = trained_steps(run_dir)
    for s in steps[shown:]:
        note(step_note(system, s["step"], s["time"] - started, budget_s))
    return max(shown, len(steps))


def latest_version(root: Path) -> int:
    """The version the store's LATEST names; 0 (the initial model) before the first publish or with no store."""
    if not (root / LATEST).is_file():
        return 0
    latest = WeightStore(root).latest()
    return latest[0] if latest else 0


def link_version(root: Path, dest: Path, tries: int = 5) -> tuple[int, str | None]:
    """(version, `dest`) after hard-linking the files of the store's newest version into `dest` (created);
    (0, None) when that is version 0 or there is none (the initial model). A version collected while it is being
    linked is retried with the new LATEST."""
    for _ in range(tries):
        version = latest_version(root)
        if version == 0:
            return 0, None
        source = root / version_dirname(version)
        try:
            dest.mkdir(parents=True)
            for item in source.iterdir():
                os.link(item, dest / item.name)
        except FileNotFoundError:
            shutil.rmtree(dest, ignore_errors=True)
            continue
        return version, str(dest)
    raise RuntimeError(f"weight store {root}: the newest version kept disappearing while it was being linked")


def stop_run(process: subprocess.Popen) -> int:
    """SIGTERM to the `rft run` process group (it stops every part), SIGKILL after STOP_GRACE_S; its exit code."""
    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
        try:
            return process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            note(f"rft run (pid {process.pid}) did not stop within {STOP_GRACE_S:.0f} s: killing it")
            signal_group(process, signal.SIGKILL)
    return process.wait()


def trained_steps(run_dir: Path) -> list[dict]:
    """The trainer's per-step records in `<run dir>/metrics.jsonl` (a line still being written is skipped)."""
    return [record for record in read_jsonl(run_dir / "metrics.jsonl") if "policy_version" in record]


def _first_step(steps: list[dict], started: float) -> float | None:
    return round(steps[0]["time"] - started, 1) if steps else None


def weight_sync_costs(run_dir: Path, steps: list[dict], marks: list[dict]) -> dict:
    """Median seconds per step: trainer publish on its critical path (`weights_s`), background write
    (`weights_write_s`), explorer reload (explorer logs, versions >= 1); one stored version's size in MB (pull
    only). None: absent."""
    reloads = [float(m.group(2)) for log in sorted((run_dir / "logs").glob("explorer-*.log"))
               for line in log.read_text(errors="replace").splitlines() for pattern in RELOAD_LINES
               if (m := pattern.search(line)) and int(m.group(1)) > 0]
    linked = [Path(m["path"]) for m in marks if m["path"]]  # the push path stores no version to measure
    size_mb = sum(f.stat().st_size for f in linked[-1].iterdir()) / 1e6 if linked else None
    return {"publish_s": _median([s.get("weights_s") for s in steps]),
            "write_s": _median([s.get("weights_write_s") for s in steps]),
            "reload_s": _median(reloads), "version_mb": round(size_mb, 1) if size_mb is not None else None}


def mismatch_summary(steps: list[dict]) -> dict:
    """The training-inference mismatch over the system's steps (rft/algorithms/mismatch.py): the median per step of
    `logprob_mismatch_mean`, `_kl` and `_frac`, the largest `_max`, and the median `_mean` per staleness bucket
    (None: not logged)."""
    out = {name: _median([s.get(f"logprob_mismatch_{name}") for s in steps], digits=6)
           for name in ("mean", "kl", "frac")}
    out["max"] = max((s["logprob_mismatch_max"] for s in steps if "logprob_mismatch_max" in s), default=None)
    buckets = sorted({k for s in steps for k in s if k.startswith("logprob_mismatch_stale") and k.endswith("_mean")})
    out["by_staleness"] = {k[len("logprob_mismatch_"):-len("_mean")]: _median([s.get(k) for s in steps], digits=6)
                           for k in buckets}
    return out


def _median(values: list, digits: int = 3) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), digits) if present else None


def _windows(records: list[dict], times: list[float], budget_s: float) -> list[list[dict]]:
    """The records whose step ended in each of SIGNAL_WINDOWS equal parts of the budget (times in seconds from
    launch; a record past the budget is left out)."""
    windows: list[list[dict]] = [[] for _ in range(SIGNAL_WINDOWS)]
    for record, at in zip(records, times, strict=True):
        if within_budget(at, budget_s):
            windows[min(int(at / budget_s * SIGNAL_WINDOWS), SIGNAL_WINDOWS - 1)].append(record)
    return windows


def rft_signal(steps: list[dict], started: float, budget_s: float) -> dict:
    """Where an rft system's time went, per window of the budget (`_windows`): steps; seconds the trainer waited for
    experiences (`data_wait_s`: a starved zero-variance filter shows here) and trained (`train_s`); the median share
    of fresh groups its operators kept (`keep_fraction`); the median policy entropy (nats per token)."""
    windows = _windows(steps, [s["time"] - started for s in steps], budget_s)
    return {"steps": [len(w) for w in windows],
            "data_wait_s": [round(sum(s.get("data_wait_s") or 0 for s in w), 1) for w in windows],
            "train_s": [round(sum(s.get("train_s") or 0 for s in w), 1) for w in windows],
            "keep_fraction": [_median([s.get("keep_fraction") for s in w], digits=2) for w in windows],
            "entropy": [_median([s.get("entropy") for s in w], digits=2) for w in windows]}


def trl_signal(records: list[dict], budget_s: float) -> dict:
    """The same for TRL, from its per-step log (`trl/metrics.jsonl`, benchmarks/trl_reference.py `log_record`):
    steps; steps without a gradient (every group's samples scored alike: `frac_reward_zero_std` 1); the median share
    of groups with a gradient (1 - `frac_reward_zero_std`: TRL trains on every group, rft's filter keeps those);
    the median entropy."""
    windows = _windows(records, [r["at_s"] for r in records], budget_s)
    return {"steps": [len(w) for w in windows],
            "no_gradient_steps": [sum(r.get("frac_reward_zero_std") == 1 for r in w) for w in windows],
            "keep_fraction": [_median([None if r.get("frac_reward_zero_std") is None
                                       else 1 - r["frac_reward_zero_std"] for r in w], digits=2) for w in windows],
            "entropy": [_median([r.get("entropy") for r in w], digits=2) for w in windows]}


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of `path` ([] when it does not exist; a line still being written is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


# --------------------------------------------------------------------------------------------------
# TRL


def run_trl_system(config: str, *, out: Path, budget_s: float, marks: int, env: dict) -> dict:
    """TRL on the config for `budget_s` seconds from launch (benchmarks/trl_reference.py)."""
    missing = trl_missing()
    if missing:
        return {"system": "trl", "skipped": missing, "marks": []}
    note(f"trl: GRPOTrainer on {config} (log {out / 'trl' / 'trl.log'})")
    result = run_trl(config, out=out / "trl", env=env, timeout_s=budget_s + 900, budget_s=budget_s, marks=marks,
                     started_at=time.time(), progress=f"{PREFIX} trl")
    if "error" in result:
        return {"system": "trl", "error": result["error"], "marks": []}
    within = [round(end, 1) for end in result["step_end_s"] if within_budget(end, budget_s)]
    return {"system": "trl", "steps": len(within), "step_times_s": within,
            "first_step_s": round(result["first_step_s"], 1) if result["first_step_s"] is not None else None,
            "marks": [{"mark": m["mark"], "time_s": m["time_s"], "version": m["step"], "path": m["path"]}
                      for m in result["marks"]], "snapshot_s": result["snapshot_s"],
            "signal": trl_signal(read_jsonl(out / "trl" / "metrics.jsonl"), budget_s)}


# --------------------------------------------------------------------------------------------------
# Evaluation and the report


def evaluate(config: str, systems: list[dict], *, out: Path, env: dict) -> dict[str, float]:
    """Accuracy of the initial model (key "initial") and of every snapshot directory (key: its path), by one
    `rft eval` process; a snapshot whose evaluation is missing is left out. LoRA adapter snapshots (rft-lora) are
    evaluated on the config's base model with LoRA enabled up to their largest rank."""
    paths = sorted({m["path"] for s in systems for m in s["marks"] if m["path"]})
    ranks = [json.loads((Path(p) / ADAPTER_CONFIG).read_text())["r"] for p in paths if is_adapter_version(p)]
    eval_dir = out / "eval"
    note(f"evaluating the initial model and {len(paths)} snapshots with rft eval (log {out / 'eval.log'})")
    command = [sys.executable, "-m", "rft.cli", "eval", config, "--set", f"run.output_dir={eval_dir}",
               "--set", "monitor.progress=false", *(["--set", f"model.lora.rank={max(ranks)}"] if ranks else []),
               "--checkpoint", "initial",
               *(a for p in paths for a in ("--checkpoint", p))]
    with open(out / "eval.log", "ab") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"rft eval exited with code {done.returncode}; see {out / 'eval.log'}")
    scores = {}
    for metrics in eval_dir.glob("*/metrics.jsonl"):
        for record in map(json.loads, metrics.read_text().splitlines()):
            sets = [v for k, v in record.items() if k.startswith("eval/") and k.endswith("/accuracy")]
            if "eval/checkpoint" in record and sets:
                scores[record["eval/checkpoint"]] = sum(sets) / len(sets)
    return scores


def summarise(systems: list[dict], scores: dict[str, float], *, budget_s: float, target: str = "rft-async",
              eval_tasks: int | None = None) -> dict:
    """Fill in every mark's accuracy, each system's final accuracy and time to reach TRL's final accuracy, and the
    targets' verdicts for the system `target` (`eval_tasks`: held-out tasks per evaluation, for the noise)."""
    initial = scores.get("initial")
    for s in systems:
        for m in s["marks"]:
            m["accuracy"] = None if m["version"] is None else initial if m["path"] is None else scores.get(m["path"])
        s["final_accuracy"] = s["marks"][-1]["accuracy"] if s["marks"] else None
    by_name = {s["system"]: s for s in systems}
    trl_final = by_name.get("trl", {}).get("final_accuracy")
    for s in systems:
        s["reach_trl_s"] = reach_time(s, initial, trl_final) if s["final_accuracy"] is not None else None
    race = algorithm_race(by_name, eval_tasks)
    return {"budget_s": budget_s, "initial_accuracy": initial, "trl_final_accuracy": trl_final, "systems": systems,
            "target_system": target,
            "targets": {**verdicts(by_name.get(target), by_name.get("trl"), name=target),
                        **race_verdicts(by_name, target, eval_tasks)},
            **({"algorithm_race": race} if race else {})}


def reach_time(system: dict, initial: float | None, target: float | None) -> float | None:
    """The first time (0: the initial model) at which the system's accuracy was >= `target`; None if never."""
    if target is None:
        return None
    points = [(0.0, initial)] + [(m["time_s"], m["accuracy"]) for m in system["marks"]]
    return next((t for t, a in points if a is not None and a >= target), None)


def verdicts(rft: dict | None, trl: dict | None, *, name: str = "rft-async") -> dict:
    """The half-time and equal-budget targets for the system `rft` (named `name`): {target: {"met": bool | None,
    "text": ...}} (None: not measured)."""
    if not rft or not trl or rft.get("final_accuracy") is None or trl.get("final_accuracy") is None:
        missing = {"met": None, "text": f"not measured (needs {name} and trl with accuracies)"}
        return {"half_time": missing, "equal_budget": missing}
    trl_final, trl_time, rft_time = trl["final_accuracy"], trl["reach_trl_s"], rft["reach_trl_s"]
    half = rft_time is not None and rft_time <= trl_time / 2
    reached = f"at {rft_time:.0f} s" if rft_time is not None else "never"
    return {
        "half_time": {"met": half, "text": f"{name} reached TRL's final accuracy {trl_final:.3f} {reached}; TRL "
                      f"reached it at {trl_time:.0f} s, half of that is {trl_time / 2:.0f} s"},
        "equal_budget": {"met": rft["final_accuracy"] >= trl_final,
                         "text": f"final accuracy at the same budget: {name} {rft['final_accuracy']:.3f}, TRL "
                                 f"{trl_final:.3f}"}}


def standard_error(accuracy: float, tasks: int) -> float:
    """The standard error of an accuracy measured on `tasks` held-out tasks: sqrt(p (1 - p) / n)."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / max(tasks, 1))


def race_verdicts(by_name: dict[str, dict], target: str, eval_tasks: int | None) -> dict:
    """The race targets for the system `target`: `quarter_time` (it reaches TRL's final accuracy in at most a
    quarter of TRL's time), `vs_off_policy` (its final accuracy is at least `rft`'s, the config's own mode, within
    noise: less than 1.96 standard errors of the difference below it, with `eval_tasks` held-out tasks) and
    `every_mark` (at every mark the best rft system is at or above TRL)."""
    missing = {"met": None, "text": "not measured"}
    out = {"quarter_time": dict(missing), "vs_off_policy": dict(missing), "every_mark": dict(missing)}
    mine, trl, own = by_name.get(target), by_name.get("trl"), by_name.get("rft")
    if mine and trl and mine.get("final_accuracy") is not None and trl.get("reach_trl_s") is not None:
        t = mine["reach_trl_s"]
        out["quarter_time"] = {"met": t is not None and t <= trl["reach_trl_s"] / 4,
                               "text": f"{target} reached TRL's final accuracy "
                                       f"{'never' if t is None else f'at {t:.0f} s'}"
                                       f"; a quarter of TRL's {trl['reach_trl_s']:.0f} s is "
                                       f"{trl['reach_trl_s'] / 4:.0f} s"}
    if mine and own and target != "rft" and None not in (mine.get("final_accuracy"), own.get("final_accuracy")):
        a, b = mine["final_accuracy"], own["final_accuracy"]
        noise = 1.96 * math.hypot(standard_error(a, eval_tasks or 0), standard_error(b, eval_tasks or 0))
        out["vs_off_policy"] = {"met": a >= b - noise, "text": f"final accuracy {target} {a:.3f}, rft {b:.3f} "
                                f"(noise: 1.96 standard errors of the difference = {noise:.3f} on {eval_tasks} tasks)"}
    rft_systems = [s for name, s in by_name.items() if name != "trl" and s.get("marks")]
    if trl and trl.get("marks") and rft_systems:
        behind = []
        for i, mark in enumerate(trl["marks"]):
            best = max((s["marks"][i]["accuracy"] for s in rft_systems if i < len(s["marks"])
                        and s["marks"][i]["accuracy"] is not None), default=None)
            if best is None or mark["accuracy"] is None or best < mark["accuracy"]:
                behind.append(f"{mark['time_s']:.0f} s (best rft {_fmt(best, '.3f')}, "
                              f"TRL {_fmt(mark['accuracy'], '.3f')})")
        out["every_mark"] = {"met": not behind, "text": "the best rft system is behind TRL at " + ", ".join(behind)
                             if behind else "the best rft system is at or above TRL at every mark"}
    return out


def compare(accuracy: float | None, baseline: float | None, eval_tasks: int | None) -> dict:
    """One accuracy against the baseline's on `eval_tasks` held-out tasks: the difference, the noise (1.96 standard
    errors of the difference) and the verdict: "better" (above by more than the noise), "worse" (below by more),
    "within noise", or None when either is not measured."""
    if accuracy is None or baseline is None:
        return {"accuracy": accuracy, "baseline": baseline, "difference": None, "noise": None, "verdict": None}
    difference = accuracy - baseline
    noise = 1.96 * math.hypot(standard_error(accuracy, eval_tasks or 0), standard_error(baseline, eval_tasks or 0))
    verdict = "better" if difference > noise else "worse" if difference < -noise else "within noise"
    return {"accuracy": accuracy, "baseline": baseline, "difference": round(difference, 4), "noise": round(noise, 4),
            "verdict": verdict}


def algorithm_race(by_name: dict[str, dict], eval_tasks: int | None) -> dict | None:
    """The race of algorithms: each `rft:<algorithm>` system other than RACE_BASELINE against RACE_BASELINE, at each
    mark (the same mark times: the same budget and marks) and at the end (the final accuracy), by `compare`. None
    when there is no algorithm system besides the baseline; `systems` empty (with `missing`) without the baseline."""
    contenders = [name for name in by_name if algorithm_of(name) is not None and name != RACE_BASELINE]
    if not contenders:
        return None
    baseline = by_name.get(RACE_BASELINE)
    if not baseline or not baseline.get("marks"):
        return {"baseline": RACE_BASELINE, "eval_tasks": eval_tasks, "systems": {},
                "missing": f"not measured: the race compares with {RACE_BASELINE}, which did not run"}
    out = {}
    for name in contenders:
        marks = by_name[name].get("marks", [])
        out[name] = {"marks": [{"time_s": m["time_s"], **compare(m.get("accuracy"), b.get("accuracy"), eval_tasks)}
                               for m, b in zip(marks, baseline["marks"], strict=False)],
                     "final": compare(by_name[name].get("final_accuracy"), baseline.get("final_accuracy"),
                                      eval_tasks)}
    return {"baseline": RACE_BASELINE, "eval_tasks": eval_tasks, "systems": out}


def race_line(name: str, race: dict) -> str:
    """One contender of `algorithm_race`: its accuracy against the baseline's at each mark and at the end."""
    def cell(c: dict) -> str:
        if c["verdict"] is None:
            return "not measured"
        return (f"{c['accuracy']:.3f} vs {c['baseline']:.3f} ({c['difference']:+.3f}, noise {c['noise']:.3f}: "
                f"{c['verdict']})")
    row = race["systems"][name]
    marks = "; ".join(f"@{m['time_s']:.0f} s {cell(m)}" for m in row["marks"])
    return f"{name} against {race['baseline']}: {marks}; final: {cell(row['final'])}"


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _mark_cell(mark: dict) -> str:
    """`0.310 (v12)`: the accuracy at a mark and the version (step) it evaluated; `-` when not measured."""
    return "-" if mark["version"] is None else f"{_fmt(mark['accuracy'], '.3f')} (v{mark['version']})"


def signal_line(signal: dict) -> str:
    """One system's `signal` (rft_signal / trl_signal), each value per window joined by slashes."""
    def cells(key: str, spec: str) -> str:
        return "/".join(_fmt(v, spec) for v in signal[key])

    parts = [f"by {SIGNAL_WINDOWS} parts of the budget: steps {cells('steps', 'd')}"]
    if "data_wait_s" in signal:
        parts += [f"waiting for data {cells('data_wait_s', '.0f')} s", f"training {cells('train_s', '.0f')} s",
                  f"groups kept {cells('keep_fraction', '.2f')}"]
    else:
        parts += [f"steps without a gradient {cells('no_gradient_steps', 'd')}",
                  f"groups with a gradient {cells('keep_fraction', '.2f')}"]
    return ", ".join(parts + [f"entropy {cells('entropy', '.2f')}"])


def print_report(result: dict) -> None:
    """The table, each system's mismatch and learning-signal lines, and the targets' verdict lines."""
    marks = [m["time_s"] for m in next((s["marks"] for s in result["systems"] if s["marks"]), [])]
    print(f"budget {result['budget_s']:.0f} s per system, clock from launch; held-out accuracy (greedy) of the "
          f"initial model: {_fmt(result['initial_accuracy'], '.3f')}")
    head = "".join(f"{f'acc@{t:.0f}s':>16}" for t in marks)
    width = max([15, *(len(s["system"]) + 1 for s in result["systems"])])
    print(f"  {'system':<{width}}{'steps':>6}{'1st step':>9}{head}{'final':>7}{'reach TRL':>10}"
          f"{'publish':>9}{'write':>7}{'reload':>8}{'MB':>7}")
    for s in result["systems"]:
        if "skipped" in s or ("error" in s and not s["marks"]):
            print(f"  {s['system']:<{width}}{s.get('skipped') or 'failed: ' + s['error'][-300:]}")
            continue
        accs = "".join(f"{_mark_cell(m):>16}" for m in s["marks"])
        w = s.get("weights", {})
        print(f"  {s['system']:<{width}}{s['steps']:>6}{_fmt(s['first_step_s'], '.0f', ' s'):>9}{accs}"
              f"{_fmt(s['final_accuracy'], '.3f'):>7}{_fmt(s['reach_trl_s'], '.0f', ' s'):>10}"
              f"{_fmt(w.get('publish_s'), '.2f', ' s'):>9}{_fmt(w.get('write_s'), '.2f', ' s'):>7}"
              f"{_fmt(w.get('reload_s'), '.2f', ' s'):>8}{_fmt(w.get('version_mb'), '.1f'):>7}")
        if "error" in s:
            print(f"  {'':<{width}}error: {s['error'][-300:]}")
    target = result.get("target_system", "rft-async")
    names = {"half_time": f"{target} reaches TRL's final accuracy in <= half TRL's time",
             "equal_budget": f"{target}'s final accuracy >= TRL's at the same budget",
             "quarter_time": f"{target} reaches TRL's final accuracy in <= a quarter of TRL's time",
             "vs_off_policy": f"{target}'s final accuracy >= rft's (the config's mode) within noise",
             "every_mark": "at every mark the best rft system >= TRL"}
    for system in result["systems"]:
        m = system.get("mismatch")
        if m and m.get("mean") is not None:
            stale = ", ".join(f"{k.replace('plus', '+')}: {v:.4f}" for k, v in m["by_staleness"].items()
                              if v is not None)
            print(f"  {system['system']}: mismatch per step (median) |dlogp| {m['mean']:.4f}, KL {m['kl']:.5f}, "
                  f"{100 * m['frac']:.2f}% past the ratio, max {m['max']:.3f}; by staleness {stale}")
    for system in result["systems"]:
        if system.get("signal"):
            print(f"  {system['system']}: {signal_line(system['signal'])}")
    for system in result["systems"]:
        if system.get("config"):
            print(f"  {system['system']}: ran {system['config']} (evaluated on {result['config']}'s held-out tasks)")
        if system.get("algorithm"):
            print(f"  {dropped_note(system['system'], system['algorithm']['dropped'])}")
    race = result.get("algorithm_race")
    if race:  # a race of algorithms: each against the baseline; TRL's targets only when TRL ran
        print(f"algorithms against {race['baseline']} (noise: 1.96 standard errors of the difference on "
              f"{race['eval_tasks']} tasks){': ' + race['missing'] if 'missing' in race else ''}")
        for name in race["systems"]:
            print(f"  {race_line(name, race)}")
    if race and not any(s["system"] == "trl" for s in result["systems"]):
        return
    for key, verdict in result["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[verdict["met"]]
        print(f"target: {names[key]}: {met} ({verdict['text']})")


# --------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rft bench learn", description="Held-out accuracy against wall-clock for "
                                     "rft and TRL's GRPOTrainer, each trained on the same config for the same budget "
                                     "(the method: benchmarks/learn.py's docstring).")
    parser.add_argument("--config", default="configs/smollm2-arithmetic.yaml",
                        help="the run config, with eval.sets (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=720.0,
                        help="wall-clock seconds per system, from launch (default: %(default)s)")
    parser.add_argument("--marks", type=int, default=3,
                        help="snapshots per budget, evenly spaced (default: %(default)s)")
    parser.add_argument("--lora-config", default="configs/smollm2-arithmetic-lora.yaml",
                        help="the config of the rft-lora system: --config's run with model.lora (default: %(default)s)")
    parser.add_argument("--systems", nargs="+", default=["rft-async,rft-sync,trl"],
                        help=f"systems, comma- or space-separated: {', '.join(SYSTEMS)}, or rft:<algorithm> (the "
                        "config's own mode with that algorithm, e.g. rft:grpo rft:sapo: a race of algorithms, each "
                        f"compared with {RACE_BASELINE}), or a variant <rft system>@<label> (that system again, e.g. "
                        "with --system-config) (default: rft-async,rft-sync,trl)")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every process (0: leave as is)")
    parser.add_argument("--out", default=None, help="keep runs, snapshots and logs here (default: a temporary "
                                                    "directory, removed at the end)")
    parser.add_argument("--seed", type=int, default=None, help="run.seed of every system, TRL's too (default: the "
                        "config's)")
    parser.add_argument("--eval-tasks", type=int, default=None, metavar="N",
                        help="held-out tasks per evaluation: every eval set generates N (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every system, TRL and the evaluation included (repeatable), "
                             "e.g. model.dtype=bfloat16")
    parser.add_argument("--system-set", action="append", default=[], metavar="SYSTEM:KEY=VALUE",
                        help="a config override for one rft system (repeatable), e.g. rft-async-inflight:"
                             "algorithm.importance_sampling=mis or rft:sapo:algorithm.sapo_tau_neg=1.2")
    parser.add_argument("--system-config", action="append", default=[], metavar="SYSTEM=PATH",
                        help="the config one rft system runs instead of --config (repeatable), e.g. "
                             "rft:grpo@openenv=configs/smollm2-arithmetic-openenv.yaml (a variant: SYSTEM@LABEL)")
    parser.add_argument("--target", default="rft-async", help="the system the targets are judged for "
                        "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for item in args.systems for s in item.split(",") if s.strip()]
    args.extra = {}
    for item in args.system_set:
        key, eq, value = item.partition("=")
        system, sep, override = key.rpartition(":")  # the system's own name may hold ':' (rft:sapo)
        if not sep or not eq or not override or not is_rft_system(system):
            parser.error(f"--system-set {item!r}: expected SYSTEM:KEY=VALUE with SYSTEM one of "
                         f"{', '.join(RFT_SYSTEMS)}, rft:<algorithm> or a variant <system>@<label>")
        args.extra.setdefault(system, []).append(f"{override}={value}")
    args.configs = {}
    for item in args.system_config:
        system, eq, path = item.partition("=")
        if not eq or not path or not is_rft_system(system) or system in args.configs:
            parser.error(f"--system-config {item!r}: expected SYSTEM=PATH, once per SYSTEM, with SYSTEM one of "
                         f"{', '.join(RFT_SYSTEMS)}, rft:<algorithm> or a variant <system>@<label>")
        args.configs[system] = path
    unknown = [s for s in args.systems if s not in SYSTEMS and not is_rft_system(s)]
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown} (choose from {', '.join(SYSTEMS)}, rft:<algorithm>, or a variant "
                     "<rft system>@<label>)" if unknown else "--systems: name at least one")
    twice = sorted({s for s in args.systems if args.systems.count(s) > 1})
    if twice:
        parser.error(f"--systems: {', '.join(twice)} named twice")
    for problem in filter(None, map(check_algorithm_system, args.systems)):
        parser.error(f"--systems: {problem}")
    for option, given in (("--system-set", args.extra), ("--system-config", args.configs)):
        idle = sorted(set(given) - set(args.systems))
        if idle:
            parser.error(f"{option}: {', '.join(idle)} is not in --systems {','.join(args.systems)}")
    if args.budget_s <= 0 or args.marks < 1:
        parser.error("--budget-s must be > 0 and --marks >= 1")
    if args.eval_tasks is not None and args.eval_tasks < 1:
        parser.error("--eval-tasks must be >= 1")
    return args


def derived_config(path: str, out: Path, *, seed: int | None, eval_tasks: int | None,
                   overrides: list[str] = (), suffix: str = "bench") -> str:
    """`path` as it is when none is given; else a copy in `out` (`<stem>-<suffix>.yaml`) with `overrides` (`--set`:
    `a.b=value`) applied, `run.seed` = `seed` and every eval set generating `eval_tasks` tasks (ConfigError naming
    the set when one reads a file: its size is the file's)."""
    if seed is None and eval_tasks is None and not overrides:
        return path
    raw = load_yaml(Path(path).read_text()) or {}
    for item in overrides:
        apply_override(raw, item)
    if seed is not None:
        raw.setdefault("run", {})["seed"] = seed
    for i, task_set in enumerate((raw.get("eval") or {}).get("sets") or []):
        if eval_tasks is None:
            break
        if task_set.get("format") not in GENERATED_FORMATS:
            raise ConfigError(f"{path}: eval.sets[{i}]: --eval-tasks resizes generated task sets, not "
                              f"format {task_set.get('format')!r}")
        task_set["generated_tasks"] = eval_tasks
    derived = out / f"{Path(path).stem}-{suffix}.yaml"
    derived.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(derived)


def parameter_count(model_dir: str | os.PathLike) -> int:
    """The parameters in a Hugging Face model directory's `*.safetensors` files, read from their headers (no tensor
    is loaded); 0 when it has none."""
    from safetensors import safe_open

    count = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count


def disk_needed(cfg: Config, systems: list[str], marks: int) -> dict[str, int]:
    """The most bytes each system writes under `--out` (key: system; "slack": the rest, DISK_SLACK_BYTES). An rft
    system's store holds at most `marks` versions kept alive by the marks' hard links plus `sync.keep_versions`, each
    the model in `model.dtype`; TRL saves `marks` float32 snapshots (it trains float32 parameters); a LoRA system's
    versions are adapters, counted as nothing."""
    import torch

    parameters = parameter_count(cfg.model.path)
    need = {"slack": DISK_SLACK_BYTES}
    for system in systems:
        if system == "trl":
            need[system] = marks * parameters * torch.float32.itemsize
        elif not is_lora(system) and RFT_SYSTEMS.get(base_system(system), (None, "pull"))[1] == "pull":
            need[system] = (marks + cfg.sync.keep_versions) * parameters * getattr(torch, cfg.model.dtype).itemsize
    return need


def check_disk(need: dict[str, int], where: Path, free: int) -> str | None:
    """Why the race would not fit in `free` bytes at `where` (None: it fits)."""
    total = sum(need.values())
    if total <= free:
        return None
    parts = ", ".join(f"{name} {size / 1e9:.1f}" for name, size in need.items() if name != "slack" and size)
    return (f"--out {where}: the race writes up to {total / 1e9:.1f} GB (snapshots, GB: {parts}; "
            f"{DISK_SLACK_BYTES / 1e9:.1f} for logs and topics) and {free / 1e9:.1f} GB is free there: free some "
            "space, point --out elsewhere or take fewer --marks")


def free_bytes(where: Path) -> int:
    """Free bytes on the filesystem of `where`, or of its nearest existing parent when it does not exist yet."""
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def check_config(args: argparse.Namespace) -> str | None:
    """Why the config cannot be benchmarked (None: it can)."""
    common = getattr(args, "set", [])  # --set: every system's
    try:
        cfg = load_run_config(args.config, common)
        if "trl" in args.systems:
            check_trl_config(cfg)
    except (ConfigError, TRLReferenceError) as e:
        return f"{args.config}: {e}" if not str(e).startswith(args.config) else str(e)
    if cfg.stages:
        return f"{args.config}: stages: a multi-stage config cannot be benchmarked; give one stage's config"
    own_configs = getattr(args, "configs", {})  # --system-config
    for system in (s for s in args.systems if is_rft_system(s) and (not is_lora(s) or s in own_configs)):
        overrides = rft_overrides(system, Path(tempfile.gettempdir()), getattr(args, "extra", {}).get(system, []))
        path = own_configs.get(system, args.config)
        try:  # each system's own config, settings and --system-set overrides, before anything runs
            problem = check_system_config(path, cfg, common) if system in own_configs else None
            if problem:
                return f"--system-config {system}={path}: {problem}"
            if algorithm_of(system) is None:
                load_run_config(path, [*common, *overrides])
                continue
            with tempfile.TemporaryDirectory(prefix="rft-bench-learn-check-") as scratch:
                config, _ = algorithm_config(path, system, Path(scratch), common)
                load_run_config(config, overrides)
        except (ConfigError, ValueError) as e:
            return f"{system}: {e}"
    if not (Path(cfg.model.path) / "config.json").is_file():
        return (f"{args.config}: model.path: {cfg.model.path} is not a Hugging Face model directory (`make smollm2` "
                "builds the flagship's)")
    if any(is_lora(s) and s not in own_configs for s in args.systems):
        try:
            if not load_run_config(args.lora_config, common).model.lora.rank:
                return f"--lora-config {args.lora_config}: model.lora.rank is 0 (rft-lora needs a LoRA config)"
        except ConfigError as e:
            return str(e)
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        return f"--out {args.out}: not empty (runs there would resume instead of starting afresh)"
    if not cfg.eval.sets:
        return (f"{args.config}: eval.sets: no held-out task set; bench learn measures held-out accuracy (see "
                "configs/smollm2-arithmetic.yaml for one)")
    from safetensors import SafetensorError

    try:
        need = disk_needed(cfg, args.systems, args.marks)
    except (OSError, SafetensorError) as e:
        return f"{args.config}: model.path: {cfg.model.path}: its safetensors files cannot be read ({e})"
    where = Path(args.out or tempfile.gettempdir()).absolute()
    return check_disk(need, where, free_bytes(where))


def check_system_config(path: str, cfg: Config, common: list[str]) -> str | None:
    """Why a `--system-config` cannot race against `cfg` (--config's): its snapshots are evaluated as `cfg`'s, from
    the same initial model, so it must train the same model.path, in one stage (None: it can)."""
    own = load_run_config(path, common)
    if own.stages:
        return "stages: a multi-stage config cannot be benchmarked; give one stage's config"
    if Path(own.model.path).resolve() != Path(cfg.model.path).resolve():
        return f"model.path {own.model.path} is not --config's {cfg.model.path} (the initial model is shared)"
    return None


def run_all(args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    config = derived_config(args.config, out, seed=args.seed, eval_tasks=args.eval_tasks, overrides=args.set)
    lora = any(is_lora(s) and s not in args.configs for s in args.systems)
    lora_config = (derived_config(args.lora_config, out, seed=args.seed, eval_tasks=args.eval_tasks,
                                  overrides=args.set) if lora else None)
    own_configs = {system: derived_config(path, out, seed=args.seed, eval_tasks=args.eval_tasks, overrides=args.set,
                                          suffix=f"bench-{system_dir(system)}")
                   for system, path in args.configs.items()}
    systems = []
    for system in args.systems:
        if system == "trl":
            systems.append(run_trl_system(config, out=out, budget_s=args.budget_s, marks=args.marks, env=env))
            continue
        own, dropped = own_configs.get(system) or (lora_config if is_lora(system) else config), None
        if algorithm_of(system) is not None:
            own, dropped = algorithm_config(own, system, out)
            note(dropped_note(system, dropped))
        systems.append(run_rft(system, own, out=out, budget_s=args.budget_s, marks=args.marks, env=env,
                               extra=args.extra.get(system, []), dropped=dropped))
        if system in args.configs:
            systems[-1]["config"] = args.configs[system]
    scores = evaluate(config, systems, out=out, env=env)
    eval_tasks = sum(s.generated_tasks for s in load_run_config(config).eval.sets)
    result = summarise(systems, scores, budget_s=args.budget_s, target=args.target, eval_tasks=eval_tasks)
    return {"config": args.config, "seed": load_run_config(config).run.seed, "eval_tasks": eval_tasks,
            "marks": args.marks, "threads": args.threads, **result}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problem = check_config(args)
    if problem:
        print(f"rft bench learn: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rft-bench-learn-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = run_all(args, out.resolve())
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    if args.out:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        print(f"{PREFIX} the report: {out / 'result.json'}; the curve: {plot_race(result, out / 'accuracy.png')}",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


def plot_race(result: dict, png: Path) -> Path:
    """Held-out accuracy against wall-clock, one line per system (the initial model at 0 s, then each mark), with a
    band of +-1.96 standard errors (sqrt(p (1 - p) / n) on the report's `eval_tasks`), as a PNG; returns `png`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = result["eval_tasks"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in result["systems"]:
        marks = [m for m in system.get("marks", []) if m.get("accuracy") is not None]
        if not marks:
            continue
        times = [0.0] + [m["time_s"] for m in marks]
        accuracy = [result["initial_accuracy"]] + [m["accuracy"] for m in marks]
        half = [1.96 * math.sqrt(p * (1 - p) / n) for p in accuracy]
        settings = " ".join(o.removeprefix("algorithm.") for o in system.get("settings", [])
                            if algorithm_of(system["system"]) is not None)  # a race of algorithms: their settings
        label = f"{system['system']}{' ' + settings if settings else ''} ({system['steps']} steps)"
        line, = ax.plot(times, accuracy, marker="o", label=label)
        ax.fill_between(times, [p - h for p, h in zip(accuracy, half, strict=True)],
                        [p + h for p, h in zip(accuracy, half, strict=True)],
                        color=line.get_color(), alpha=0.12)
    ax.set(xlabel="wall-clock from launch (s)", ylabel=f"held-out accuracy ({n} tasks)",
           title=f"{Path(result['config']).name}, seed {result['seed']}"
                 + (f", algorithms against {RACE_BASELINE}" if result.get("algorithm_race") else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
