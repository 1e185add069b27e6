"""The claim-check: large binary parts of records live in an object store, the record carries a claim on each.

Wire form (docs/schema.md, "Claim-checked parts"): a `bin` value of a record's msgpack body larger than the threshold
(`records.claim_threshold_bytes`) is replaced by a claim map `{"rft-claim": {"sha256": <64 lowercase hex>, "size":
<payload bytes>, "codec": "zstd" | "none"}}`; a record still over the size limit (`kafka.max_record_bytes`) is stored
whole, its parts claimed as above, and its body on the topic is a stub: `schema`, `type`, `run_id`, `group_id` (those
the record has) and `rft-claim`. The object of a payload is at key `<sha256[:2]>/<sha256>` of the store, the payload
compressed with zstd when that is shorter (codec `zstd`), else the payload itself (`none`). Records that carry
claims have the header `rft-claims: <count>`.

Contract:
- `check_out(value, store, threshold=, limit=)` stores the parts and returns the value to send; a record with
  nothing to claim comes back unchanged (the same bytes object).
- `check_in(value, store)` fetches every claimed object and verifies it (size, codec, SHA-256 of the payload) before
  it returns the inline value, which `rft.schema`'s decoders read as if no claim had been made. Every failure (a
  missing object, a mismatch, a malformed claim, no store) is a `RecordError` naming the claim's sha256 and what is
  wrong: the caller dead-letters the record with that reason. Decompression never produces more than the claim's
  size (no bomb), and a claim's size is at most MAX_CLAIM_BYTES.
- The key "rft-claim" is reserved: any map holding it is a claim (or a whole-body stub at the top).
The store is obstore's LocalStore for a directory (created on first use) or S3Store for `s3://BUCKET/PREFIX`;
obstore and zstandard are imported on first use, so a process that meets no claim needs neither. Thread-safe.

Store errors: a missing object, a mismatch, a refused credential are permanent (the `RecordError` above at once); any
other error of the store (a timeout, a refused or dropped connection, a 5xx, an I/O error) is transient: the read
or write is tried again after 0.5, 1, 2... s (at most 5 s apart), `fetch_retries` times, each attempt of an S3 store
bounded by `fetch_timeout_s` (obstore's own retries are off), and only then reported, naming the attempts: a read
costs at most (1 + fetch_retries) x fetch_timeout_s plus the pauses, never a stall (`ClaimStore.worst_case_s`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from rft.schema import RecordError
from rft.weights.config import S3_SCHEME, split_s3_url

if TYPE_CHECKING:
    from obstore.store import LocalStore, S3Config, S3Store

log = logging.getLogger(__name__)

CLAIM_KEY = "rft-claim"
HEADER_CLAIMS = "rft-claims"  # on records that carry claims: how many
CODECS = ("none", "zstd")
MAX_CLAIM_BYTES = 4 << 30  # the largest payload a claim may name (4 GiB)
STUB_KEYS = ("schema", "type", "run_id", "group_id")  # what a whole-body stub keeps of the record
ZSTD_LEVEL = 3
MAX_DEPTH = 32  # nesting a record body may have (rft's records have 5 levels)
_MARK = CLAIM_KEY.encode()  # in the bytes of any body that holds a claim, however its encoder framed the key
_SHA256 = re.compile(r"[0-9a-f]{64}")
BACKOFF_S, BACKOFF_MAX_S = 0.5, 5.0  # pause before the first retry of a transient store error, doubling up to the max


class ClaimStoreError(RuntimeError):
    """The claim store failed a write (unreachable, refused); the record was not sent."""


@dataclass(frozen=True)
class Claim:
    """One stored payload: its SHA-256 (lowercase hex), size in bytes, and the codec of its object."""
    sha256: str
    size: int
    codec: str = "none"

    @property
    def key(self) -> str:
        """Where the object is in the store."""
        return f"{self.sha256[:2]}/{self.sha256}"

    def to_wire(self) -> dict[str, Any]:
        """The claim map that replaces the part."""
        return {CLAIM_KEY: {"sha256": self.sha256, "size": self.size, "codec": self.codec}}

    @classmethod
    def from_fields(cls, raw: Any) -> Claim:
        """The claim from the value under "rft-claim"; RecordError naming what is malformed."""
        sha = raw.get("sha256") if isinstance(raw, dict) else None
        name = f"claim {sha}" if isinstance(sha, str) and _SHA256.fullmatch(sha) else "claim"
        if not isinstance(raw, dict) or set(raw) != {"sha256", "size", "codec"}:
            keys = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
            raise RecordError(f"{name}: malformed claim: expected a map of sha256, size, codec, got {keys}")
        if not isinstance(sha, str) or _SHA256.fullmatch(sha) is None:
            raise RecordError(f"claim: malformed claim: sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
        size = raw["size"]
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_CLAIM_BYTES:
            raise RecordError(f"{name}: malformed claim: size must be an integer in [0, {MAX_CLAIM_BYTES}], got "
                              f"{size!r:.80}")
        if raw["codec"] not in CODECS:
            raise RecordError(f"{name}: malformed claim: codec must be one of {CODECS}, got {raw['codec']!r:.80}")
        return cls(sha, size, raw["codec"])


class ClaimStore:
    """Payloads by content (module docstring) in a directory or at `s3://BUCKET/PREFIX`. `threshold`: the parts a
    sink claim-checks are those larger than this (records.claim_threshold_bytes; 0: a sink claim-checks nothing, but
    this store still reads claims). `endpoint` / `region`: an S3 store's (empty: AWS_ENDPOINT_URL, AWS_REGION).
    `fetch_retries` / `fetch_timeout_s`: how a transient store error is retried (the module docstring)."""

    def __init__(self, location: str | os.PathLike, *, threshold: int = 131072, endpoint: str = "",
                 region: str = "", fetch_retries: int = 3, fetch_timeout_s: float = 10.0):
        self.location = str(location)
        if not self.location:
            raise ValueError("a claim store needs a directory or an s3://BUCKET/PREFIX URL")
        if self.location.startswith(S3_SCHEME):
            split_s3_url(self.location)  # ValueError naming what is wrong, now rather than on first use
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if fetch_retries < 0 or not fetch_timeout_s > 0:
            raise ValueError(f"fetch_retries must be >= 0 and fetch_timeout_s > 0, got {fetch_retries}, "
                             f"{fetch_timeout_s}")
        self.threshold, self.endpoint, self.region = threshold, endpoint, region
        self.fetch_retries, self.fetch_timeout_s = fetch_retries, fetch_timeout_s
        self.retried = 0  # transient errors retried so far (a metric; a count, not a state)
        self._objects: LocalStore | S3Store | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ClaimStore({self.location!r})"

    @property
    def objects(self) -> LocalStore | S3Store:
        """The obstore store, made on first use (a directory store creates its directory)."""
        with self._lock:
            if self._objects is None:
                self._objects = self._open()
            return self._objects

    def _open(self) -> LocalStore | S3Store:
        from obstore.store import LocalStore, S3Store

        if not self.location.startswith(S3_SCHEME):
            return LocalStore(Path(self.location).absolute(), mkdir=True)
        bucket, prefix = split_s3_url(self.location)
        endpoint = self.endpoint or os.environ.get("AWS_ENDPOINT_URL", "") or os.environ.get("AWS_ENDPOINT", "")
        config: S3Config = {}
        if endpoint:
            config["endpoint"] = endpoint
        if self.region:
            config["region"] = self.region
        timeout = f"{max(1, round(self.fetch_timeout_s * 1000))}ms"
        return S3Store(bucket, prefix=prefix or None, config=config,
                       client_options={"allow_http": endpoint.startswith("http://"), "timeout": timeout,
                                       "connect_timeout": timeout},
                       retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=self.fetch_timeout_s)})

    @property
    def worst_case_s(self) -> float:
        """The longest one read or write of an S3 store takes before it is reported (module docstring)."""
        pauses = sum(min(BACKOFF_S * 2 ** i, BACKOFF_MAX_S) for i in range(self.fetch_retries))
        return (1 + self.fetch_retries) * self.fetch_timeout_s + pauses

    def _retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """`call()`, tried again on a transient error (module docstring); a permanent one, or the last transient
        one, is raised as it came, its message prefixed with the attempts when there were several."""
        for attempt in range(self.fetch_retries + 1):
            try:
                return call()
            except Exception as e:
                if _permanent(e) or attempt == self.fetch_retries:
                    if attempt:
                        raise TransientStoreError(f"{type(e).__name__} after {attempt + 1} attempts: "
                                                  f"{_first_line(e)}") from e
                    raise
                self.retried += 1
                pause = min(BACKOFF_S * 2 ** attempt, BACKOFF_MAX_S)
                log.warning("claim store %s: %s failed (%s: %s); attempt %d of %d in %.1f s", self.location, what,
                            type(e).__name__, _first_line(e), attempt + 2, self.fetch_retries + 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")

    def put(self, payload: bytes) -> Claim:
        """Store `payload` (zstd-compressed when shorter) under its SHA-256; its claim. ClaimStoreError when the
        store refuses."""
        import obstore
        import zstandard

        if len(payload) > MAX_CLAIM_BYTES:
            raise ClaimStoreError(f"a part of {len(payload)} bytes is over the claim-check's limit of "
                                  f"{MAX_CLAIM_BYTES}")
        sha = hashlib.sha256(payload).hexdigest()
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload)
        claim, stored = (Claim(sha, len(payload), "zstd"), packed) if len(packed) < len(payload) else \
            (Claim(sha, len(payload), "none"), payload)
        try:
            self._retrying(f"put {claim.key}", lambda: obstore.put(self.objects, claim.key, stored))
        except Exception as e:  # obstore raises its own and builtin errors; the sender reports it
            raise ClaimStoreError(f"the claim store {self.location} refused {claim.key}: {type(e).__name__}: "
                                  f"{_first_line(e)}") from e
        return claim

    def get(self, claim: Claim) -> bytes:
        """The payload of `claim`, verified: its object's length fits the codec, it decompresses to exactly `size`
        bytes (never more are produced), and their SHA-256 is the claim's. RecordError naming the claim otherwise."""
        import obstore

        name = f"claim {claim.sha256}"

        def read() -> tuple[int, bytes]:
            result = obstore.get(self.objects, claim.key)
            size = int(result.meta["size"])
            if size > claim.size or (claim.codec == "none" and size != claim.size):
                raise RecordError(f"{name}: the object is {size} bytes, which a {claim.size}-byte payload with"
                                  f" codec {claim.codec} cannot be (size mismatch)")
            return size, bytes(result.bytes())

        try:
            stored_size, stored = self._retrying(f"get {claim.key}", read)
        except RecordError:
            raise
        except (FileNotFoundError, _not_found()):
            raise RecordError(f"{name}: the object {claim.key} is missing from the claim store {self.location}") \
                from None
        except Exception as e:  # the store failed for good, or past its retries (TransientStoreError)
            raise RecordError(f"{name}: reading {claim.key} from the claim store {self.location} failed: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
        if len(stored) != stored_size:
            raise RecordError(f"{name}: the object's length changed while it was read ({stored_size} -> "
                              f"{len(stored)} bytes)")
        payload = stored if claim.codec == "none" else _decompress(stored, claim.size, name)
        if len(payload) != claim.size:
            raise RecordError(f"{name}: the payload is {len(payload)} bytes, the claim says {claim.size} (size "
                              "mismatch)")
        digest = hashlib.sha256(payload).hexdigest()
        if digest != claim.sha256:
            raise RecordError(f"{name}: the payload's SHA-256 is {digest} (checksum mismatch)")
        return payload

    def delete(self, sha256: str) -> None:
        """Remove the object of `sha256` (absent already: nothing to do)."""
        import obstore

        if _SHA256.fullmatch(sha256) is None:
            raise ValueError(f"not a SHA-256: {sha256!r}")
        try:
            self._retrying(f"delete {sha256}", lambda: obstore.delete(self.objects, f"{sha256[:2]}/{sha256}"))
        except (FileNotFoundError, _not_found()):
            pass

    def last_modified(self, sha256: str) -> datetime | None:
        """When the object of `sha256` was last written (a re-put of the same payload refreshes it); None when it is
        absent."""
        import obstore

        if _SHA256.fullmatch(sha256) is None:
            raise ValueError(f"not a SHA-256: {sha256!r}")
        try:
            meta = self._retrying(f"head {sha256}", lambda: obstore.head(self.objects, f"{sha256[:2]}/{sha256}"))
        except (FileNotFoundError, _not_found()):
            return None
        return meta["last_modified"]

    def list(self) -> Iterator[dict[str, Any]]:
        """Every object in the store whose key is a claim's: {"sha256", "size" (stored bytes), "last_modified"}."""
        import obstore

        for chunk in obstore.list(self.objects):
            for meta in chunk:
                prefix, _, sha = str(meta["path"]).partition("/")
                if _SHA256.fullmatch(sha) and prefix == sha[:2]:
                    yield {"sha256": sha, "size": int(meta["size"]), "last_modified": meta["last_modified"]}


class TransientStoreError(RuntimeError):
    """A store operation that failed with a transient error on every attempt (the message names them)."""


def _not_found() -> type[Exception]:
    from obstore.exceptions import NotFoundError

    return NotFoundError


def _permanent(error: Exception) -> bool:
    """Whether a store error is one a retry cannot cure: a missing object, a mismatch, refused credentials, a bad
    path or configuration."""
    from obstore.exceptions import (
        InvalidPathError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
        UnknownConfigurationKeyError,
    )

    return isinstance(error, (RecordError, FileNotFoundError, NotFoundError, PermissionDeniedError,
                              UnauthenticatedError, InvalidPathError, UnknownConfigurationKeyError, ValueError))


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def _decompress(stored: bytes, size: int, name: str) -> bytes:
    """`stored`'s zstd frame, reading at most `size` + 1 bytes out of it (a frame that claims or yields more is refused
    without being expanded)."""
    import zstandard

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
            while len(out) <= size:
                chunk = reader.read(min(size + 1 - len(out), 1 << 24))
                if not chunk:
                    break
                out += chunk
    except zstandard.ZstdError as e:
        raise RecordError(f"{name}: the object is not a zstd frame: {e}") from None
    if len(out) > size:
        raise RecordError(f"{name}: the object decompresses to more than the claim's {size} bytes (size mismatch)")
    return bytes(out)


# --------------------------------------------------------------------------------------------------
# Records


def _unpack(value: bytes) -> Any:
    try:
        return msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise RecordError(f"not msgpack: {type(e).__name__}: {e}") from None


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _walk(node: Any, replace: Callable[[Any], Any], depth: int = 0) -> Any:
    """`node` with every map holding "rft-claim" and every bytes value passed through `replace` (which returns its
    argument to keep it); the same object where nothing changed."""
    if depth > MAX_DEPTH:
        raise RecordError(f"record nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, (bytes, dict)) and (not isinstance(node, dict) or CLAIM_KEY in node):
        return replace(node)
    if isinstance(node, dict):
        items = {k: _walk(v, replace, depth + 1) for k, v in node.items()}
        return node if all(items[k] is node[k] for k in node) else items
    if isinstance(node, list):
        walked = [_walk(v, replace, depth + 1) for v in node]
        return node if all(a is b for a, b in zip(walked, node, strict=True)) else walked
    return node


def _part_claim(node: Any) -> Claim:
    """The claim of a claim map (exactly one key, "rft-claim"); RecordError otherwise."""
    if set(node) != {CLAIM_KEY}:
        name = ""
        if isinstance(node.get(CLAIM_KEY), dict) and isinstance(node[CLAIM_KEY].get("sha256"), str):
            name = f" {node[CLAIM_KEY]['sha256']:.64}"
        raise RecordError(f"claim{name}: malformed claim: a claim map holds only {CLAIM_KEY!r}, this one also "
                          f"{sorted(str(k) for k in node if k != CLAIM_KEY)}")
    return Claim.from_fields(node[CLAIM_KEY])


def _stub_claim(body: dict) -> Claim | None:
    """The claim of a whole-body stub, None for any other body; RecordError for a malformed stub."""
    if CLAIM_KEY not in body:
        return None
    claim = Claim.from_fields(body[CLAIM_KEY])
    if extra := sorted(str(k) for k in body if k != CLAIM_KEY and k not in STUB_KEYS):
        raise RecordError(f"claim {claim.sha256}: malformed whole-body claim: the stub holds {extra} besides "
                          f"{list(STUB_KEYS)}")
    return claim


def claims_in(value: bytes) -> list[Claim]:
    """The claims of a record value, in body order (a whole-body stub: its one claim); RecordError for a malformed
    claim or a value that is not msgpack while it mentions "rft-claim"."""
    if _MARK not in value:
        return []
    body = _unpack(value)
    if isinstance(body, dict) and (stub := _stub_claim(body)) is not None:
        return [stub]
    found: list[Claim] = []

    def note(node: Any) -> Any:
        if isinstance(node, dict):
            found.append(_part_claim(node))
        return node

    _walk(body, note)
    return found


def check_out(value: bytes, store: ClaimStore, *, threshold: int, limit: int) -> bytes:
    """The record `value` (a msgpack map) to send: every `bin` value longer than `threshold` (> 0) stored in `store`
    and replaced by its claim; if that is still over `limit` bytes, the body with its parts claimed is stored whole
    and a stub sent (one more object, rather than many small ones; no payload is stored twice). Each payload is
    stored once. A record with nothing to claim is returned as is. ClaimStoreError when the store fails."""
    if (threshold <= 0 or len(value) <= threshold) and len(value) <= limit:
        return value  # no part can be over the threshold
    body = msgpack.unpackb(value, raw=False, strict_map_key=False)
    stored: dict[bytes, dict[str, Any]] = {}  # equal parts (a group's shared prompt) are stored once

    def claim(node: Any) -> Any:
        if not isinstance(node, bytes) or len(node) <= threshold:
            return node
        if node not in stored:
            stored[node] = store.put(node).to_wire()
        return stored[node]

    claimed = _walk(body, claim) if threshold > 0 else body
    out = value if claimed is body else _pack(claimed)
    if len(out) > limit:
        stub = {k: body[k] for k in STUB_KEYS if isinstance(body, dict) and k in body}
        stub.update(store.put(out).to_wire())
        out = _pack(stub)
    return out


def check_in(value: bytes, store: ClaimStore | None) -> bytes:
    """The record `value` with every claim resolved from `store` and verified (module docstring); a value without
    claims is returned as is. RecordError naming the claim and the reason for anything that cannot be resolved."""
    if _MARK not in value:
        return value
    body = _unpack(value)
    if not isinstance(body, dict):
        return value  # not a record body; the decoder says so

    def fetch(claim: Claim) -> bytes:
        if store is None:
            raise RecordError(f"claim {claim.sha256}: the record has claim-checked parts and no claim store is "
                              "configured (records.store)")
        return store.get(claim)

    stub = _stub_claim(body)
    if stub is not None:
        payload = fetch(stub)
        whole = _unpack(payload)
        if not isinstance(whole, dict) or CLAIM_KEY in whole:
            raise RecordError(f"claim {stub.sha256}: a whole-body claim's object must be a record body, not "
                              f"{'another stub' if isinstance(whole, dict) else type(whole).__name__}")
        if differ := [k for k in STUB_KEYS if k in body and whole.get(k) != body[k]]:
            raise RecordError(f"claim {stub.sha256}: the stored body's {differ} differ from the stub's")
        body, value = whole, payload  # its parts may be claimed too (one level: never another stub)

    def resolve(node: Any) -> Any:
        return fetch(_part_claim(node)) if isinstance(node, dict) else node

    resolved = _walk(body, resolve)
    return value if resolved is body else _pack(resolved)
