"""The `rft` console script: one subcommand per role, each a `main(argv) -> exit code` imported lazily
(so that `rft validate` does not pay for importing torch or vLLM)."""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from rft.config import ConfigError, load_config

# name -> ("module:function", one-line help). Every function takes argv (list[str]) and returns an int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("rft.launcher:main", "all-in-one local run: broker, task publisher, explorers, trainer, coordinator"),
    "trainer": ("rft.trainer.main:main", "the Megatron trainer (one process per rank, under torchrun or srun)"),
    "explorer": ("rft.explorer.main:main", "one or more explorers joining a run"),
    "publish": ("rft.explorer.tasks:main", "publish a dataset's tasks to the run's tasks topic"),
    "replay": ("rft.launcher:replay_main", "offline training from an experiences topic (by offsets or time)"),
    "eval": ("rft.evaluation.main:main", "evaluate checkpoints on eval.sets: accuracy, pass@k, mean@k"),
    "validate": ("rft.cli:validate_main", "check a config file; exit 2 naming the bad key"),
    "broker": ("rft.cli:broker_main", "run a local Kafka-protocol broker for development"),
    "topics": ("rft.topics.cli:main", "list | describe | tail | export | import topics"),
    "status": ("rft.status:main", "a live run: trainer, explorer fleet, weight versions, lag, throughput"),
    "bench": ("rft.cli:bench_main", "benchmarks: transport | generate | modes"),
    "tiny-model": ("rft.cli:tiny_model_main", "write a tiny seeded HF model (tests, quickstart)"),
    "bridge-check": ("megatron_bridge.check:main", "check HF <-> Megatron on a model: logits vs transformers, round trip"),
}

BENCHMARKS = {
    "transport": "tools.bench_transport:main",
    "generate": "tools.bench_generate:main",
    "modes": "tools.bench_modes:main",
}


def _call(target: str, argv: list[str]) -> int:
    module, _, func = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        print(f"rft: this command is not available in this build ({target}: {e})", file=sys.stderr)
        return 3
    return int(fn(argv) or 0)


def install_stop_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop` (finish the work in progress, then leave); a second one aborts. A flag, not an
    exception: kafka-python's network code catches BaseException and can swallow a KeyboardInterrupt."""
    def on_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt  # second signal: abort now
        logging.getLogger("rft").info("signal %d: finishing the work in progress, then leaving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process: ask Linux to send `sig` when the parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config file plus `--set a.b.c=value` overrides, shared by every command that takes a config."""
    parser.add_argument("config", help="YAML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set trainer.lr=1e-5 (repeatable)")


def config_from_args(args: argparse.Namespace):
    """Load the config named by `add_config_arguments`; on error print it and exit 2."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rft: invalid config: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def validate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft validate", description="Validate a run config.")
    add_config_arguments(parser)
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.print:
        print(cfg.to_yaml(), end="")
    else:
        print(f"{args.config}: valid (run {cfg.run.name!r}, mode {cfg.run.mode})")
    return 0


def broker_main(argv: list[str]) -> int:
    from rft.broker import serve_forever

    parser = argparse.ArgumentParser(prog="rft broker", description="Run a local Kafka-protocol broker "
                                     "(Tansu in memory, or Apache Kafka KRaft when KAFKA_HOME is set).")
    parser.add_argument("--port", type=int, default=9092)
    return serve_forever(parser.parse_args(argv).port)


def tiny_model_main(argv: list[str]) -> int:
    from rft.tiny_model import make_tiny_model

    parser = argparse.ArgumentParser(prog="rft tiny-model", description="Write a tiny seeded HF model.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="separate output layer")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    path = make_tiny_model(a.out_dir, arch=a.arch, hidden_size=a.hidden_size, layers=a.layers, heads=a.heads,
                           kv_heads=a.kv_heads, tie_word_embeddings=not a.untied, seed=a.seed)
    print(path)
    return 0


def bench_main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: rft bench {{{' | '.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return _call(BENCHMARKS[argv[0]], argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: rft COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<{width}}  {help_text}")
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        import difflib
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"rft: unknown command {name!r}" + (f" (did you mean '{near[0]}'?)" if near else ""), file=sys.stderr)
        return 2
    return _call(COMMANDS[name][0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
