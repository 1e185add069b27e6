"""The `rft` console script: only the dispatcher. One subcommand per role, each a `main(argv) -> exit code` named
by an import path and imported when called (so that `rft validate` does not pay for importing vLLM). What the
commands share lives in `rft.cli.commandline`.

Errors every command can meet are reported here, once, as one line on stderr and an exit status (docs/operations.md):
  2  bad input: a config that does not load or check (ConfigError: the file, the key), bad arguments
  3  the command is not available in this build (`rft bench`, `rft chaos` outside a source checkout), or it (or a
     feature it was asked for) needs an optional extra that is not installed (MissingExtra: the feature, the extra
     and the pip command; rft/extras.py)
  4  the Kafka broker cannot be reached (BrokerUnreachable: the address and why) or failed (TransportError), or
     the local broker cannot start (BrokerError: a port in use, a data directory not writable or in use)
`rft --debug COMMAND ...` or RFT_DEBUG=1 shows the traceback instead."""
from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from pathlib import Path

from rft.broker.local import BrokerError
from rft.config import ConfigError
from rft.extras import MissingExtra, require
from rft.registry import RegistryError, import_object
from rft.transport import BrokerUnreachable, TransportError

EXIT_BAD_INPUT, EXIT_UNAVAILABLE, EXIT_BROKER = 2, 3, 4

# name -> ("module:function", one-line help). Every function takes argv (list[str]) and returns an int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("rft.cli.launcher:main", "all-in-one local run: broker, task publisher, explorers, trainer, coordinator"),
    "trainer": ("rft.trainer.main:main", "the Megatron trainer (one process per rank, under torchrun or srun)"),
    "explorer": ("rft.explorer.main:main", "one or more explorers joining a run"),
    "publish": ("rft.explorer.publisher:main", "publish a dataset's tasks to the run's tasks topic"),
    "replay": ("rft.cli.replay:main", "offline training from an experiences topic (by offsets or time)"),
    "serve": ("rft.serve.server:main", "an OpenAI-compatible endpoint whose traffic and feedback become training data"),
    "joiner": ("rft.serve.joiner:main", "serve mode: join served completions and feedback into experience groups"),
    "eval": ("rft.evaluation.main:main", "evaluate checkpoints on eval.sets: accuracy, pass@k, mean@k"),
    "validate": ("rft.cli.validate:main", "check a config file; exit 2 naming the bad key"),
    "broker": ("rft.broker.local:main", "run a local Kafka-protocol broker for development"),
    "topics": ("rft.ops.topics.cli:main", "list | describe | tail | export | import topics"),
    "status": ("rft.ops.status:main", "a live run: trainer, explorer fleet, weight versions, lag, throughput"),
    "records": ("rft.ops.records:main", "collect CONFIG [--dry-run]: delete the claim-checked parts records.collect "
                "allows (retention, or every reader committed past them)"),
    "dashboard": ("rft.dashboard.server:main", "the live run page in a browser: curves, fleet, staleness, throughput"),
    "bench": ("benchmarks.main:main", "benchmarks (from a checkout): transport|generate|modes|learn|membership|"
              "simulate|serve|micro-batches|reload|weights|delivery|experience|inflight|compression"),
    "chaos": ("benchmarks.chaos:main", "fault scenarios against real runs (from a checkout), and a ledger: "
              "acknowledged, trained, lost, twice"),
    "gpu-check": ("rft.ops.gpu_check:main", "prove a GPU machine runs rft's GPU paths (--cpu: the CPU paths): a table"),
    "tiny-model": ("rft.models.tiny:main", "write a tiny seeded HF model (tests, quickstart)"),
    "model": ("rft.models.gguf:main", "model files: import-gguf FILE OUT_DIR (a GGUF into a safetensors HF directory), "
              "build-vlm --language DIR --out DIR (a SmolVLM-shaped VLM from a Llama)"),
    "bridge-check": ("megatron_bridge.check:main",
                     "check HF <-> Megatron on a model: logits vs transformers, round trip"),
}


# Developer tooling that lives in the source checkout beside `rft/` and is not installed with the package.
CHECKOUT_PACKAGES = ("benchmarks",)


def checkout_importable(package: str) -> bool:
    """Whether `package`, a directory of the source checkout (CHECKOUT_PACKAGES), can be imported. When this `rft` is
    a checkout's (an editable install, or PYTHONPATH at one), its root goes first on sys.path and on the PYTHONPATH
    of the processes the command starts; otherwise `package` must be importable as it is (e.g. from the current
    directory)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "setup.py").is_file() and (root / package / "__init__.py").is_file():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(root) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), *paths]))
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # an import hook that refuses the name
        return False


def run_entry(target: str, argv: list[str], *, command: str = "") -> int:
    """Import `module:function` and call it with `argv`; its exit code, or one line and the module docstring's exit
    code for the errors listed there (their traceback with RFT_DEBUG=1). `command` (`serve`, `bench serve`) names
    the command in the error of a module that needs an extra that is not installed."""
    package = target.partition(".")[0]
    if package in CHECKOUT_PACKAGES and not checkout_importable(package):
        print(f"rft: `rft {command or target}` runs from a source checkout of rft ({package}/ is not installed with "
              f"the package): from the repository's root, `python -m rft.cli {command or '...'} ...`", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        require(target.partition(":")[0], feature=f"`rft {command}`" if command else target)
    except MissingExtra as e:
        print(f"rft: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ImportError:
        pass  # import_object says why, below
    try:
        fn = import_object(target, key="rft")
    except RegistryError as e:
        print(f"rft: this command is not available in this build ({target}: {e})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        return int(fn(argv) or 0)
    except (ConfigError, TransportError, BrokerError, MissingExtra) as e:
        if os.environ.get("RFT_DEBUG", "") not in ("", "0"):
            raise
        if isinstance(e, MissingExtra):
            print(f"rft: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        if isinstance(e, ConfigError):
            print(f"rft: invalid config: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        text = str(e) if isinstance(e, BrokerUnreachable) else (
            f"local broker: {e}" if isinstance(e, BrokerError) else f"Kafka: {e}")
        print(f"rft: {text}", file=sys.stderr)
        return EXIT_BROKER


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--debug":  # tracebacks instead of one-line errors, in this process and its children
        os.environ["RFT_DEBUG"] = "1"
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: rft [--debug] COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<{width}}  {help_text}")
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"rft: unknown command {name!r}" + (f" (did you mean '{near[0]}'?)" if near else ""), file=sys.stderr)
        return 2
    return run_entry(COMMANDS[name][0], argv[1:], command=name)

