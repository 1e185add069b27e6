"""rft.transport.claims, the claim-check, on a directory store (obstore's LocalStore, in-process): round trips equal
to the original decode, the threshold's boundary, the whole-body fallback, every way a claim can fail to resolve
(each a RecordError naming the claim and the reason), bounded decompression; and the sink and readers that apply it
(rft.transport.base: `send_record`, `resolve_claims`, DeadLetter) over the in-memory transport."""
from __future__ import annotations

import hashlib
import os
import tracemalloc

import msgpack
import numpy as np
import pytest
import zstandard

from rft.schema import RecordError, decode_group, encode
from rft.transport import DeadLetter, RecordTooLarge, resolve_claims
from rft.transport.claims import (
    CLAIM_KEY,
    HEADER_CLAIMS,
    MAX_CLAIM_BYTES,
    Claim,
    ClaimStore,
    check_in,
    check_out,
    claims_in,
)
from rft.transport.memory import MemoryTransport
from tests.records import make_group, read_topic

LIMIT = 1_000_000


def memory(**kwargs) -> MemoryTransport:
    """An in-memory transport with the topics "t" and "dlq"."""
    transport = MemoryTransport(partitions=1, **kwargs)
    transport.admin().create_topics(["t", "dlq"])
    return transport


@pytest.fixture
def store(tmp_path) -> ClaimStore:
    return ClaimStore(tmp_path / "records", threshold=4096)


def big_group(response_len: int = 20_000, n_samples: int = 2, seed: int = 1):
    return make_group("run", seed, n_samples=n_samples, prompt_len=50, response_len=response_len)


def object_path(store: ClaimStore, claim: Claim):
    return os.path.join(store.location, claim.key)


def test_round_trip_equals_the_original_and_the_decode(store):
    group = big_group()
    value, _ = encode(group)
    sent = check_out(value, store, threshold=4096, limit=LIMIT)
    claims = claims_in(sent)
    # per sample: response tokens and log-probs are 80 kB (claimed), the 20 kB loss mask too; the prompt is not
    assert len(claims) == 3 * 2 and len(sent) < 2000
    assert all(len(c.sha256) == 64 and c.size in (80_000, 20_000) for c in claims)
    assert {c.codec for c in claims} <= {"zstd", "none"}
    assert os.path.isfile(object_path(store, claims[0]))
    assert check_in(sent, store) == value
    assert decode_group(check_in(sent, store)) == group


def test_a_record_with_nothing_to_claim_is_returned_as_is(store):
    value, _ = encode(make_group("run", 1))
    assert check_out(value, store, threshold=4096, limit=LIMIT) is value
    assert check_in(value, store) is value and claims_in(value) == []
    assert not os.path.exists(store.location)  # nothing stored, the directory not even made


def test_the_threshold_is_exclusive(store):
    group = big_group(response_len=1000, n_samples=1)  # tokens and log-probs: 4000 bytes each, the mask 1000
    value, _ = encode(group)
    assert check_out(value, store, threshold=4000, limit=LIMIT) is value
    sent = check_out(value, store, threshold=3999, limit=LIMIT)
    assert sorted(c.size for c in claims_in(sent)) == [4000, 4000]
    assert check_in(sent, store) == value


def test_equal_parts_are_stored_once(store):
    group = big_group(n_samples=1)
    twin = group.samples[0]
    group.samples.append(type(twin)(**{**twin.__dict__, "sample_index": 1}))
    value, _ = encode(group)
    claims = claims_in(check_out(value, store, threshold=4096, limit=LIMIT))
    assert len(claims) == 6 and len({c.sha256 for c in claims}) == 3


def test_a_record_still_over_the_limit_is_claimed_whole(store):
    group = make_group("run", 3, n_samples=400, response_len=200)  # many small parts: none over the threshold
    value, _ = encode(group)
    sent = check_out(value, store, threshold=4096, limit=50_000)
    body = msgpack.unpackb(sent)
    assert set(body) == {"schema", "type", "run_id", "group_id", CLAIM_KEY}
    assert body["group_id"] == group.group_id and len(sent) < 300
    [claim] = claims_in(sent)
    assert claim.size == len(value)
    assert check_in(sent, store) == value  # the very bytes produced


def test_a_whole_body_keeps_its_claimed_parts_stored_once(store):
    """Large parts and many small ones: the parts are claimed, then the claimed body stored whole; no payload is
    stored twice (the whole-body object holds the parts' claims, resolved in turn)."""
    group = make_group("run", 3, n_samples=300, response_len=100)
    group.samples[0].logprobs = np.random.default_rng(1).random(20_000).astype(np.float32)  # one large random part
    group.samples[0].response_tokens = np.arange(20_000, dtype=np.int32) % 7
    group.samples[0].loss_mask = np.ones(20_000, dtype=np.uint8)
    value, _ = encode(group)
    sent = check_out(value, store, threshold=4096, limit=20_000)
    [stub] = claims_in(sent)
    objects = {o["sha256"]: o["size"] for o in store.list()}
    whole = store.get(stub)
    assert claims_in(whole) and len(whole) < len(value) - 80_000  # the 80 KB log-probs are a claim inside it
    assert set(objects) == {stub.sha256, *(c.sha256 for c in claims_in(whole))}
    assert check_in(sent, store) == value


