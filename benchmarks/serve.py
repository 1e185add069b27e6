"""`rft bench serve`: load on `rft serve`'s endpoint: N concurrent clients for a fixed time.

Starts a local broker (`rft.broker.local.LocalBroker`) and the server in this process (`rft.serve.server.build_service`
under uvicorn, the code `rft serve` runs) on a model (default: a freshly made tiny model) with `--engine`
(transformers or vllm). Then `--clients` asyncio clients (httpx) each send chat completions back to back for
`--seconds` (after one warm-up request off the clock): `n` 1, `--max-tokens` new tokens, one of a few prompts.
Reports requests/s (answered with 200), p50 / p99 latency (request sent to answer read), errors, and, read back
from the served topic afterwards, the fraction of answered completions recorded (target 1.0) and the number
recorded more than once (target 0).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from rft.broker.local import LocalBroker
from rft.run.config import config_from_dict
from rft.schema import RecordError, decode_served
from rft.serve.app import ServerThread
from rft.serve.server import build_service
from rft.transport import connect

PROMPTS = [":1", ":2", ":3", ":4"]


async def _client(url: str, deadline: float, max_tokens: int, seed: int, out: dict) -> None:
    import httpx

    k = seed
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            started = time.monotonic()
            reply = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}], "max_tokens": max_tokens})
            k += 1
            if reply.status_code == 200:
                out["latency"].append(time.monotonic() - started)
                out["ids"].append(reply.json()["id"])
            else:
                out["errors"][reply.status_code] += 1


def drive(url: str, *, clients: int, seconds: float, max_tokens: int) -> dict:
    """The clients' answered ids, latencies and errors. One request first, off the clock (engine warm-up)."""
    import httpx

    httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": max_tokens}).raise_for_status()
    out = {"latency": [], "ids": [], "errors": collections.Counter()}
    started = time.monotonic()

    async def main() -> None:
        await asyncio.gather(*(_client(url, started + seconds, max_tokens, i, out) for i in range(clients)))

    asyncio.run(main())
    out["elapsed"] = time.monotonic() - started
    return out


def recorded(cfg) -> collections.Counter:
    source = connect(cfg.kafka).source()
    counts: collections.Counter = collections.Counter()
    try:
        for m in source.read_range(cfg.topic("served"), idle_timeout_s=5.0):
            try:
                counts[decode_served(m.value, m.headers).request_id] += 1
            except RecordError:
                continue
    finally:
        source.close()
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: a new tiny model)")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=16, help="serve.max_batch")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, LocalBroker() as broker:
        model = args.model
        if model is None:
            from rft.models.tiny import make_tiny_model  # heavy: torch
            model = str(make_tiny_model(Path(tmp) / "tiny"))
        cfg = config_from_dict({
            "run": {"name": f"bench-serve-{int(time.time())}", "mode": "serve", "output_dir": str(Path(tmp) / "runs")},
            "model": {"path": model, "max_prompt_len": 64, "max_response_len": max(args.max_tokens, 1)},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers},
            "explorer": {"engine": args.engine, "cpu_kvcache_gb": 0.2},
            "serve": {"max_batch": args.max_batch},
        })
        service = build_service(cfg)
        server = ServerThread(service).start()
        try:
            result = drive(server.url, clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens)
        finally:
            server.stop()
            service.close()
        counts = recorded(cfg)
    answered = result["ids"]
    latency = np.array(result["latency"]) if result["latency"] else np.zeros(1)
    summary = {
        "engine": args.engine, "clients": args.clients, "seconds": round(result["elapsed"], 1),
        "max_tokens": args.max_tokens, "requests": len(answered),
        "requests_per_s": round(len(answered) / result["elapsed"], 2),
        "p50_ms": round(float(np.percentile(latency, 50)) * 1000, 1),
        "p99_ms": round(float(np.percentile(latency, 99)) * 1000, 1),
        "errors": dict(result["errors"]),
        "recorded_fraction": round(sum(1 for i in answered if counts[i]) / max(1, len(answered)), 4),
        "recorded_twice": sum(1 for i in answered if counts[i] > 1),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>18}  {value}")
    return 0 if summary["recorded_fraction"] == 1.0 and not summary["recorded_twice"] else 1
