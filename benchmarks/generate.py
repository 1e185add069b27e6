"""`rft bench generate`: generation throughput of the explorer's vLLM engine vs Hugging Face `generate`.

Same model, same prompts (toy `copy_char` prompts, all the same length, so HF needs no padding), same
sampling (temperature, top-p, n samples per prompt, at most `--max-tokens` new tokens), one process.
Each side generates the whole batch `--repeats` times after a short warm-up; tokens/s is the best
repeat (the machine may be shared) and every repeat is reported. Tokens count up to and including EOS
(what an explorer keeps). Engine start is reported, not timed. HF runs first: vLLM's CPU backend
changes torch's thread settings when it starts. vLLM's log goes to stderr, so `--json` prints one line.

`--continuous`: no HF; one vLLM engine runs the same toy tasks as offline `generate` of all prompts in one call (the
limit), as the continuous explorer submits them (`explorer.continuous`, rft/explorer/continuous.py) and as the batch
loop explores them (`explorer.tasks_per_batch`); each side's tokens/s and its ratio to offline. Sampling runs until EOS
or `--max-tokens`, so response lengths vary (the report gives their spread).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from rft.data.config import DataConfig
from rft.data.tasks import load_rows, rows_to_tasks
from rft.data.toy_tasks import generate_rows
from rft.engine import SamplingSettings, VLLMEngine
from rft.explorer.config import ExplorerConfig
from rft.explorer.continuous import Continuous
from rft.models.config import ModelConfig
from rft.models.tiny import make_tiny_model
from rft.rewards import build_reward
from rft.workflows import build_workflow


def _prompts(count: int, seed: int) -> list[str]:
    return [row["prompt"] for row in generate_rows("copy_char", count, seed=seed)]


def _timed(generate, repeats: int) -> dict:
    """Run `generate() -> tokens` `repeats` times; the best rate and every repeat's seconds."""
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = generate()
        runs.append((tokens, time.perf_counter() - started))
    tokens, seconds = max(runs, key=lambda r: r[0] / r[1])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "repeat_seconds": [round(s, 3) for _, s in runs]}


def _interleaved(sides: dict, repeats: int) -> dict:
    """`_timed` for several sides, one run of each in turn per repeat (a shared machine's load hits all sides alike)."""
    runs: dict[str, list] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, generate in sides.items():
            runs[name].append(_timed(generate, 1))
    out = {}
    for name, results in runs.items():
        best = max(results, key=lambda r: r["tokens_per_s"])
        out[name] = {**best, "repeat_seconds": [r["seconds"] for r in results],
                     "repeat_tokens_per_s": [round(r["tokens_per_s"]) for r in results]}
    return out


def bench_transformers(model_dir: str, prompts: list[str], *, n: int, max_tokens: int, temperature: float,
                       top_p: float, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts])
    settings = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, num_return_sequences=n,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)

    def generate() -> int:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, **settings)
        return sum(_kept_length(row.tolist(), tokenizer.eos_token_id) for row in out[:, ids.shape[1]:])

    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, **settings)  # warm-up
    return {**_timed(generate, repeats), "torch_threads": torch.get_num_threads()}


def _kept_length(row: list[int], eos: int) -> int:
    return row.index(eos) + 1 if eos in row else len(row)


def bench_vllm(model_dir: str, prompts: list[str], *, n: int, max_tokens: int, temperature: float, top_p: float,
               cpu_kvcache_gb: float, in_process: bool | None, repeats: int) -> dict:

    started = time.perf_counter()
    engine = VLLMEngine(model_dir, max_model_len=max_tokens + 16, cpu_kvcache_gb=cpu_kvcache_gb, in_process=in_process)
    start_s = time.perf_counter() - started
    encoded = [engine.encode(p) for p in prompts]
    sampling = SamplingSettings(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens)

    def generate() -> int:
        return sum(len(c.token_ids) for g in engine.generate(encoded, sampling) for c in g.completions)

    try:
        engine.generate(encoded[:2], SamplingSettings(n=n, temperature=temperature, top_p=top_p, max_tokens=2))
        timed = _timed(generate, repeats)
    finally:
        engine.close()
    return {**timed, "engine_start_s": start_s, "in_process": engine.in_process}


