"""`rft serve CONFIG [--port P]`: an OpenAI-compatible endpoint whose traffic becomes training data (FastAPI + uvicorn).

This module composes it from the config (`build_service`) and runs it (`--host` overrides serve.host). The parts:
  rft/serve/requests.py      what a request may ask, messages -> prompt ids, the OpenAI-style error (`ApiError`)
  rft/serve/engine_thread.py the one thread that owns the engine, batches requests, reloads weights between calls
  rft/serve/service.py       limits, tokenizer thread, every completion recorded (acknowledged) before it is answered
  rft/serve/feedback.py      the feedback a client may send; rft/serve/ledger.py whether a completion may take it
  rft/serve/app.py           the routes, the access checks before them, streaming
The engine is the explorers' (`explorer.engine` and its settings), started with the newest weights of the run's
store; `serve.adapters` adds other LoRA runs' adapters beside it. The ledger is read back from the served and
feedback topics at start, so a restarted server refuses what it refused before. Exit 2 when the keys cannot be read
or the server would listen beyond loopback without one (docs/security.md), 1 when it cannot listen.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rft.engine import build_engine
from rft.engine.base import TokenizerMixin
from rft.observability.access import AccessConfigError, serve_access
from rft.run.records import run_transport
from rft.schema import RewardRange
from rft.serve.app import create_app
from rft.serve.engine_thread import EngineWorker
from rft.serve.ledger import FeedbackLedger
from rft.serve.part import part_config
from rft.serve.requests import ImageLimits, image_renderer, renderer
from rft.serve.service import Limits, ServeService
from rft.transport.run_topics import RunTopics
from rft.weights.store import WeightStore
from rft.weights.stores import open_store
from rft.weights.subscriber import WeightUpdates

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.run.config import Config
    from rft.transport import Transport

log = logging.getLogger("rft.serve")


def build_service(cfg: Config, *, transport: Transport | None = None, engine_factory=None) -> ServeService:
    """The service `cfg` describes, its engine started (`engine_factory` defaults to the explorers' `build_engine`)
    with the newest weights of the run's store, its ledger read back from the topics."""
    transport = transport or run_transport(cfg)
    topics = RunTopics.of(cfg)
    admin = transport.admin()
    try:
        admin.create_topics([topics.served, topics.feedback, topics.control, topics.dead_letter])
    finally:
        admin.close()
    control = transport.source(client_id="serve-control")
    control.assign([topics.control])
    control.seek(control.end_offsets(topics.control))
    updates = WeightUpdates(open_store(cfg.sync, cfg.run_dir), control, verify=cfg.sync.verify)
    worker = EngineWorker(engine_factory or (lambda: build_engine(cfg.explorer, cfg.model, seed=cfg.run.seed,
                                                                  max_loras=1 + len(cfg.serve.adapters))),
                          newest=updates.newest, max_batch=cfg.serve.max_batch,
                          adapters=adapter_stores(cfg))
    ledger = FeedbackLedger(cfg.serve.feedback_expire_s)
    reader = transport.source(client_id="serve-ledger")
    try:
        loaded = ledger.load(reader, topics.served, topics.feedback, claims=transport.claims)
    finally:
        reader.close()
    log.info("ledger: %d served / feedback records read back", loaded)
    worker.start()
    render, tokenizer = renderer(cfg.model), _own_copy(_tokenizer_of(worker.engine))
    processor = getattr(worker.engine, "processor", None)  # a vision-language model's (rft.engine.VisionEngine)
    return ServeService(worker=worker, sink=transport.sink(client_id="serve"), ledger=ledger, topics=topics,
                        model_name=cfg.serve.model_name or cfg.run.name, max_tokens=cfg.model.max_response_len,
                        tokenize=lambda messages: render(tokenizer, messages), limits=Limits.of(cfg.serve),
                        rewards=RewardRange.of(cfg.run),
                        ack_timeout_s=cfg.kafka.request_timeout_ms / 1000,
                        images=ImageLimits.of(cfg.serve, vision=processor is not None),
                        render_images=(image_renderer(cfg.model, _own_copy(processor), cfg.serve.max_image_pixels)
                                       if processor is not None else None))


def _tokenizer_of(engine: Engine | None) -> Any:
    """The started engine's tokenizer (every engine of rft.engine has one: TokenizerMixin)."""
    if not isinstance(engine, TokenizerMixin):
        raise TypeError(f"the engine ({type(engine).__name__}) has no tokenizer to render requests with")
    return engine.tokenizer


def _own_copy(tokenizer: Any) -> Any:
    """A copy of the engine's tokenizer for the tokenizer thread (a fast tokenizer is not meant to be shared between
    threads); the engine's own where it cannot be copied (then two threads use it, which encoding tolerates)."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # noqa: BLE001 - any copy failure: share it
        log.info("tokenizer not copied (%s: %s): the tokenizer thread shares the engine's", type(e).__name__, e)
        return tokenizer


class _NoAnnouncements:
    """The control source of another run's store: serve follows its LATEST only."""

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list:
        return []

    def close(self) -> None:
        pass


def adapter_stores(cfg: Config) -> dict[str, Callable[[int], Any]]:
    """`serve.adapters` as name -> newest(above): the newest checked version of that run's weight store."""
    return {name: WeightUpdates(WeightStore(root), _NoAnnouncements(), verify=cfg.sync.verify).newest
            for name, root in cfg.serve.adapters.items()}


def main(argv: list[str]) -> int:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--port", type=int, default=None, help="TCP port (default: serve.port)")
        parser.add_argument("--host", default=None, help="address to listen on (default: serve.host)")

    cfg, args = part_config("rft serve", __doc__.split("\n")[0], argv, arguments)
    import uvicorn

    host, port = args.host or cfg.serve.host, args.port if args.port is not None else cfg.serve.port
    try:
        access = serve_access(cfg.serve, host)
    except AccessConfigError as e:
        print(f"rft serve: {e}", file=sys.stderr)
        return 2
    service = build_service(cfg)
    try:
        print(f"rft serve: http://{host}:{port}/v1 (model {service.model_name!r}, weights version "
              f"{service.worker.version}, {'a key required' if access.keys else 'no key (loopback)'})", flush=True)
        uvicorn.run(create_app(service, access), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=5)
    except OSError as e:
        print(f"rft serve: cannot serve on {host}:{port}: {e}", file=sys.stderr)
        return 1
    finally:
        service.close()
    return 0
