"""`rft bench NAME [options]`: the benchmarks, one module each in benchmarks/ (`main(argv) -> exit code`)."""
from __future__ import annotations

import sys

from rft.cli import run_entry

BENCHMARKS = {
    "transport": "benchmarks.transport:main",
    "generate": "benchmarks.generate:main",
    "modes": "benchmarks.modes:main",
    "learn": "benchmarks.learn:main",
    "membership": "benchmarks.membership:main",
    "simulate": "benchmarks.simulate:main",
    "serve": "benchmarks.serve:main",
    "micro-batches": "benchmarks.micro_batches:main",
    "reload": "benchmarks.reload:main",
    "weights": "benchmarks.weights:main",
    "delivery": "benchmarks.delivery:main",
    "experience": "benchmarks.experience_path:main",
    "inflight": "benchmarks.inflight:main",
    "compression": "benchmarks.compression:main",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        asked = argv[:1] in (["-h"], ["--help"])
        print(f"usage: rft bench {{{' | '.join(BENCHMARKS)}}} [options]", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    return run_entry(BENCHMARKS[argv[0]], argv[1:], command=f"bench {argv[0]}")
