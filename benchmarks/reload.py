"""`rft bench reload`: seconds an explorer's vLLM engine takes to load weight store versions (whole models, or LoRA
adapters beside the base), through `VLLMEngine.load_weights`, the explorer's own call.

Usage: rft bench reload --model BASE_DIR VERSION_DIR [VERSION_DIR ...] [--repeats N] [--lora-rank R] [--json]

One engine on BASE_DIR (LoRA enabled up to rank R when R > 0); each VERSION_DIR (a `vNNNNNNNN` directory of a weight
store, e.g. written by benchmarks/stage_publish.py) is loaded `--repeats` times in turn. Reported per directory: its
size on disk (MB) and the median and every load's seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench reload", description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", help="weight store version directories")
    parser.add_argument("--model", required=True, help="the base HF model directory the engine starts on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: enable vLLM's LoRA up to this rank")
    parser.add_argument("--cpu-kvcache-gb", type=float, default=0.25)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from rft.engine import VLLMEngine  # heavy: vllm

    engine = VLLMEngine(args.model, max_model_len=128, cpu_kvcache_gb=args.cpu_kvcache_gb, lora_rank=args.lora_rank)
    results = []
    try:
        timings: dict[str, list[float]] = {v: [] for v in args.versions}
        for repeat in range(args.repeats):
            for i, version in enumerate(args.versions):
                started = time.perf_counter()
                engine.load_weights(version, 1 + repeat * len(args.versions) + i)
                timings[version].append(time.perf_counter() - started)
        for version, seconds in timings.items():
            size = sum(f.stat().st_size for f in Path(version).iterdir() if f.is_file())
            results.append({"version": version, "mb": round(size / 1e6, 2),
                            "reload_s_median": round(statistics.median(seconds), 3),
                            "reload_s": [round(s, 3) for s in seconds]})
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"model": args.model, "lora_rank": args.lora_rank, "versions": results}))
    else:
        for r in results:
            print(f"{r['version']}: {r['mb']} MB, reload median {r['reload_s_median']} s ({r['reload_s']})")
    return 0
