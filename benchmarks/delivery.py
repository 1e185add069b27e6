"""`rft bench delivery`: the fleet simulator's model of weight delivery through an S3 weight store
(rft.weights.bucket): the time from the trainer handing over version v to every explorer holding it in a local
directory, ready to reload, for models and fleets far larger than this machine (docs/scaling.md has the table).

One version of S bytes goes to N explorers, h to a host (H = ceil(N / h) hosts), three ways:
- full: every explorer downloads the version (no shared cache): N x S bytes leave the store;
- cache: one download per host (rft.weights.cache, the explorers of a host share it): H x S bytes;
- delta: the host holds the previous version and fetches the sparse delta (rft.weights.delta, a fraction f of S),
  then rebuilds and checks the whole version: H x f x S bytes.
Times, with the store's aggregate egress `store_gbps`, each host's `host_gbps` (its explorers share it), each trainer
host's upload `upload_gbps` (P hosts publish at once: one per pipeline stage) and a host's rate `verify_gbps` for
rebuilding and SHA-256-checking a version (the cache checks every file it keeps against the manifest, as it downloads
or after applying a delta):
    publish = S / (P x upload)                 (+ f S for the delta path: the trainer writes the full version too)
    full    = S / min(host / h, store / N, verify)
    cache   = S / min(host, store / H, verify)
    delta   = f S / min(host, store / H) + S / verify
    deliver = publish + fetch                  (a version is announced once complete: the two do not overlap)
The engine's reload from the local directory comes after and is the same for every path; it is not counted. Transfers
are assumed to run at these rates from the first byte (large objects, many parallel streams, no retries).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # parameters
    explorers_per_host: int  # engines on one 8-GPU host (tensor parallelism 8 / tp)
    publishing_hosts: int  # trainer hosts uploading a version at once (per-stage publishing: one per pipeline stage)
    bytes_per_param: float = 2.0  # bf16

    @property
    def size_gb(self) -> float:
        return self.params * self.bytes_per_param / GB


@dataclass(frozen=True)
class Links:
    """The bandwidths assumed, GB/s (docs/scaling.md says why each)."""
    # the object store's aggregate egress to the fleet (S3: scales with prefixes, request rate)
    store_gbps: float = 100.0
    host_gbps: float = 10.0  # one host's download from the store (a 100 Gbit/s NIC, many streams)
    upload_gbps: float = 10.0  # one trainer host's upload to the store
    verify_gbps: float = 4.0  # one host rebuilding and SHA-256-checking a version (4 threads)
    delta_fraction: float = 0.05  # delta bytes / full bytes, bf16 (measured: rft bench weights, docs/benchmarks.md)


MODELS = (Model("7B", 7.6e9, 8, 1), Model("70B", 70.6e9, 2, 4), Model("235B", 235e9, 1, 8))
FLEETS = (1, 64, 1024)
PATHS = ("full", "cache", "delta")


def deliver_s(model: Model, explorers: int, path: str, links: Links) -> dict:
    """Seconds to deliver one version of `model` to `explorers` explorers by `path` (module docstring), and the bytes
    that leave the store."""
    size, h = model.size_gb, model.explorers_per_host
    hosts = math.ceil(explorers / h)
    delta = links.delta_fraction * size
    publish = (size + (delta if path == "delta" else 0.0)) / (links.upload_gbps * model.publishing_hosts)
    if path == "full":
        fetch = size / min(links.host_gbps / min(h, explorers), links.store_gbps / explorers, links.verify_gbps)
        egress = explorers * size
    elif path == "cache":
        fetch = size / min(links.host_gbps, links.store_gbps / hosts, links.verify_gbps)
        egress = hosts * size
    elif path == "delta":
        fetch = delta / min(links.host_gbps, links.store_gbps / hosts) + size / links.verify_gbps
        egress = hosts * delta
    else:
        raise ValueError(f"unknown path {path!r}: one of {PATHS}")
    return {"model": model.name, "explorers": explorers, "path": path, "size_gb": round(size, 1),
            "publish_s": round(publish, 1), "fetch_s": round(fetch, 1), "deliver_s": round(publish + fetch, 1),
            "egress_gb": round(egress, 1)}


def table(links: Links) -> list[dict]:
    return [deliver_s(m, n, p, links) for m in MODELS for n in FLEETS for p in PATHS]


def markdown(rows: list[dict]) -> str:
    """Model x explorers, one column per path: deliver seconds (egress GB)."""
    lines = ["| model (bf16) | explorers | full: s (GB out) | per-host cache: s (GB out) | deltas: s (GB out) |",
             "|---|---:|---:|---:|---:|"]
    for model in MODELS:
        for n in FLEETS:
            cells = {r["path"]: r for r in rows if r["model"] == model.name and r["explorers"] == n}
            lines.append(f"| {model.name} ({model.size_gb:.0f} GB, {model.explorers_per_host}/host, "
                         f"P={model.publishing_hosts}) | {n} | " + " | ".join(
                f"{cells[p]['deliver_s']:g} ({cells[p]['egress_gb']:g})" for p in PATHS) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench delivery", description=__doc__.splitlines()[0])
    for name, value in asdict(Links()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    links = Links(**{name: getattr(args, name) for name in asdict(Links())})
    rows = table(links)
    print(json.dumps({"links": asdict(links), "rows": rows}) if args.json else markdown(rows))
    return 0
