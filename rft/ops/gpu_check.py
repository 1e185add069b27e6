"""`python -m rft.ops.gpu_check` (or `rft gpu-check`): one command that proves a fresh GPU machine runs rft's GPU paths.

It prints one row per check (pass / FAIL / skip, the seconds it took, what it found): environment (torch, CUDA,
megatron-core, TE / Apex, vLLM); bridge float32 and bfloat16 (`python -m megatron_bridge.check`: megatron logits
against transformers', round trip); train + checkpoint (one bfloat16 step, a dist-checkpoint save and a bit-exact
reload); float16 (a loss-scaled step's gradient norm against float32's); distributed optim (needs TE or Apex); rft
run (a short sync GRPO run of the tiny model on the toy task, embedded broker, vLLM when installed); mismatch (that
run's trainer vs engine log-probs and importance weights: finite, staleness 0, mean within the dtype's bound);
shared prompts (`trainer.share_prompts` against the padded step: same loss and gradient norm); weight sync (at
SmolLM2-135M's shape: bucket gathering, host copy, store write, engine reload); push (NCCL; skip on one GPU).

Every model is generated on the spot (no downloads, no network): the tiny char-level model and a random model of
SmolLM2-135M-Instruct's configuration. `--cpu` runs the same checks on the CPU paths (gloo, rft's device shim), so
CI keeps the tool from rotting. Exit status: 0 when no row failed, 1 otherwise, 2 on bad arguments (e.g. no GPU
visible without `--cpu`). `--json FILE` also writes the rows. Each check runs in its own process, so one failure
does not hide the rows after it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rft.cli.parts import failure_line

# the directory holding this rft (a checkout, or site-packages): the check processes import rft from it
PACKAGES = Path(__file__).resolve().parents[2]
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}  # x logit scale (megatron_bridge.check); bf16 keeps 8 bits
# the mean |trainer - engine| log-prob of a synchronous step (nats): float32 kernels agree to rounding; bfloat16's 8
# bits give ~1e-2 on this model, and a wrong or stale weights version shows far above either
MISMATCH_BOUND = {"float32": 1e-3, "bfloat16": 0.1}
FLOAT16_GRAD_NORM_TOLERANCE = 0.05  # relative; float16 keeps 11 bits, the loss scale makes the gradients representable
SHARED_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative: loss and grad norm, shared prompts vs padded


@dataclass
class Row:
    check: str
    status: str  # "pass", "FAIL" or "skip"
    seconds: float
    detail: str


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rft.ops.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="check the CPU paths instead (no GPU needed; what CI runs)")
    p.add_argument("--work-dir", help="where models, checkpoints and the run go (default: a temporary directory)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps of the short `rft run`")
    p.add_argument("--only", action="append", default=[], metavar="CHECK",
                   help="run only these checks (repeatable): " + ", ".join(CHECKS))
    p.add_argument("--timeout", type=float, default=600, help="seconds each check may take")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


class Context:
    """What the checks share: the mode, a work directory, generated models (built once, on first use)."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.cpu, self.work, self.args = args.cpu, work, args
        self._models: dict[str, Path] = {}
        self.reports: dict[str, dict] = {}  # a worker's JSON report, for rows that share one worker run

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    @property
    def dtype(self) -> str:
        """The dtype of the rft-run row's run: float32 on --cpu, bfloat16 on a GPU."""
        return "float32" if self.cpu else "bfloat16"

    def model(self, name: str) -> Path:
        """"tiny": rft's tiny char-level qwen2; "smollm2": random weights in SmolLM2-135M's shape (GPU only)."""
        if name not in self._models:
            from rft.models.tiny import make_tiny_model  # heavy: transformers

            out = self.work / "models" / name
            if name == "tiny":
                self._models[name] = make_tiny_model(out, seed=0)
            else:  # SmolLM2-135M-Instruct's shape (its config.json): the real model's size for the weight-sync timings
                self._models[name] = make_tiny_model(out, seed=0, arch="llama", hidden_size=576, layers=30, heads=9,
                                                     kv_heads=3, intermediate_size=1536, vocab_size=49152,
                                                     tie_word_embeddings=True, max_position_embeddings=2048)
        return self._models[name]

    def env(self) -> dict[str, str]:
        """The environment of the check processes: this rft importable (PACKAGES); on --cpu, CUDA hidden."""
        path = os.pathsep.join(filter(None, [str(PACKAGES), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def python(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=PACKAGES, env=self.env(), capture_output=True, text=True,
                              timeout=timeout or self.args.timeout)


def _failure(result: subprocess.CompletedProcess) -> str:
    """The most telling line of a failed process's output: its exception (rft.cli.parts.failure_line, as `rft run`
    reports a failed part), else its last FAIL line, else its last line."""
    lines = [line for line in (result.stdout + "\n" + result.stderr).splitlines() if line.strip()]
    fails = [line for line in lines if "FAIL" in line]
    return (failure_line(lines) or (fails or lines or [f"exit {result.returncode}"])[-1]).strip()[:300]


# ---- the checks: each returns (status, detail)

def check_environment(ctx: Context) -> tuple[str, str]:
    import torch

    parts = [f"torch {torch.__version__}"]
    if ctx.cpu:
        parts.append("CPU paths (--cpu)")
    elif not torch.cuda.is_available():
        return "FAIL", "torch sees no CUDA device (run with --cpu to check the CPU paths)"
    else:
        props = torch.cuda.get_device_properties(0)
        parts.append(f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB, "
                     f"CUDA {torch.version.cuda})")
    for name, module in (("megatron-core", "megatron.core"), ("transformer-engine", "transformer_engine"),
                         ("apex", "apex"), ("vllm", "vllm")):
        parts.append(f"{name} {_version(module) or 'absent'}")
    if _version("megatron.core") is None:
        return "FAIL", "; ".join(parts)
    return "pass", "; ".join(parts)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # an import hook that refuses the name
        return False


def _version(module: str) -> str | None:
    if not _installed(module.split(".")[0]):
        return None
    try:
        imported = __import__(module, fromlist=["__version__"])
    except Exception as e:  # installed but broken: say how
        return f"(import fails: {type(e).__name__})"
    return str(getattr(imported, "__version__", "present"))


def _bridge(ctx: Context, dtype: str) -> tuple[str, str]:
    model = ctx.model("tiny" if ctx.cpu else "smollm2")
    result = ctx.python("-m", "megatron_bridge.check", str(model), "--dtype", dtype, "--tolerance",
                        str(TOLERANCE[dtype]), "--seq-len", "64")
    found = re.search(r"max \|megatron - transformers\| = (\S+) \(tolerance (\S+) x logit scale (\S+)\)",
                      result.stdout)
    detail = (f"{model.name}: max |logit diff| {found[1]} (allowed {found[2]} x scale {found[3]})"
              if found else _failure(result))
    if result.returncode == 0:
        return "pass", detail + "; export round trip bit-exact"
    round_trip = re.search(r"round trip HF -> megatron -> HF: (.*)", result.stdout)
    return "FAIL", detail + (f"; round trip: {round_trip[1]}" if round_trip else "")


def check_bridge_float32(ctx: Context) -> tuple[str, str]:
    return _bridge(ctx, "float32")


def check_bridge_bfloat16(ctx: Context) -> tuple[str, str]:
    return _bridge(ctx, "bfloat16")


def _train_report(ctx: Context) -> dict:
    """Run the train + checkpoint worker once (two rows read its report)."""
    if "train" not in ctx.reports:
        out = ctx.work / "train.json"
        result = ctx.python("-m", "rft.ops.gpu_check_worker", "train",
                            str(ctx.model("tiny" if ctx.cpu else "smollm2")), str(ctx.work / "checkpoint"), str(out))
        ctx.reports["train"] = json.loads(out.read_text()) if result.returncode == 0 else {"error": _failure(result)}
    return ctx.reports["train"]


def check_train_checkpoint(ctx: Context) -> tuple[str, str]:
    r = _train_report(ctx)
    if "error" in r:
        return "FAIL", r["error"]
    detail = (f"{r['model']}: step {r['step_s']:.2f} s (loss {r['loss']:.3f}, grad norm {r['grad_norm']:.3g}), "
              f"save {r['save_s']:.2f} s, load {r['load_s']:.2f} s"
              + (f", peak GPU memory {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""))
    problems = [p for p, bad in (("the step was skipped", r["skipped"]), ("the loss is not finite", not r["finite"]),
                                 (f"{r['mismatched']} tensors differ after the reload", r["mismatched"])) if bad]
    return ("FAIL", detail + "; " + "; ".join(problems)) if problems else ("pass", detail + "; reload bit-exact")


def check_float16(ctx: Context) -> tuple[str, str]:
    r = _train_report(ctx)
    if "error" in r:
        return "FAIL", r["error"]
    f16, f32 = r["float16"]["float16"], r["float16"]["float32"]
    detail = (f"grad norm {f16['grad_norm']:.4g} in float16 (loss scale {f16['scale']:g}) vs {f32['grad_norm']:.4g} "
              "in float32")
    if f16["skipped"]:
        return "FAIL", detail + "; the float16 step was skipped (gradients overflowed)"
    if abs(f16["grad_norm"] / f32["grad_norm"] - 1) > FLOAT16_GRAD_NORM_TOLERANCE:
        return "FAIL", detail + f"; differ by more than {FLOAT16_GRAD_NORM_TOLERANCE:.0%}"
    return "pass", detail


def check_distributed_optimizer(ctx: Context) -> tuple[str, str]:
    r = _train_report(ctx)
    if "error" in r:
        return "FAIL", r["error"]
    if not r["distributed_optimizer"]:
        return "skip", ("neither Transformer Engine nor Apex is installed: megatron uses torch's AdamW, and rft the "
                        "non-distributed optimizer (megatron_bridge.policy)")
    return "pass", "the train + checkpoint row ran with megatron's distributed optimizer"


def _run_report(ctx: Context) -> dict:
    """Run the short `rft run` once (the rft-run and mismatch rows read it): sync mode, GRPO with the decoupled
    objective and truncated importance weights (`off_policy_correction`, the GPU configs' setting), so its metrics
    hold the training-inference mismatch and the correction's weights."""
    if "run" in ctx.reports:
        return ctx.reports["run"]
    import yaml

    engine = "vllm" if _installed("vllm") and not ctx.cpu else "transformers"
    run_dir = ctx.work / "runs" / "gpu-check"
    config = {
        "run": {"name": "gpu-check", "mode": "sync", "max_steps": ctx.args.steps, "output_dir": str(ctx.work / "runs"),
                "share_gpus": True},
        "model": {"path": str(ctx.model("tiny")), "max_prompt_len": 8, "max_response_len": 1,
                  "dtype": ctx.dtype},
        "kafka": {"bootstrap_servers": "embedded", "partitions": 2},
        "explorer": {"replicas": 1, "engine": engine, "n_samples": 8, "max_tokens": 1, "tasks_per_batch": 8,
                     "workflow": "single_turn", "reward": "char_accuracy", "gpu_memory_utilization": 0.3},
        "trainer": {"groups_per_step": 8, "micro_batch_size": 64, "lr": 3e-3},
        "algorithm": {"name": "grpo", "off_policy_correction": True},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 200},
        "monitor": {"progress": False},
    }
    path = ctx.work / "gpu-check.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    result = ctx.python("-m", "rft.cli", "run", str(path))
    metrics, log = run_dir / "metrics.jsonl", run_dir / "logs" / "trainer.log"
    ctx.reports["run"] = {
        "engine": engine, "seconds": time.monotonic() - started, "result": result,
        "steps": [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else [],
        "trainer_log": log.read_text(errors="replace") if log.exists() else ""}
    return ctx.reports["run"]


def check_rft_run(ctx: Context) -> tuple[str, str]:
    r = _run_report(ctx)
    steps, seconds, result = r["steps"], r["seconds"], r["result"]
    placed = re.search(r"\[trainer\] .* on (\w+) \((\w+)\)", r["trainer_log"])
    detail = (f"{len(steps)}/{ctx.args.steps} steps in {seconds:.0f} s, explorer engine {r['engine']}, "
              f"reward {steps[0]['reward_mean']:.2f} -> {steps[-1]['reward_mean']:.2f}" if steps
              else f"no step finished in {seconds:.0f} s")
    if result.returncode != 0 or len(steps) < ctx.args.steps:
        return "FAIL", detail + "; " + _failure(result)
    where = f"trainer on {placed[1]} ({placed[2]})" if placed else "the trainer did not say where it ran"
    if placed is None or placed[1] != ctx.device.split(":")[0]:
        return "FAIL", f"{detail}; {where}, expected {ctx.device}"
    return "pass", f"{detail}, {where}"


def check_mismatch(ctx: Context) -> tuple[str, str]:
    """The training-inference mismatch of the rft-run row's steps (rft/algorithms/mismatch.py): the trainer's
    log-probs against the engine's, both on this machine's device and dtype. The run is synchronous, so every token
    is of staleness 0 (the `stale0` bucket must hold them all) and what remains is numerics: kernels and dtype."""
    r = _run_report(ctx)
    steps = r["steps"]
    if not steps:
        return "FAIL", "the rft-run row finished no step; " + _failure(r["result"])
    keys = ("logprob_mismatch_mean", "logprob_mismatch_max", "logprob_mismatch_kl", "logprob_mismatch_frac",
            "logprob_mismatch_stale0_mean", "importance_weight_mean", "importance_weight_truncated_frac")
    missing = sorted({k for s in steps for k in keys if not isinstance(s.get(k), (int, float))})
    if missing:
        return "FAIL", f"metrics.jsonl lacks {', '.join(missing)}"
    values = {k: [float(s[k]) for s in steps] for k in keys}
    bound = MISMATCH_BOUND[ctx.dtype]
    detail = (f"{len(steps)} steps, trainer vs {r['engine']} engine in {ctx.dtype}: mean abs dlogp "
              f"{max(values['logprob_mismatch_mean']):.2e} (allowed {bound:g}), max "
              f"{max(values['logprob_mismatch_max']):.2e}, KL {max(values['logprob_mismatch_kl']):.2e}, tokens past "
              f"2x {max(values['logprob_mismatch_frac']):.1%}; TIS weight mean "
              f"{min(values['importance_weight_mean']):.4f}-{max(values['importance_weight_mean']):.4f}, truncated "
              f"{max(values['importance_weight_truncated_frac']):.1%}")
    stale0_all = all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-12) for a, b in
                     zip(values["logprob_mismatch_mean"], values["logprob_mismatch_stale0_mean"], strict=True))
    problems = [p for p, bad in (
        ("a value is not finite", not all(math.isfinite(v) for vs in values.values() for v in vs)),
        ("stale0 does not hold every token of a synchronous run", not stale0_all),
        (f"the mean mismatch exceeds {bound:g}", max(values["logprob_mismatch_mean"]) > bound)) if bad]
    return ("FAIL", detail + "; " + "; ".join(problems)) if problems else ("pass", detail)


def check_shared_prompts(ctx: Context) -> tuple[str, str]:
    """The trainer's step with shared prompts (megatron_bridge.shared_prompts) against the padded step, the same
    rows (the flagship's groups): it must be in use here, agree on loss and gradient norm, and its time is shown."""
    out = ctx.work / "shared.json"
    model = ctx.model("tiny" if ctx.cpu else "smollm2")
    result = ctx.python("-m", "rft.ops.gpu_check_worker", "shared", str(model), "3", str(out))
    if result.returncode != 0:
        return "FAIL", _failure(result)
    r = json.loads(out.read_text())
    if not r["active"]:
        return "FAIL", f"shared prompts are not in use: {r['describe']}"
    padded, shared = r["padded"], r["shared"]
    tolerance = SHARED_TOLERANCE[r["dtype"]]
    detail = (f"{r['model']} {r['dtype']}, 32 rows in groups of 8: padded {padded['step_s']:.2f} s/step, shared "
              f"{shared['step_s']:.2f} s/step; loss {padded['loss']:.5f} vs {shared['loss']:.5f}, grad norm "
              f"{padded['grad_norm']:.4g} vs {shared['grad_norm']:.4g} (allowed {tolerance:.0e} relative)")
    differ = [name for name in ("loss", "grad_norm")
              if not math.isclose(padded[name], shared[name], rel_tol=tolerance, abs_tol=tolerance * 1e-2)]
    return ("FAIL", detail + f"; {', '.join(differ)} differ") if differ else ("pass", detail)


def check_weight_sync(ctx: Context) -> tuple[str, str]:
    out = ctx.work / "sync.json"
    model = ctx.model("tiny" if ctx.cpu else "smollm2")
    result = ctx.python("-m", "rft.ops.gpu_check_worker", "sync", str(model), str(ctx.work / "store"), str(out))
    if result.returncode != 0:
        return "FAIL", _failure(result)
    r = json.loads(out.read_text())
    return "pass", (f"{r['model']} {r['megabytes']:.0f} MB {r['dtype']}: gather {r['gather_s']:.2f} s, host copy "
                    f"{r['host_copy_s']:.2f} s, store write {r['write_s']:.2f} s, engine reload {r['reload_s']:.2f} s "
                    f"(transformers engine on {r['engine_device']})")


def check_push(ctx: Context) -> tuple[str, str]:
    import torch

    if ctx.cpu:
        return "skip", "the gloo push path is tested by the suite (tests/integration/test_weight_push.py)"
    if torch.cuda.device_count() < 2:
        return "skip", "needs 2 GPUs: NCCL puts one rank per device, and the push group's sender and receiver " \
                       "are two ranks"
    return "skip", "not measured by this tool yet: `rft bench learn` has a push system (rft-async-push)"


CHECKS = {
    "environment": check_environment,
    "bridge-float32": check_bridge_float32,
    "bridge-bfloat16": check_bridge_bfloat16,
    "train-checkpoint": check_train_checkpoint,
    "float16": check_float16,
    "distributed-optimizer": check_distributed_optimizer,
    "rft-run": check_rft_run,
    "mismatch": check_mismatch,
    "shared-prompts": check_shared_prompts,
    "weight-sync": check_weight_sync,
    "push-nccl": check_push,
}


def run_check(name: str, ctx: Context) -> Row:
    started = time.monotonic()
    try:
        status, detail = CHECKS[name](ctx)
    except subprocess.TimeoutExpired:
        status, detail = "FAIL", f"timed out after {ctx.args.timeout:.0f} s"
    except Exception as e:  # a check's own crash is a failed row, not a lost table
        status, detail = "FAIL", f"{type(e).__name__}: {e}"[:300]
    return Row(name, status, round(time.monotonic() - started, 1), detail)


def print_table(rows: list[Row]) -> None:
    width = max(len(r.check) for r in rows)
    print(f"\n| {'check'.ljust(width)} | result | seconds | detail |")
    print(f"| {'-' * width} | ------ | ------- | ------ |")
    for r in rows:
        detail = r.detail.replace("|", "\\|")  # a detail's own bars (|logit diff|) would split its cell
        print(f"| {r.check.ljust(width)} | {r.status.ljust(6)} | {r.seconds:7.1f} | {detail} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible to torch; `--cpu` checks the CPU paths", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rft-gpu-check-") as tmp:
        work = Path(args.work_dir or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, work)
        rows = []
        for name in args.only or CHECKS:
            print(f"[gpu-check] {name} ...", flush=True)
            rows.append(run_check(name, ctx))
            print(f"[gpu-check] {name}: {rows[-1].status} ({rows[-1].seconds:.1f} s) {rows[-1].detail}", flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