def _tasks(count: int, seed: int) -> list:

    data = DataConfig(path="copy_char", format="generated", generated_tasks=count, shuffle_seed=seed)
    return rows_to_tasks(load_rows(data), data, run_id="bench")


def _response_tokens(results) -> list[int]:
    return [len(s.response_tokens) for r in results for s in r.samples]


def bench_continuous(model_dir: str, count: int, *, seed: int, n: int, max_tokens: int, temperature: float,
                     top_p: float, cpu_kvcache_gb: float, in_process: bool | None, repeats: int, max_inflight: int,
                     tasks_per_batch: int) -> dict:
    """One vLLM engine, the same tasks three ways: offline `generate` of all prompts in one call (the limit), the
    continuous explorer's submission (rft/explorer/continuous.py `Continuous`: up to `max_inflight` tasks in the
    engine, each group scored when its n samples are done), and the batch loop's `workflow.explore` on batches of
    `tasks_per_batch`. Tokens are response tokens kept (through EOS); the sides take turns, each side's best repeat;
    `paired_ratios`: each round's tokens/s over offline's in the same round (steadier on a shared machine)."""

    explorer = ExplorerConfig(n_samples=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              tasks_per_batch=tasks_per_batch, max_inflight=max_inflight, reward="char_accuracy")
    model = ModelConfig(path=model_dir, max_prompt_len=32, max_response_len=max_tokens)
    tasks = _tasks(count, seed)
    started = time.perf_counter()
    engine = VLLMEngine(model_dir, max_model_len=max_tokens + 32, cpu_kvcache_gb=cpu_kvcache_gb, seed=seed,
                        in_process=in_process)
    start_s = time.perf_counter() - started
    workflow = build_workflow(explorer, model, build_reward(explorer))
    lengths: dict[str, list[int]] = {}

    def offline() -> int:
        prompts = [workflow.prepare(t, engine) for t in tasks]
        got = [len(c.token_ids) for g in engine.generate(prompts, workflow.sampling) for c in g.completions]
        lengths["offline"] = got
        return sum(got)

    def continuous() -> int:
        scheduler, queue, results = Continuous(engine, workflow, max_inflight), list(tasks), []
        while queue or scheduler.inflight:
            while queue and scheduler.free():
                done = scheduler.submit(queue.pop(0), None)
                if done is not None:
                    results.append(done.result)
            results.extend(f.result for f in scheduler.step())
        lengths["continuous"] = _response_tokens(results)
        return sum(lengths["continuous"])

    def batches() -> int:
        results = []
        for i in range(0, len(tasks), tasks_per_batch):
            results.extend(workflow.explore(tasks[i:i + tasks_per_batch], engine))
        lengths["batch"] = _response_tokens(results)
        return sum(lengths["batch"])

    try:
        engine.generate([workflow.prepare(t, engine) for t in tasks[:2]], workflow.sampling)  # warm-up
        timed = _interleaved({"offline": offline, "continuous": continuous, "batch": batches}, repeats)
    finally:
        engine.close()
    limit = timed["offline"]["tokens_per_s"]
    for name, r in timed.items():
        got = sorted(lengths[name])
        paired = sorted(a / b for a, b in
                        zip(r["repeat_tokens_per_s"], timed["offline"]["repeat_tokens_per_s"], strict=True))
        r.update(ratio=r["tokens_per_s"] / limit, paired_ratios=[round(x, 3) for x in paired],
                 median_paired_ratio=paired[len(paired) // 2], sequences=len(got), mean_len=sum(got) / len(got),
                 median_len=got[len(got) // 2], max_len=got[-1], min_len=got[0])
    return {**timed, "engine_start_s": start_s, "in_process": engine.in_process, "max_inflight": max_inflight,
            "tasks_per_batch": tasks_per_batch}


def _print_continuous(result: dict, args) -> None:
    print(f"{args.prompts} tasks x {args.n} samples, <= {args.max_tokens} tokens, T={args.temperature}, "
          f"top_p={args.top_p}; continuous: max_inflight {result['max_inflight']} tasks, batch loop: "
          f"tasks_per_batch {result['tasks_per_batch']}")
    for name in ("offline", "continuous", "batch"):
        r = result[name]
        print(f"  {name:<11} {r['tokens']:>7} tokens  {r['seconds']:7.2f} s  {r['tokens_per_s']:8.0f} tokens/s  "
              f"{r['ratio']:.2f} of offline (same-round median {r['median_paired_ratio']:.2f})  "
              f"(response length min/median/mean/max {r['min_len']}/{r['median_len']}/{r['mean_len']:.1f}/"
              f"{r['max_len']})")
    print(f"  (vLLM engine start {result['engine_start_s']:.1f} s, not timed; "
          f"{'in-process' if result['in_process'] else 'separate'} engine core)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench generate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--cpu-kvcache-gb", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (best one reported)")
    parser.add_argument("--vllm-in-process", choices=["auto", "yes", "no"], default="auto",
                        help="vLLM engine core in this process (explorer.vllm_in_process; auto: yes on CPU)")
    parser.add_argument("--continuous", action="store_true",
                        help="instead of HF: the continuous explorer's submission and the batch loop against the same "
                             "engine's offline generate of the same prompts (variable response lengths: sampling "
                             "until EOS or --max-tokens)")
    parser.add_argument("--max-inflight", type=int, default=64, help="--continuous: explorer.max_inflight (tasks)")
    parser.add_argument("--tasks-per-batch", type=int, default=8,
                        help="--continuous: explorer.tasks_per_batch of the batch loop compared")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with tempfile.TemporaryDirectory(prefix="rft-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = str(make_tiny_model(Path(tmp) / "tiny"))
        if args.continuous:
            in_process = {"auto": None, "yes": True, "no": False}[args.vllm_in_process]
            result = bench_continuous(model_dir, args.prompts, seed=args.seed, n=args.n, max_tokens=args.max_tokens,
                                      temperature=args.temperature, top_p=args.top_p,
                                      cpu_kvcache_gb=args.cpu_kvcache_gb, in_process=in_process,
                                      repeats=args.repeats, max_inflight=args.max_inflight,
                                      tasks_per_batch=args.tasks_per_batch)
            result = {"model": args.model or "tiny (rft.models.tiny defaults)", "prompts": args.prompts, "n": args.n,
                      "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                      "repeats": args.repeats, **result}
            print(json.dumps(result)) if args.json else _print_continuous(result, args)
            return 0
        prompts = _prompts(args.prompts, args.seed)
        sampling = dict(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        hf = bench_transformers(model_dir, prompts, repeats=args.repeats, **sampling)
        in_process = {"auto": None, "yes": True, "no": False}[args.vllm_in_process]
        vllm = bench_vllm(model_dir, prompts, cpu_kvcache_gb=args.cpu_kvcache_gb, in_process=in_process,
                          repeats=args.repeats, **sampling)
    result = {"model": args.model or "tiny (rft.models.tiny defaults)", "prompts": args.prompts, **sampling,
              "repeats": args.repeats,
              "vllm": vllm, "transformers": hf, "speedup": vllm["tokens_per_s"] / hf["tokens_per_s"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.prompts} prompts x {args.n} samples, <= {args.max_tokens} tokens, T={args.temperature}, "
              f"top_p={args.top_p}")
        for name in ("vllm", "transformers"):
            r = result[name]
            print(f"  {name:<13} {r['tokens']:>7} tokens  {r['seconds']:7.2f} s  {r['tokens_per_s']:10.0f} tokens/s")
        print(f"  speedup       {result['speedup']:.1f}x (vLLM engine start {vllm['engine_start_s']:.1f} s, not timed; "
              f"{'in-process' if vllm['in_process'] else 'separate'} engine core)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
