"""`rft bench NAME [options]`: the benchmarks, one module each in tools/ (`main(argv) -> exit code`)."""
from __future__ import annotations

import sys

from rft.cli import run_entry

BENCHMARKS = {
    "transport": "tools.bench_transport:main",
    "generate": "tools.bench_generate:main",
    "modes": "tools.bench_modes:main",
    "learn": "tools.bench_learn:main",
    "membership": "tools.bench_membership:main",
    "simulate": "tools.simulate:main",
    "serve": "tools.bench_serve:main",
    "micro-batches": "tools.bench_micro_batches:main",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: rft bench {{{' | '.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return run_entry(BENCHMARKS[argv[0]], argv[1:])
