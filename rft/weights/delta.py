"""Sparse deltas between two versions of one safetensors shard: what `sync.delta` publishes beside each version
(rft.weights.bucket) and what a host's cache applies to its copy of the previous version (rft.weights.cache).

A delta turns the base version's shard file into the new version's byte for byte. It exists only when both files
have the same header (same tensors, order, dtypes and shapes, so the same byte offsets). For each tensor with
changed elements it holds the positions of the changed elements (flat, ascending, as gaps between successive
positions, the first from -1, minus one, in the smallest unsigned width of 1, 2, 4 or 8 bytes, zlib-compressed) and
the XOR of old and new bit patterns there (little endian, zlib-compressed: small changes flip only low bits).
Elements are compared bit for bit, so a NaN payload or a signed zero is a change like any other.

The file (`<shard>.delta`) is one msgpack map, never pickle: {"format": FORMAT, "file": shard name,
"base_sha256": the whole base file's SHA-256, "header_sha256": SHA-256 of the new file's first 8 + N bytes (length
and JSON header), "size": the new file's size, "tensors": [{"name", "itemsize", "count", "gap_width", "gaps": bytes,
"xor": bytes}]}. `apply` trusts it no further than this schema: widths, counts and positions are checked against the
base file's own header, and decompression is bounded by the sizes the counts imply. The caller accepts the result
only if its SHA-256 matches the new version's manifest (rft.weights.cache), and otherwise downloads the full file.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

FORMAT = "rft-delta-1"
SUFFIX = ".delta"  # the delta of shard F is the object F + SUFFIX in the new version
LEVEL = 1  # zlib level: the fastest; the gaps and XORs are mostly small numbers, which level 1 already packs
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
# safetensors dtypes -> bytes per element
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class DeltaError(ValueError):
    """A delta that cannot be applied to this base (malformed, for another base or header, out of range)."""


def header_bytes(data: bytes | memoryview | mmap.mmap) -> bytes:
    """The first 8 + N bytes of a safetensors file's contents (its length field and JSON header)."""
    if len(data) < 8:
        raise DeltaError("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise DeltaError(f"not a safetensors file: a header of {n} bytes in {len(data)}")
    return bytes(data[:8 + n])


def encode(file: str, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, base_sha256: str,
           new_header: bytes, new_size: int) -> bytes | None:
    """The delta from shard `file` holding `old` (whose file's SHA-256 is `base_sha256`) to the same shard holding
    `new` (its file's header `new_header`, `new_size` bytes); None when the two do not have the same tensors, dtypes
    and shapes (then readers download the new file whole)."""
    import torch

    if list(old) != list(new) or any(old[k].dtype != new[k].dtype or old[k].shape != new[k].shape for k in new):
        return None
    tensors = []
    for name, tensor in new.items():
        a, b = _bits(old[name]), _bits(tensor)
        changed = torch.nonzero(a != b).flatten()
        if not changed.numel():
            continue
        positions = changed.numpy()
        gaps = np.diff(positions, prepend=-1) - 1
        width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < 1 << (8 * w))
        xor = (a[changed] ^ b[changed]).numpy()
        tensors.append({"name": name, "itemsize": tensor.element_size(), "count": int(positions.size),
                        "gap_width": width, "gaps": zlib.compress(gaps.astype(_WIDTHS[width]).tobytes(), LEVEL),
                        "xor": zlib.compress(xor.astype(xor.dtype.newbyteorder("<")).tobytes(), LEVEL)})
    return msgpack.packb({"format": FORMAT, "file": file, "base_sha256": base_sha256,
                          "header_sha256": hashlib.sha256(new_header).hexdigest(), "size": new_size,
                          "tensors": tensors})


def apply(delta: bytes, base: Path, out: Path, *, base_sha256: str) -> None:
    """Write `out`: the base shard file `base` (whose SHA-256 the caller knows to be `base_sha256`) with `delta`
    applied. DeltaError when the delta is malformed or not for this base; `out` is then removed. The caller checks
    `out` against the new version's manifest."""
    body = _decode(delta)
    if body["base_sha256"] != base_sha256:
        raise DeltaError(f"the delta of {body['file']} is for a base with SHA-256 {body['base_sha256'][:12]}..., "
                         f"the cached one is {base_sha256[:12]}...")
    shutil.copyfile(base, out)
    try:
        with open(out, "r+b") as f:
            if os.fstat(f.fileno()).st_size != body["size"]:
                raise DeltaError(f"the base of {body['file']} has {os.fstat(f.fileno()).st_size} bytes, the new "
                                 f"file {body['size']}")
            with mmap.mmap(f.fileno(), 0) as data:
                _patch(data, body)
                data.flush()
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flattened (bitwise comparison and XOR)."""
    import torch

    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.detach().contiguous().view(as_int).reshape(-1)


def _decode(delta: bytes) -> dict:
    try:
        body = msgpack.unpackb(delta, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise DeltaError(f"not a delta: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DeltaError(f"not a delta of format {FORMAT}")
    for key, kind in (("file", str), ("base_sha256", str), ("header_sha256", str), ("size", int), ("tensors", list)):
        if not isinstance(body.get(key), kind):
            raise DeltaError(f"delta field {key!r} missing or not a {kind.__name__}")
    return body


def _patch(data: mmap.mmap, body: dict) -> None:
    """Apply every tensor entry of `body` to the safetensors file mapped at `data`, after checking its header."""
    head = header_bytes(data)
    if hashlib.sha256(head).hexdigest() != body["header_sha256"]:
        raise DeltaError(f"{body['file']}: the base file's header differs from the new file's (other tensors)")
    layout = json.loads(head[8:])
    for entry in body["tensors"]:
        name = entry.get("name") if isinstance(entry, dict) else None
        info = layout.get(name) if isinstance(name, str) and name != "__metadata__" else None
        if info is None:
            raise DeltaError(f"{body['file']}: the delta names a tensor {name!r} the file does not hold")
        itemsize = _ITEMSIZE.get(info["dtype"])
        begin, end = info["data_offsets"]
        count, width = entry.get("count"), entry.get("gap_width")
        if (itemsize is None or entry.get("itemsize") != itemsize or width not in _WIDTHS or not isinstance(count, int)
                or count < 1):
            raise DeltaError(f"{body['file']}: tensor {name}: bad itemsize, gap width or count in the delta")
        elements = (end - begin) // itemsize
        gaps = np.frombuffer(_inflate(entry.get("gaps"), count * width), dtype=_WIDTHS[width]).astype(np.int64)
        positions = np.cumsum(gaps + 1) - 1
        if positions[-1] >= elements:
            raise DeltaError(f"{body['file']}: tensor {name}: a position past its {elements} elements")
        xor = np.frombuffer(_inflate(entry.get("xor"), count * itemsize), dtype=_WIDTHS[itemsize])
        view = np.frombuffer(data, dtype=_WIDTHS[itemsize], count=elements, offset=len(head) + begin)
        view[positions] ^= xor


def _inflate(blob: object, size: int) -> bytes:
    """`blob` decompressed, which must be exactly `size` bytes (decompression stops there: no bomb)."""
    if not isinstance(blob, bytes):
        raise DeltaError("a delta field is not bytes")
    inflate = zlib.decompressobj()
    try:
        out = inflate.decompress(blob, size)
    except zlib.error as e:
        raise DeltaError(f"corrupt compressed data: {e}") from None
    if len(out) != size or inflate.unconsumed_tail or not inflate.eof:
        more = "+" if inflate.unconsumed_tail else ""
        raise DeltaError(f"compressed data of {len(out)}{more} bytes, expected {size}")
    return out
