"""`rft bench weights STORE_DIR`: weight delivery through an S3 weight store (rft.weights.bucket), on the versions of a
real run. STORE_DIR is a directory weight store holding consecutive versions (e.g. `rft run
configs/smollm2-arithmetic.yaml --set run.max_steps=6 --set sync.keep_versions=10`, then `runs/<name>/weights`).

Every version is cast to `--dtype`, grouped into `--bucket-mb` shards in name order (as the trainer's buckets: the same
composition every version), and published to rft's object server on loopback (rft.broker.objects, a subprocess) twice:
into a plain store and into one with sparse deltas (`sync.delta`, no periodic full version; every delta written,
even past half its shard, where a run's store would not write it, so that its size is known). Per version it reports:
- full_mb, delta_mb, delta_fraction: bytes of the version's shards, of its deltas, and their ratio (the bytes a host
  that holds the previous version fetches, against a full version);
- publish_s, publish_delta_s: the store write without and with deltas (serialise, hash, encode, upload);
- fetch_full_s, apply_delta_s: a host's cache building the version from the bucket whole, and from the previous
  version plus the deltas (download, apply, SHA-256 against the manifest, finiteness), each checked bit for bit.
Then the per-host cache: `--explorers N` processes ask for the newest version at the same moment, once sharing one
cache directory (one host) and once with a cache each (N hosts); the object server's access log counts the GETs of
each shard (expected: 1 and N) and the wall time is reported. One JSON object on stdout (`--out FILE`: also there).
Timings depend on the machine and its load; byte counts do not.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rft.broker.objects import ObjectServer
from rft.weights.bucket import BucketStore
from rft.weights.store import MANIFEST, WeightStore, iter_safetensors

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--read"]:
        return _read(argv[1:])
    parser = argparse.ArgumentParser(prog="rft bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("store", help="a directory weight store holding consecutive versions of a run")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--explorers", type=int, default=4, help="processes fetching the newest version at once")
    parser.add_argument("--versions", type=int, default=0, help="use at most this many (the oldest); 0: all")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    source = WeightStore(args.store)
    versions = source.versions()[:args.versions or None]
    if len(versions) < 2 or versions != list(range(versions[0], versions[-1] + 1)):
        print(f"rft bench weights: {args.store} needs at least 2 consecutive versions, has {versions}", file=sys.stderr)
        return 2
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "rft-bench")  # the object server checks none; set, they keep the
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "rft-bench")  # client from looking for instance credentials
    with tempfile.TemporaryDirectory(prefix="rft-bench-weights-") as tmp:
        work = Path(tmp)
        server = ObjectServer(work / "objects", access_log=work / "access.log")
        try:
            server.bucket("bench")
            result = _measure(args, source, versions, server, work)
        finally:
            server.stop()
    text = json.dumps(result)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _measure(args, source: WeightStore, versions: list[int], server: ObjectServer, work: Path) -> dict:
    dtype = DTYPES[args.dtype]

    def store(prefix: str, cache: str, **kw) -> BucketStore:
        return BucketStore(f"s3://bench/{prefix}", endpoint=server.endpoint, cache_dir=work / cache, keep=3, **kw)

    plain = store("plain", "writer-plain")  # every delta written, so that its size is measured (a store does not
    sparse = store("sparse", "writer-sparse", delta=True, full_every=10**9, max_delta_fraction=math.inf)  # past 1/2)
    apply_delta = store("sparse", "reader-delta")  # a host that holds every previous version
    rows = []
    for version in versions:
        tensors = {name: t.to(dtype).contiguous() for name, t in iter_safetensors(source.path(version))}
        buckets = _buckets(tensors, args.bucket_mb << 20)
        row = {"version": version}
        row["publish_s"] = _timed(plain.publish, version, buckets, source.path(version))
        row["publish_delta_s"] = _timed(sparse.publish, version, buckets, source.path(version))
        manifest = json.loads(sparse.read(version, MANIFEST))
        shards = {n: e["size"] for n, e in manifest["files"].items() if n.endswith(".safetensors")}
        row["full_mb"] = round(sum(shards.values()) / 1e6, 2)
        row["delta_mb"] = round(sum(e["size"] for e in manifest.get("delta", {}).get("files", {}).values()) / 1e6, 3)
        row["delta_fraction"] = round(row["delta_mb"] / row["full_mb"], 4) if "delta" in manifest else None
        row["deltas"] = len(manifest.get("delta", {}).get("files", {}))
        fetch_full = store("plain", f"reader-full-{version}")  # a host without any version: it downloads every file
        row["fetch_full_s"] = _timed(_fetch_checked, fetch_full, version, tensors)
        row["apply_delta_s"] = _timed(_fetch_checked, apply_delta, version, tensors)
        row["delta_fallbacks"] = apply_delta.cache.stats["delta_fallbacks"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    later = rows[1:]
    summary = {"dtype": args.dtype, "versions": len(rows), "bucket_mb": args.bucket_mb,
               "full_mb": rows[-1]["full_mb"],
               "delta_fraction_median": statistics.median(r["delta_fraction"] or 1.0 for r in later),
               "delta_fraction_max": max(r["delta_fraction"] or 1.0 for r in later),
               "publish_s_median": _median(later, "publish_s"),
               "publish_delta_s_median": _median(later, "publish_delta_s"),
               "fetch_full_s_median": _median(later, "fetch_full_s"),
               "apply_delta_s_median": _median(later, "apply_delta_s")}
    summary["host_cache"] = _host_cache(args.explorers, server, work, versions[-1], list(shards))
    return {"summary": summary, "versions": rows}


def _buckets(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, cut into buckets of at most `limit` bytes (one tensor alone may exceed it)."""
    buckets, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    return buckets + ([current] if current else [])


