"""Serve one of this folder's OpenEnv environments with OpenEnv's own server (`create_app`, uvicorn): HTTP `/reset`,
`/step`, `/state`, `/health` and the WebSocket `/ws` sessions rft's `openenv` workflow plays episodes over. Runs in
.venv-openenv (`make openenv`), never in rft's venv:

    .venv-openenv/bin/python examples/openenv/server.py frozenlake --port 8011
    .venv-openenv/bin/python examples/openenv/server.py echo --port 8012
    .venv-openenv/bin/python examples/openenv/server.py arithmetic --port 8013 --option "prompt_template={prompt} ..."

`ENV` is a module of this folder (`<ENV>_env.py`) whose `SERVED` is (Environment class, Action class, Observation
class). Each WebSocket session gets its own environment instance, built with the `--option NAME=VALUE` strings as
keyword arguments; `--max-sessions` bounds them (an rft batch holds tasks_per_batch x n_samples sessions at once).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", help="frozenlake, arithmetic or echo (the module <env>_env.py beside this file)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-sessions", type=int, default=256, help="concurrent WebSocket sessions (episodes)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a keyword argument (a string) of the environment's constructor (repeatable)")
    args = parser.parse_args()
    options = {}
    for item in args.option:
        name, eq, value = item.partition("=")
        if not name.isidentifier() or not eq:
            parser.error(f"--option {item!r}: expected NAME=VALUE with NAME a keyword argument")
        options[name] = value
    sys.path.insert(0, str(Path(__file__).parent))
    environment, action, observation = importlib.import_module(f"{args.env}_env").SERVED

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    factory = functools.partial(environment, **options) if options else environment  # a class: its own flags
    try:  # options it does not take, or values it refuses, fail the start rather than every episode
        factory().close()
    except (TypeError, ValueError) as e:
        parser.error(f"{args.env}: cannot build the environment with --option {args.option}: {e}")
    app = create_app(factory, action, observation, env_name=args.env, max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
