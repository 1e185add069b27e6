"""`rft bench NAME [options]`: the benchmarks, one module each in rft/bench/ (`main(argv) -> exit code`)."""
from __future__ import annotations

import sys

from rft.cli import run_entry

BENCHMARKS = {
    "transport": "rft.bench.transport:main",
    "generate": "rft.bench.generate:main",
    "modes": "rft.bench.modes:main",
    "learn": "rft.bench.learn:main",
    "membership": "rft.bench.membership:main",
    "simulate": "rft.bench.simulate:main",
    "serve": "rft.bench.serve:main",
    "micro-batches": "rft.bench.micro_batches:main",
    "reload": "rft.bench.reload:main",
    "weights": "rft.bench.weights:main",
    "delivery": "rft.bench.delivery:main",
    "inflight": "rft.bench.inflight:main",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: rft bench {{{' | '.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return run_entry(BENCHMARKS[argv[0]], argv[1:], command=f"bench {argv[0]}")