def test_threshold_zero_claims_no_part_only_a_whole_body_over_the_limit(store):
    value, _ = encode(big_group())
    assert check_out(value, store, threshold=0, limit=LIMIT) is value
    sent = check_out(value, store, threshold=0, limit=10_000)
    assert len(claims_in(sent)) == 1 and check_in(sent, store) == value


def incompressible(store, n: int = 50_000) -> tuple[bytes, Claim, bytes]:
    """A record with one random (uncompressible: codec none) part, its claim, and the record sent."""
    payload = np.random.default_rng(0).bytes(n)
    value = msgpack.packb({"schema": 1, "type": "x", "blob": payload}, use_bin_type=True)
    sent = check_out(value, store, threshold=4096, limit=LIMIT)
    [claim] = claims_in(sent)
    assert claim.codec == "none"
    return value, claim, sent


def test_a_missing_object_names_the_claim(store):
    _, claim, sent = incompressible(store)
    os.remove(object_path(store, claim))
    with pytest.raises(RecordError, match=f"claim {claim.sha256}: the object .* is missing"):
        check_in(sent, store)


def test_a_flipped_byte_is_a_checksum_mismatch(store):
    _, claim, sent = incompressible(store)
    path = object_path(store, claim)
    data = bytearray(open(path, "rb").read())
    data[100] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(RecordError, match=f"claim {claim.sha256}: the payload's SHA-256 is .*checksum mismatch"):
        check_in(sent, store)


