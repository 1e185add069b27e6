"""The optional `routed_experts` map of a sample (docs/schema.md): round trip, records without it, and each way a
map that does not fit its sample is rejected with a reason."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rft.schema import RecordError, RoutedExperts, decode_group, encode
from tests.records import make_group


def routed(prompt_len: int, response_len: int, *, experts: int = 8, layers=(0, 2), top_k: int = 2,
           first_position: int = 0, seed: int = 0) -> RoutedExperts:
    rng = np.random.default_rng(seed)
    n = prompt_len + response_len - 1 - first_position
    ids = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in layers]) for _ in range(n)])
    return RoutedExperts(ids=ids.astype(RoutedExperts.dtype_for(experts)), num_experts=experts, layers=list(layers),
                         first_position=first_position)


def group_with_routing(**kwargs):
    group = make_group("run", 1, prompt_len=5, response_len=6)
    for i, s in enumerate(group.samples):
        s.routed_experts = routed(5, 6, seed=i, **kwargs)
    return group


@pytest.mark.parametrize("experts,dtype", [(8, "u1"), (256, "u1"), (300, "u2")])
def test_round_trip_with_the_narrowest_dtype(experts, dtype):
    group = group_with_routing(experts=experts, first_position=4)
    value, _ = encode(group)
    assert msgpack.unpackb(value)["samples"][0]["routed_experts"]["dtype"] == dtype
    back = decode_group(value)
    assert back == group and back.samples[0].routed_experts.ids.shape == (6, 2, 2)
    assert back != make_group("run", 1, prompt_len=5, response_len=6)  # routing takes part in equality


def test_records_without_routing_still_read():
    group = make_group("run", 1)
    body = msgpack.unpackb(encode(group)[0])
    assert "routed_experts" not in body["samples"][0]
    body["samples"][0]["routed_experts"] = None  # nil reads as absent too
    assert decode_group(msgpack.packb(body, use_bin_type=True)).samples[0].routed_experts is None


def corrupt(change) -> bytes:
    body = msgpack.unpackb(encode(group_with_routing())[0])
    change(body["samples"][1]["routed_experts"])
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("change,reason", [
    (lambda m: m.update(ids=m["ids"][:-1]), "ids hold 39 values, shape"),
    (lambda m: m.update(shape=[9, 2, 2], ids=m["ids"][:36]), "9 positions, but a sample of 5 prompt and 6"),
    (lambda m: m.update(ids=bytes([9]) + m["ids"][1:]), "expert id 9 is not below num_experts 8"),
    (lambda m: m.update(dtype="u4"), "dtype 'u4' is not one of"),
    (lambda m: m.update(dtype="u2", ids=m["ids"] * 2), "ids are uint16, 8 experts take uint8"),
    (lambda m: m.update(layers=[2, 0]), "must be ascending"),
    (lambda m: m.update(layers=[0]), "2 layers of ids for 1 layer indices"),
    (lambda m: m.update(first_position=11), "first_position 11 is outside 0..10"),
    (lambda m: m.update(num_experts=1), "top_k 2 is outside 1..num_experts"),
    (lambda m: m.pop("layers"), "missing field 'layers'"),
])
def test_a_map_that_does_not_fit_its_sample_is_rejected_with_its_reason(change, reason):
    with pytest.raises(RecordError, match=r"^samples\[1\]: routed_experts: .*" + reason.replace("[", r"\[")
                       .replace("(", r"\(")):
        decode_group(corrupt(change))


def test_the_writer_refuses_routing_that_does_not_fit():
    group = group_with_routing()
    group.samples[0].routed_experts.first_position = 1
    with pytest.raises(ValueError, match="routed_experts: 10 positions, but a sample"):
        encode(group)