def _fetch_checked(store: BucketStore, version: int, expected: dict[str, torch.Tensor]) -> None:
    """`version` through `store` (downloaded, or built from deltas), checked against the tensors published."""
    _check(store.local(version), expected)


def _check(path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = dict(iter_safetensors(path))
    if loaded.keys() != expected.keys() or not all(torch.equal(loaded[k], v) for k, v in expected.items()):
        raise AssertionError(f"{path} does not hold the version's tensors")


def _host_cache(explorers: int, server: ObjectServer, work: Path, version: int, shards: list[str]) -> dict:
    """`explorers` processes fetch `version` of the plain store at once: one shared cache (a host), then a cache
    each."""
    out = {"explorers": explorers}
    for layout in ("shared", "separate"):
        log = work / "access.log"
        before = _gets(log, version, shards)
        go = work / f"go-{layout}"
        readers = [subprocess.Popen([sys.executable, "-m", "rft.cli", "bench", "weights", "--read", server.endpoint,
                                     str(work / (f"host-{layout}" if layout == "shared" else f"host-{layout}-{i}")),
                                     str(version), str(go), str(work / f"ready-{layout}-{i}")], env=os.environ.copy())
                   for i in range(explorers)]
        while not all((work / f"ready-{layout}-{i}").exists() for i in range(explorers)):
            if any(r.poll() is not None for r in readers):
                raise RuntimeError("a reader exited before it was ready")
            time.sleep(0.05)
        started = time.perf_counter()
        go.touch()
        codes = [r.wait(timeout=600) for r in readers]
        elapsed = time.perf_counter() - started
        if any(codes):
            raise RuntimeError(f"readers exited with {codes}")
        after = _gets(log, version, shards)
        out[layout] = {"wall_s": round(elapsed, 3), "gets_per_shard": round((after - before) / len(shards), 2)}
    return out


def _gets(log: Path, version: int, shards: list[str]) -> int:
    names = "|".join(re.escape(s) for s in shards)
    pattern = re.compile(rf"^GET /bench/plain/v{version:08d}/({names}) 200$", re.M)
    return len(pattern.findall(log.read_text())) if log.exists() else 0


def _read(argv: list[str]) -> int:
    """A reader process of `_host_cache`: ENDPOINT CACHE_DIR VERSION GO_FILE READY_FILE."""
    endpoint, cache, version, go, ready = argv
    store = BucketStore("s3://bench/plain", endpoint=endpoint, cache_dir=cache)
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.01)
    store.local(int(version))
    return 0


def _timed(call: Callable[..., object], *args: object) -> float:
    """Seconds `call(*args)` took."""
    started = time.perf_counter()
    call(*args)
    return round(time.perf_counter() - started, 3)


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)
