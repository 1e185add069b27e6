"""Sparse deltas (rft.weights.delta): applied to the base shard they reproduce the new shard byte for byte, the
reference being safetensors' own serialisation of the new tensors; a delta for another base, another header or out of
range is refused."""
from __future__ import annotations

import hashlib
import zlib

import msgpack
import pytest
import torch
from safetensors.torch import save

from rft.weights import delta


def shard(tensors: dict) -> bytes:
    return save(tensors, metadata={"format": "pt"})


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 16, generator=g).to(torch.bfloat16), "norm": torch.randn(16, generator=g),
            "steps": torch.arange(40, dtype=torch.int64), "mask": torch.rand(9, generator=g) > 0.5}


def step(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training step's kind of change: a few elements move by a unit in the last place, one becomes NaN, a zero
    changes sign, an integer and a bool flip."""
    new = {k: v.clone() for k, v in old.items()}
    embed = new["embed"].view(-1).view(torch.int16)
    embed[::29] += 1
    new["norm"][3], new["norm"][0] = float("nan"), -0.0 if new["norm"][0] == 0 else new["norm"][0] * 1.001
    new["steps"][39] = 2**40
    new["mask"][2] = ~new["mask"][2]
    return new


def encoded(old, new) -> tuple[bytes, bytes, bytes]:
    base, target = shard(old), shard(new)
    blob = delta.encode("model-00000.safetensors", old, new, base_sha256=hashlib.sha256(base).hexdigest(),
                        new_header=delta.header_bytes(target), new_size=len(target))
    return base, target, blob


def test_a_delta_rebuilds_the_new_shard_bit_for_bit(tmp_path):
    old = tensors(0)
    new = step(old)
    base, target, blob = encoded(old, new)
    (tmp_path / "base").write_bytes(base)
    delta.apply(blob, tmp_path / "base", tmp_path / "out", base_sha256=hashlib.sha256(base).hexdigest())
    assert (tmp_path / "out").read_bytes() == target
    changed = sum(int((a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).any())
                  for a, b in zip(old.values(), new.values(), strict=True))
    body = msgpack.unpackb(blob)
    assert {t["name"] for t in body["tensors"]} == {"embed", "norm", "steps", "mask"} and changed == 4
    assert len(blob) < len(target) / 5  # sparse: far smaller than the shard


def test_an_unchanged_shard_has_an_empty_delta_and_other_tensors_have_none(tmp_path):
    old = tensors(1)
    base, target, blob = encoded(old, {k: v.clone() for k, v in old.items()})
    assert msgpack.unpackb(blob)["tensors"] == [] and base == target
    assert delta.encode("f", old, {**old, "extra": torch.zeros(1)}, base_sha256="0", new_header=b"", new_size=0) is None
    reshaped = {**old, "norm": old["norm"].reshape(4, 4)}
    assert delta.encode("f", old, reshaped, base_sha256="0", new_header=b"", new_size=0) is None


def forged(blob: bytes, **changes) -> bytes:
    body = msgpack.unpackb(blob)
    for key, value in changes.items():
        if key.startswith("t0_"):
            body["tensors"][0][key[3:]] = value
        else:
            body[key] = value
    return msgpack.packb(body)


@pytest.mark.parametrize("how, error", [
    ("base", "is for a base with SHA-256"),
    ("header", "header differs"),
    ("position", "position past"),
    ("count", "compressed data of"),
    ("bomb", "compressed data of"),
    ("garbage", "not a delta"),
    ("name", "does not hold"),
])
def test_a_delta_for_another_base_or_out_of_range_is_refused(tmp_path, how, error):
    old = tensors(2)
    base, _, blob = encoded(old, step(old))
    sha = hashlib.sha256(base).hexdigest()
    first = msgpack.unpackb(blob)["tensors"][0]
    bad = {"base": forged(blob, base_sha256="0" * 64),
           "header": forged(blob, header_sha256="0" * 64),
           "position": forged(blob, t0_count=1, t0_gap_width=8,
                              t0_gaps=zlib.compress((10**9).to_bytes(8, "little")),
                              t0_xor=zlib.compress(b"\x01" * first["itemsize"])),
           "count": forged(blob, t0_count=first["count"] + 1),
           "bomb": forged(blob, t0_xor=zlib.compress(b"\x00" * (first["count"] * first["itemsize"] * 1000))),
           "garbage": b"\x93not a delta",
           "name": forged(blob, t0_name="__metadata__")}[how]
    (tmp_path / "base").write_bytes(base)
    with pytest.raises(delta.DeltaError, match=error):
        delta.apply(bad, tmp_path / "base", tmp_path / "out", base_sha256=sha)
    assert not (tmp_path / "out").exists()