def test_a_flipped_byte_in_a_compressed_object_is_refused(store):
    value, _ = encode(big_group(n_samples=1))
    sent = check_out(value, store, threshold=4096, limit=LIMIT)
    claim = next(c for c in claims_in(sent) if c.codec == "zstd")
    path = object_path(store, claim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(RecordError, match=f"claim {claim.sha256}: "):
        check_in(sent, store)


def with_claim(sent: bytes, **fields) -> bytes:
    """`sent` with its (one) claim's fields replaced or added."""
    body = msgpack.unpackb(sent)
    body["blob"][CLAIM_KEY].update(fields)
    return msgpack.packb(body, use_bin_type=True)


def test_a_wrong_size_is_a_size_mismatch(store):
    _, claim, sent = incompressible(store)
    for size in (claim.size - 1, claim.size + 1):
        with pytest.raises(RecordError, match=f"claim {claim.sha256}: .*size mismatch"):
            check_in(with_claim(sent, size=size), store)


@pytest.mark.parametrize("fields, reason", [
    ({"size": "50000"}, "size must be an integer"),
    ({"size": -1}, "size must be an integer"),
    ({"size": MAX_CLAIM_BYTES + 1}, "size must be an integer"),
    ({"size": True}, "size must be an integer"),
    ({"codec": "gzip"}, "codec must be one of"),
    ({"sha256": "ABC"}, "sha256 must be 64 lowercase hex"),
    ({"sha256": "A" * 64}, "sha256 must be 64 lowercase hex"),
    ({"extra": 1}, "expected a map of sha256, size, codec"),
])
def test_a_malformed_claim_is_refused(store, fields, reason):
    _, _, sent = incompressible(store)
    with pytest.raises(RecordError, match=f"malformed claim: {reason}"):
        check_in(with_claim(sent, **fields), store)


def test_a_claim_map_with_other_keys_or_of_another_type_is_refused(store):
    _, claim, sent = incompressible(store)
    body = msgpack.unpackb(sent)
    body["blob"]["more"] = 1
    with pytest.raises(RecordError, match=f"claim {claim.sha256}: malformed claim: a claim map holds only"):
        check_in(msgpack.packb(body, use_bin_type=True), store)
    body["blob"] = {CLAIM_KEY: [claim.sha256, claim.size]}
    with pytest.raises(RecordError, match="malformed claim: expected a map"):
        check_in(msgpack.packb(body, use_bin_type=True), store)
    stub = {"schema": 1, "type": "x", "samples": [], **claim.to_wire()}
    with pytest.raises(RecordError, match=r"malformed whole-body claim: the stub holds \['samples'\]"):
        check_in(msgpack.packb(stub, use_bin_type=True), store)


def test_a_whole_body_object_must_match_its_stub(store):
    value, _ = encode(big_group(n_samples=1))
    sent = check_out(value, store, threshold=0, limit=1000)
    body = msgpack.unpackb(sent)
    body["group_id"] = "another"
    with pytest.raises(RecordError, match=r"the stored body's \['group_id'\] differ"):
        check_in(msgpack.packb(body, use_bin_type=True), store)


def test_claims_without_a_store_cannot_be_read(store):
    _, claim, sent = incompressible(store)
    with pytest.raises(RecordError, match=f"claim {claim.sha256}: .*no claim store is configured"):
        check_in(sent, None)


def test_decompression_stops_at_the_claims_size(store):
    """A zstd bomb (100 MB of zeros in ~3 kB) under a claim of 1000 bytes: refused unread (longer than a payload
    of 1000 bytes can be compressed to); under a claim of its own length + 1: refused after that many bytes of output
    (never the 100 MB)."""
    bomb = zstandard.ZstdCompressor().compress(bytes(100 << 20))
    claim = Claim(hashlib.sha256(bytes(1000)).hexdigest(), 1000, "zstd")
    os.makedirs(os.path.dirname(object_path(store, claim)), exist_ok=True)
    # an object longer than the payload it claims is refused before it is read
    open(object_path(store, claim), "wb").write(bomb)
    record = msgpack.packb({"schema": 1, "blob": claim.to_wire()}, use_bin_type=True)
    with pytest.raises(RecordError, match=f"the object is {len(bomb)} bytes, which a 1000-byte payload"):
        check_in(record, store)
    small = Claim(claim.sha256, len(bomb) + 1, "zstd")
    os.rename(object_path(store, claim), object_path(store, small))
    tracemalloc.start()
    try:
        with pytest.raises(RecordError, match=f"decompresses to more than the claim's {len(bomb) + 1} bytes"):
            check_in(msgpack.packb({"schema": 1, "blob": small.to_wire()}, use_bin_type=True), store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"{peak} bytes allocated while refusing a bomb"


def test_a_store_needs_a_place_and_a_valid_bucket(tmp_path):
    with pytest.raises(ValueError, match="needs a directory"):
        ClaimStore("")
    with pytest.raises(ValueError, match="not an S3 bucket name"):
        ClaimStore("s3://A/prefix")


# --------------------------------------------------------------------------------------------------
# The sink and the readers


def test_a_sink_with_a_store_claim_checks_and_readers_resolve(store):
    transport = memory(claims=store)
    group = big_group()
    value, _ = encode(group)
    transport.sink().send_record("t", group, key=group.group_id)
    [m] = read_topic(transport, "t")
    assert len(m.value) < 2000 and dict(m.headers)[HEADER_CLAIMS] == b"6"
    inline = resolve_claims(m, store)
    assert inline.value == value and HEADER_CLAIMS not in dict(inline.headers)
    assert (inline.topic, inline.partition, inline.offset) == (m.topic, m.partition, m.offset)
    assert resolve_claims(inline, store) is inline


def test_a_header_that_miscounts_the_claims_is_refused(store):
    transport = memory(claims=store)
    transport.sink().send_record("t", big_group())
    [m] = read_topic(transport, "t")
    lying = type(m)(**{**m.__dict__, "headers": [(k, b"5" if k == HEADER_CLAIMS else v) for k, v in m.headers]})
    with pytest.raises(RecordError, match=f"header {HEADER_CLAIMS} says '5' claims, the record holds 6"):
        resolve_claims(lying, store)


def test_without_a_store_or_with_threshold_zero_a_record_over_the_limit_is_refused(tmp_path):
    group = big_group()
    for claims in (None, ClaimStore(tmp_path, threshold=0)):
        with pytest.raises(RecordTooLarge):
            memory(max_record_bytes=100_000, claims=claims).sink().send_record("t", group)


def test_the_sink_keeps_the_key_and_headers_within_the_limit(store):
    transport = memory(max_record_bytes=2000, claims=store)
    group = big_group(n_samples=1)
    parts_claimed = check_out(encode(group)[0], store, threshold=store.threshold, limit=LIMIT)
    assert 500 < len(parts_claimed) < 1000
    transport.sink().send_record("t", group, key="k" * 1500)  # the key leaves ~400 bytes for the value
    [m] = read_topic(transport, "t")
    assert len(claims_in(m.value)) == 1 and decode_group(resolve_claims(m, store).value) == group


def test_a_dead_letter_decode_diverts_what_cannot_be_resolved(store):
    transport = memory(claims=store)
    sink = transport.sink()
    groups = [big_group(seed=1), big_group(seed=2)]
    for g in groups:
        sink.send_record("t", g, key=g.group_id)
    messages = read_topic(transport, "t")
    os.remove(object_path(store, claims_in(messages[1].value)[0]))
    dead = DeadLetter(sink, "dlq", claims=store)
    decoded = dead.decode(messages, decode_group)
    assert [record for _, record in decoded] == groups[:1] and decoded[0][0] is messages[0]
    [diverted] = read_topic(transport, "dlq")
    assert diverted.value == messages[1].value  # byte for byte, claims and all
    assert "is missing from the claim store" in dict(diverted.headers)["rft-error"].decode()
