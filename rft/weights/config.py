"""The `sync` section: how explorers get each new version (pull from a weight store, or a push broadcast), where the
store is, and how versions are bucketed, kept and verified."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from rft.config import COUNT, POSITIVE, Range, Section, SectionError, at_least, option
from rft.config.fields import PORT_OR_ANY
from rft.processes import is_loopback

S3_SCHEME = "s3://"


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of an `s3://BUCKET[/PREFIX]` weight store; ValueError saying
    what is wrong."""
    if not url.startswith(S3_SCHEME):
        raise ValueError(f"{url!r} is not an s3://BUCKET[/PREFIX] URL")
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) is None:
        raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, '.', '-'); got {url!r}")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"the prefix of {url!r} has an empty, '.' or '..' part")
    return bucket, prefix


def s3_endpoint_problem(endpoint: str, *, allow_http: bool) -> str | None:
    """What is wrong with an S3 endpoint URL (sync.s3_endpoint, records.s3_endpoint), None when nothing: it is
    http(s)://HOST[:PORT], and plain http only to a loopback host unless `allow_http` (sync.s3_allow_http): beyond
    loopback the weights, the claim-checked parts and the signed requests would cross the network in clear text,
    open to reading and to changing on the way."""
    if not endpoint:
        return None
    if re.fullmatch(r"https?://[^\s/]+/?", endpoint) is None:
        return f"an http(s)://HOST[:PORT] URL, got {endpoint!r}"
    try:
        host = urlsplit(endpoint).hostname or ""
    except ValueError as e:
        return f"an http(s)://HOST[:PORT] URL, got {endpoint!r} ({e})"
    if endpoint.startswith("http://") and not allow_http and not is_loopback(host):
        return (f"plain http:// to {host!r}, beyond loopback, would send the weights and the signed requests "
                "unencrypted: use https://, or set sync.s3_allow_http: true for a network you trust")
    return None


@dataclass(frozen=True)
class SyncConfig(Section):
    KEY = "sync"
    method: Literal["push", "pull"] = option("pull",
        help="how explorers get each new version: pull (from the weight store: a shared filesystem or a bucket; "
        "elastic fleets) or push (broadcast to a fixed fleet of explorer.replicas; pull after a failure)")
    weight_store: str = option("",
        help="the weight store: a directory every part sees (empty: <run dir>/weights), or s3://BUCKET/PREFIX "
        "(fleets that reach only the broker and the bucket; credentials from the standard AWS environment "
        "variables; docs/operations.md)")
    s3_endpoint: str = option("",
        help="s3:// store: the S3 endpoint URL (empty: AWS_ENDPOINT_URL, else AWS's); http:// only to a loopback "
        "host unless sync.s3_allow_http")
    s3_allow_http: bool = option(False,
        help="accept a plain http:// S3 endpoint beyond loopback (sync.s3_endpoint, records.s3_endpoint): weights, "
        "claim-checked parts and signed requests then cross the network unencrypted; a network you trust only")
    s3_region: str = option("", help="s3:// store: the bucket's region (empty: AWS_REGION, else us-east-1)")
    cache_dir: str = option("",
        help="s3:// store: this host's cache of versions, shared by the explorers on it (one download per host); a"
        " local filesystem; empty: $XDG_CACHE_HOME/rft/weights (~/.cache/rft/weights)")
    delta: bool = option(False,
        help="s3:// store: also publish each version as a sparse delta from the one before (changed elements, "
        "compressed); hosts that hold the previous version fetch the delta instead of the model "
        "(rft/weights/delta.py)")
    full_every: int = option(10, range=at_least(1, "1: no deltas"),
        help="with sync.delta: every full_every-th version (version % full_every == 0) has no delta")
    bucket_mb: int = option(64, range=Range(1, 5120, note="<= 5 GiB: an S3 store uploads each shard in one PUT"),
        help="MiB per bucket in which each version's HF tensors are gathered and delivered (store writes and "
        "pushes alike)")
    keep_versions: int = option(2, range=COUNT,
        help="versions the weight store keeps (older ones are deleted); a reader that finds its version gone takes"
        " the newest")
    write_behind: bool = option(True,
        help="pull: write and announce each version in the background while the next step trains")
    timeout_s: float = option(120.0, range=POSITIVE,
        help="push: longest wait for the fleet to join, and for one version to be delivered; pull with pipeline "
        "stages: longest wait without progress for the other stages' shards")
    push_host: str = option("",
        help="push: the address the trainer's publishing rank listens on and explorers reach it at (empty: "
        "127.0.0.1, explorers on this host only; a multi-host push run sets it)")
    push_port: int = option(0, range=PORT_OR_ANY,
        help="push: the group's TCP port on that host (0: a free one, announced on the control topic)")
    push_allow: list[str] = option(factory=list,
        help="push: the hosts an explorer accepts a push-group announcement from (empty: sync.push_host, else this"
        " host only); docs/operations.md, Trust")
    verify: bool = option(True,
        help="pull: an explorer checks each version's SHA-256 checksums against the store's manifest before "
        "loading it (sizes are always checked; a bucket store's host cache always checks checksums, and with "
        "verify also scans for NaN / infinity)")
    new_lineage: bool = option(False,
        help="a trainer that starts without a checkpoint of the weight store's lineage (--no-resume, another run's "
        "store, a reused prefix): false refuses, naming what holds the store; true discards the store's versions "
        "and starts a new lineage (docs/security.md, weights that know their run)")
    push_transport: Literal["auto", "rft", "vllm"] = option("auto",
        help="push: vllm = vLLM's NCCL weight transfer, rft = rft's broadcast; auto: vllm with CUDA and "
        "explorer.engine vllm, else rft")

    def validate(self) -> None:
        """`weight_store` is a directory or an s3://BUCKET[/PREFIX] URL; the bucket-only keys need a bucket."""
        store = self.weight_store
        bucket = store.startswith(S3_SCHEME)
        if not bucket and "://" in store:
            raise SectionError("weight_store", f"a directory or an s3://BUCKET/PREFIX URL; {store.split('://')[0]}:// "
                              f"stores are not supported")
        if bucket:
            try:
                split_s3_url(store)
            except ValueError as e:
                raise SectionError("weight_store", f"{e}") from None
        if problem := s3_endpoint_problem(self.s3_endpoint, allow_http=self.s3_allow_http):
            raise SectionError("s3_endpoint", problem)
        for key in ("s3_endpoint", "s3_region", "cache_dir"):
            if getattr(self, key) and not bucket:
                raise SectionError(key, "only an s3:// sync.weight_store uses it")
        if self.delta and not bucket:
            raise SectionError("delta", "deltas are applied to a host's cached copy: needs an s3:// sync.weight_store")
