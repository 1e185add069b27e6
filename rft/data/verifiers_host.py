"""Run by the verifiers venv's python (`make hub-envs`: .cache/verifiers), never imported by rft: verifiers 0.4.0
(v1) cannot share rft's venv (it pins openai<3 and mcp==2.0.0), so rft starts this file as a separate process.

    python verifiers_host.py tasks --env JSON [--limit N]    one JSON line per task: the taskset's TaskData, dumped
    python verifiers_host.py serve --env JSON [--address A]  verifiers' own env server (ZMQ ROUTER + msgpack); its
                                                              first stdout line is `address tcp://HOST:PORT`

`--env` is a verifiers `EnvConfig` as JSON (`{"taskset": {"id": ..., ...}, "agent": {...}}`), resolved by verifiers'
`resolve_env_config` exactly as its CLI and its env-server wire do. The environment's module is imported by its
taskset id from the interpreter's path (PYTHONPATH).
"""
import argparse
import asyncio
import json
import os
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["tasks", "serve"])
    parser.add_argument("--env", required=True, help="the verifiers EnvConfig as JSON")
    parser.add_argument("--address", default="tcp://127.0.0.1:0", help="serve: the ZMQ address to bind")
    parser.add_argument("--limit", type=int, default=0, help="tasks: at most this many (0: all; an infinite "
                        "taskset needs a limit)")
    parser.add_argument("--max-concurrent", type=int, default=0, help="serve: episodes in flight (0: no bound)")
    args = parser.parse_args()
    from verifiers.v1.utils.loaders import load_taskset, resolve_env_config

    config = resolve_env_config(json.loads(args.env))
    if args.mode == "tasks":
        taskset = load_taskset(config.taskset)
        if not taskset.bounded and not args.limit:
            sys.exit(f"taskset {config.taskset.id!r} is infinite: give a limit")
        for n, task in enumerate(taskset):
            if args.limit and n >= args.limit:
                break
            print(json.dumps(task.data.model_dump(mode="json")), flush=True)
        return
    from verifiers.v1.serve.server import EnvServer

    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    server = EnvServer(config, address=args.address, max_concurrent=args.max_concurrent or None)
    print(f"address {server.address}", flush=True)
    try:
        asyncio.run(server.run())
    except KeyboardInterrupt:
        pass


def _exit_with_parent(parent: int) -> None:
    """The server lives no longer than the process that started it (rft's explorer)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


if __name__ == "__main__":
    main()
