"""The record schema: property-based round trips (hypothesis) for every record type, and strict decoding: each
kind of bad input (truncated bytes, wrong version, missing fields, length mismatches, NaN) raises RecordError
with a reason that names the problem, and arbitrary bytes never raise anything else. The plain-msgpack examples
in docs/schema.md are run against rft.schema, both ways."""
from __future__ import annotations

import math
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rft.schema import (
    FAILURE_CLASSES,
    HEADER_SCHEMA,
    HEADER_TYPE,
    ControlMessage,
    ExperienceGroup,
    Image,
    RecordError,
    Sample,
    TaskRecord,
    Turn,
    decode,
    decode_group,
    decode_task,
    encode,
)
from tests.records import make_image

# Values msgpack carries unchanged (lists, not tuples; finite floats so that == holds).
scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.text()
           | st.floats(allow_nan=False, allow_infinity=False) | st.binary(max_size=16))
json_like = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
metadata = st.dictionaries(st.text(max_size=12), json_like, max_size=4)
finite = st.floats(allow_nan=False, allow_infinity=False)
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)


# A few real images of each media type (drawn once): what tasks and samples carry.
IMAGES = [make_image(w, h, fmt=fmt, seed=w) for fmt in ("PNG", "JPEG", "WEBP") for w, h in ((3, 5), (16, 9))]
image_lists = st.lists(st.sampled_from(IMAGES), max_size=3)


def arrays(dtype, elements=None):
    return hnp.arrays(np.dtype(dtype), st.integers(0, 40), elements=elements)


@st.composite
def turn_lists(draw, n: int) -> list[Turn] | None:
    """None, or the steps of a multi-turn episode: ascending, non-overlapping spans within `n` response tokens."""
    if not n or draw(st.booleans()):
        return None
    cuts = sorted(set(draw(st.lists(st.integers(0, n), min_size=2, max_size=8))))
    spans = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if draw(st.booleans()) or a == cuts[0]]
    return [Turn(start=a, end=b, state=draw(st.text(max_size=12)), reward=draw(finite)) for a, b in spans]


@st.composite
def samples(draw, index: int) -> Sample:
    response = draw(arrays("<i4"))
    n = len(response)
    failure = draw(st.sampled_from(("",) * 4 + FAILURE_CLASSES))
    images = draw(image_lists)
    return Sample(sample_index=index, prompt_tokens=draw(arrays("<i4")), response_tokens=response,
                  logprobs=draw(hnp.arrays(np.float32, n, elements=finite32)),
                  loss_mask=draw(hnp.arrays(np.uint8, n)), reward=0.0 if failure else draw(finite),
                  reward_components=draw(st.dictionaries(st.text(max_size=8), finite, max_size=3)),
                  finish_reason=draw(st.sampled_from(["stop", "length", "", "abort"])), metadata=draw(metadata),
                  failure=failure, turns=draw(turn_lists(n)), images=images,
                  prompt_text=draw(st.text(min_size=1, max_size=40)) if images else "")


@st.composite
def groups(draw) -> ExperienceGroup:
    n = draw(st.integers(1, 4))
    return ExperienceGroup(run_id=draw(st.text()), task_id=draw(st.text()), group_id=draw(st.text()),
                           attempt=draw(st.integers(0, 2 ** 31)), explorer_id=draw(st.text()),
                           policy_version=draw(st.integers(0, 2 ** 40)), samples=[draw(samples(i)) for i in range(n)],
                           answer=draw(json_like), metadata=draw(metadata), created_at=draw(times),
                           greedy_reward=draw(st.none() | finite))


tasks = st.builds(TaskRecord, run_id=st.text(), task_id=st.text(), epoch=st.integers(0, 10 ** 6), prompt=st.text(),
                  answer=json_like, metadata=metadata, created_at=times, images=image_lists)
controls = st.builds(ControlMessage, kind=st.text(min_size=1), sender=st.text(),
                     body=st.dictionaries(st.text(max_size=8), json_like, max_size=5), created_at=times)


@settings(max_examples=100, deadline=None)
@given(tasks)
def test_task_round_trip(task):
    value, headers = encode(task)
    assert decode_task(value, headers) == task
    assert dict(headers) == {HEADER_SCHEMA: b"1", HEADER_TYPE: b"task"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_experience_group_round_trip(group):
    value, headers = encode(group)
    back = decode_group(value, headers)
    assert back == group
    for ours, theirs in zip(back.samples, group.samples, strict=True):
        assert ours.response_tokens.dtype == np.int32 and ours.logprobs.dtype == np.float32
        assert ours.loss_mask.dtype == np.uint8
        assert ours.logprobs.tobytes() == theirs.logprobs.astype("<f4").tobytes()  # bit-exact, -0.0 included


@settings(max_examples=100, deadline=None)
@given(controls)
def test_control_round_trip(message):
    value, headers = encode(message)
    assert decode(value, headers) == message


def test_arrays_are_little_endian_whatever_their_input():
    group = _group()
    group.samples[0].response_tokens = np.array([1, 256, -2], dtype=">i8")
    group.samples[0].logprobs = np.array([-0.5, -1.25, -2.0], dtype=">f8")
    group.samples[0].loss_mask = np.array([1, 0, 1], dtype=bool)
    body = msgpack.unpackb(encode(group)[0])
    assert body["samples"][0]["response_tokens"] == b"\x01\x00\x00\x00\x00\x01\x00\x00\xfe\xff\xff\xff"
    assert np.frombuffer(body["samples"][0]["logprobs"], "<f4").tolist() == [-0.5, -1.25, -2.0]
    assert body["samples"][0]["loss_mask"] == b"\x01\x00\x01"


# --------------------------------------------------------------------------------------------------
# Decode failures


def _group() -> ExperienceGroup:
    samples = [Sample(sample_index=i, prompt_tokens=np.arange(5), response_tokens=np.arange(4),
                      logprobs=np.full(4, -0.5), loss_mask=np.ones(4), reward=1.0, reward_components={"score": 1.0})
               for i in range(2)]
    return ExperienceGroup(run_id="run", task_id="t", group_id="run/t/e0", attempt=0, explorer_id="x",
                           policy_version=3, samples=samples)


def _body(record=None) -> dict:
    return msgpack.unpackb(encode(record or _group())[0], raw=False)


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def reason(value: bytes, headers=None) -> str:
    with pytest.raises(RecordError) as e:
        decode(value, headers)
    return str(e.value)


def test_truncated_bytes_are_rejected_at_every_cut():
    value, headers = encode(_group())
    for cut in range(0, len(value), 7):
        assert "not msgpack" in reason(value[:cut], headers)


def test_empty_and_non_map_values():
    assert "not msgpack" in reason(b"")
    assert "must be a map" in reason(msgpack.packb([1, 2, 3]))
    assert "record value is empty" in reason(None)


def test_wrong_schema_version_in_header_and_body():
    value, headers = encode(_group())
    bad_headers = [(HEADER_SCHEMA, b"2"), (HEADER_TYPE, b"experience_group")]
    assert "schema version '2' is not supported" in reason(value, bad_headers)
    assert "missing header 'rft-schema'" in reason(value, [])
    body = _body()
    body["schema"] = 2
    assert "schema version 2 is not supported" in reason(_pack(body), headers)
    del body["schema"]
    assert "schema version None" in reason(_pack(body))


def test_header_type_must_match_body():
    value, _ = encode(_group())
    assert "does not match body type" in reason(value, [(HEADER_SCHEMA, b"1"), (HEADER_TYPE, b"task")])
    with pytest.raises(RecordError, match="expected a task"):
        decode_task(value)
    with pytest.raises(RecordError, match="expected an experience group"):
        decode_group(encode(TaskRecord("r", "t", 0, "p"))[0])


@pytest.mark.parametrize("record, field", [
    (_group(), f) for f in ("run_id", "task_id", "group_id", "attempt", "explorer_id", "policy_version", "metadata",
                            "created_at", "samples")] + [
    (TaskRecord("r", "t", 0, "p"), f) for f in ("run_id", "task_id", "epoch", "prompt", "metadata", "created_at")] + [
    (ControlMessage("version", "trainer"), f) for f in ("kind", "sender", "body", "created_at")])
def test_missing_field_is_named(record, field):
    body = _body(record)
    del body[field]
    assert f"missing field {field!r}" in reason(_pack(body))


@pytest.mark.parametrize("field", ["sample_index", "prompt_tokens", "response_tokens", "logprobs", "loss_mask",
                                   "reward", "reward_components", "finish_reason", "metadata"])
def test_missing_sample_field_is_named_with_its_position(field):
    body = _body()
    del body["samples"][1][field]
    message = reason(_pack(body))
    assert message.startswith("samples[1]: ") and f"missing field {field!r}" in message


def test_wrong_field_types_are_named():
    body = _body()
    body["policy_version"] = "3"
    assert "field 'policy_version': expected int, got str" in reason(_pack(body))
    body = _body()
    body["attempt"] = True
    assert "field 'attempt': expected int, got bool" in reason(_pack(body))
    body = _body()
    body["samples"][0]["response_tokens"] = [1, 2, 3, 4]
    assert "samples[0]: field 'response_tokens': expected bytes, got list" in reason(_pack(body))


def test_no_samples_and_unknown_type():
    body = _body()
    body["samples"] = []
    assert "no samples" in reason(_pack(body))
    body["type"] = "weights"
    assert "unknown record type 'weights'" in reason(_pack(body))


@pytest.mark.parametrize("field, cut, expected", [
    ("response_tokens", 1, "response_tokens: 15 bytes is not a whole number of int32 values (truncated?)"),
    ("prompt_tokens", 2, "prompt_tokens: 18 bytes is not a whole number of int32 values"),
    ("logprobs", 3, "logprobs: 13 bytes is not a whole number of float32 values"),
])
def test_truncated_arrays(field, cut, expected):
    body = _body()
    body["samples"][0][field] = body["samples"][0][field][:-cut]
    assert expected in reason(_pack(body))


@pytest.mark.parametrize("field, keep, expected", [
    ("logprobs", 3, "samples[0]: logprobs has 3 entries for 4 response tokens"),
    ("loss_mask", 5, "samples[0]: loss_mask has 5 entries for 4 response tokens"),
    ("response_tokens", 2, "samples[0]: logprobs has 4 entries for 2 response tokens"),
])
def test_length_mismatches(field, keep, expected):
    body = _body()
    dtype = {"logprobs": "<f4", "loss_mask": "u1", "response_tokens": "<i4"}[field]
    body["samples"][0][field] = np.zeros(keep, dtype=dtype).tobytes()
    assert expected in reason(_pack(body))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_and_logprobs(bad):
    group = _group()
    group.samples[1].reward = bad
    assert "samples[1]: reward is NaN or infinite" in reason(encode(group)[0])
    group = _group()
    group.samples[0].reward_components["score"] = bad
    assert "samples[0]: reward is NaN or infinite" in reason(encode(group)[0])
    group = _group()
    group.samples[0].logprobs[2] = bad
    assert "samples[0]: logprobs contain NaN or infinity" in reason(encode(group)[0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_greedy_reward_is_optional_finite_and_old_records_read(bad):
    body = _body()
    assert "greedy_reward" not in body  # none: not written (a record as before the field existed)
    assert decode(_pack(body)).greedy_reward is None
    body["greedy_reward"] = None
    assert decode(_pack(body)).greedy_reward is None
    body["greedy_reward"] = 1  # an integer reads as a float
    assert decode(_pack(body)).greedy_reward == 1.0
    body["greedy_reward"] = bad
    assert reason(_pack(body)) == "greedy_reward is NaN or infinite"
    body["greedy_reward"] = "0.5"
    assert reason(_pack(body)) == "field 'greedy_reward': expected float, got str"


def test_non_numeric_reward_component():
    body = _body()
    body["samples"][0]["reward_components"] = {"score": "high"}
    assert reason(_pack(body)).startswith("samples[0]: ")


def test_null_header_value_is_a_record_error():
    value, _ = encode(_group())
    assert "schema version" in reason(value, [(HEADER_SCHEMA, None)])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.tuples(st.sampled_from([HEADER_SCHEMA, HEADER_TYPE, "x"]),
                                                   st.binary(max_size=20) | st.none()), max_size=3))
def test_arbitrary_bytes_raise_only_record_error(value, headers):
    try:
        decode(value, headers)
    except RecordError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupted_fields_raise_only_record_error(data):
    """Replace one field of a valid body (or of one of its samples) with an arbitrary msgpack value."""
    body = _body()
    target = body if data.draw(st.booleans()) else body["samples"][data.draw(st.integers(0, 1))]
    target[data.draw(st.sampled_from(sorted(target)))] = data.draw(json_like)
    try:
        record = decode(_pack(body))
    except RecordError:
        return
    assert isinstance(record, (ExperienceGroup, TaskRecord, ControlMessage))
    if isinstance(record, ExperienceGroup):
        assert all(np.isfinite(s.reward) for s in record.samples)


def test_a_failed_sample_has_no_reward_on_the_wire_and_is_left_out_of_the_baseline():
    group = _group()
    group.samples[1].failure = "environment"
    body = msgpack.unpackb(encode(group)[0], raw=False)
    assert body["samples"][1]["reward"] is None and body["samples"][1]["failure"] == "environment"
    assert "failure" not in body["samples"][0]  # a scored sample's record is as before the field existed
    back = decode_group(_pack(body))
    assert [s.scored for s in back.samples] == [True, False] and back.scored_samples == [back.samples[0]]
    body["samples"][1]["failure"] = "flaky"
    assert reason(_pack(body)).startswith("samples[1]: failure 'flaky' is not one of")
    body["samples"][1]["failure"] = "timeout"
    body["samples"][1]["reward"] = 0.0  # a failure scored as 0 is what this field exists to prevent
    assert reason(_pack(body)) == "samples[1]: a failed sample (timeout) has a reward: it must be nil"
    del body["samples"][1]["failure"]
    body["samples"][1]["reward"] = None
    assert reason(_pack(body)) == "samples[1]: field 'reward': expected float, got NoneType"
    group.samples[1].failure = "flaky"
    with pytest.raises(ValueError, match="failure 'flaky' is not one of"):
        encode(group)


@pytest.mark.parametrize("turns, expected", [
    ("x", "must be an array of [start, end, state, reward]"),
    ([[0, 2, "s0"]], "must be an array of [start, end, state, reward]"),
    ([[0, 2, 7, 0.0]], "must be an array of [start, end, state, reward]"),
    ([[2, 2, "s", 0.0]], "turns[0]: tokens [2, 2) must be non-empty"),
    ([[0, 3, "s", 0.0], [2, 4, "t", 0.0]], "turns[1]: tokens [2, 4) must be non-empty, after the previous turn's "
                                           "end 3"),
    ([[0, 5, "s", 0.0]], "within the 4 response tokens"),
    ([[0, 2, "s" * 257, 0.0]], "state key of 257 characters"),
    ([[0, 2, "s", math.nan]], "turns[0]: reward nan is not finite"),
])
def test_turns_that_do_not_fit_their_sample_are_rejected(turns, expected):
    body = _body()
    body["samples"][1]["turns"] = [[0, 2, "s0", 0.5], [2, 4, "s1", 1.0]]
    assert decode(_pack(body)).samples[1].turns == [Turn(0, 2, "s0", 0.5), Turn(2, 4, "s1", 1.0)]
    body["samples"][1]["turns"] = turns
    assert expected in reason(_pack(body)) and reason(_pack(body)).startswith("samples[1]: turns: ")


# --------------------------------------------------------------------------------------------------
# docs/schema.md: its plain-Python reader and writer agree with rft.schema


@pytest.fixture(scope="module")
def doc_examples() -> dict:
    text = (Path(__file__).resolve().parents[2] / "docs" / "schema.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2, "docs/schema.md should have its reader and writer examples"
    namespace: dict = {}
    exec(compile("\n".join(blocks), "docs/schema.md", "exec"), namespace)
    return namespace


def test_doc_reader_decodes_what_rft_writes(doc_examples):
    group = _group()
    group.samples[1].logprobs = np.array([-0.1, -2.5, -30.0, 0.0], dtype=np.float32)
    group.samples[1].loss_mask = np.array([1, 0, 0, 1], dtype=np.uint8)
    group.samples[1].images = [IMAGES[0], IMAGES[3], IMAGES[4]]  # PNG, JPEG, WebP
    group.samples[1].prompt_text = "<image><image><image>which is red?"
    value, headers = encode(group)
    read = doc_examples["read_experience_group"](value, headers)
    assert (read["group_id"], read["policy_version"], read["explorer_id"]) == ("run/t/e0", 3, "x")
    for ours, theirs in zip(read["samples"], group.samples, strict=True):
        assert ours["prompt_tokens"] == theirs.prompt_tokens.tolist()
        assert ours["response_tokens"] == theirs.response_tokens.tolist()
        assert ours["logprobs"] == theirs.logprobs.astype(np.float32).tolist()
        assert ours["loss_mask"] == theirs.loss_mask.tolist() and ours["reward"] == theirs.reward
        assert [Image(**i) for i in ours["images"]] == theirs.images
        assert ours.get("prompt_text", "") == theirs.prompt_text
    body = _body(group)
    body["samples"][1]["images"][2]["sha256"] = IMAGES[0].sha256
    with pytest.raises(ValueError, match="images\\[2\\]: the bytes do not match their sha256"):
        doc_examples["read_experience_group"](_pack(body), headers)
    body["samples"][1]["images"][2] = {**body["samples"][1]["images"][1], "media_type": "image/png"}
    with pytest.raises(ValueError, match="images\\[2\\]: the bytes .* are not 'image/png'"):
        doc_examples["read_experience_group"](_pack(body), headers)
    with pytest.raises(ValueError, match="not an rft schema-1"):
        doc_examples["read_experience_group"](value, [("rft-schema", b"2")])
    group.samples[0].failure = "verifier"
    read = doc_examples["read_experience_group"](*encode(group))
    assert read["samples"][0]["failure"] == "verifier" and read["samples"][0]["reward"] is None


def test_rft_decodes_what_the_doc_writer_writes(doc_examples):
    samples = [{"prompt_tokens": [1, 2, 3], "response_tokens": [7, 8], "logprobs": [-0.5, -1.5], "loss_mask": [1, 1],
                "reward": 1.0, "finish_reason": "stop"},
               {"prompt_tokens": [1, 2, 3], "response_tokens": [9], "logprobs": [-0.25], "loss_mask": [0], "reward": 0,
                "images": [(IMAGES[1].data, "image/png"), (IMAGES[5].data, "image/webp")],
                "prompt_text": "<image><image>same?"}]
    value, headers = doc_examples["write_experience_group"](run_id="run", task_id="t9", epoch=2, explorer_id="rust-1",
                                                           policy_version=4, samples=samples, created_at=1.5e9)
    group = decode_group(value, headers)
    assert (group.group_id, group.policy_version, group.created_at) == ("run/t9/e2", 4, 1.5e9)
    assert [s.response_tokens.tolist() for s in group.samples] == [[7, 8], [9]]
    assert group.samples[0].logprobs.tolist() == [-0.5, -1.5] and group.samples[1].loss_mask.tolist() == [0]
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert group.samples[0].images == [] and group.samples[1].images == [IMAGES[1], IMAGES[5]]
    assert group.samples[1].prompt_text == "<image><image>same?"


@pytest.mark.parametrize("limit", [1_000_000, 500], ids=["parts", "whole body"])
def test_doc_reader_resolves_claims_from_a_directory_store(doc_examples, tmp_path, limit):
    """The reader of docs/schema.md on records that rft's sink claim-checked (rft.transport.claims): parts over the
    threshold, and a whole body over the limit."""
    from rft.transport import ClaimStore, claims_in
    from rft.transport.claims import HEADER_CLAIMS, check_out

    group = _group()
    group.samples[0].response_tokens = np.arange(3000)
    group.samples[0].logprobs, group.samples[0].loss_mask = np.full(3000, -0.5), np.ones(3000)
    value, headers = encode(group)
    store = ClaimStore(tmp_path)
    sent = check_out(value, store, threshold=1000, limit=limit)
    headers = [*headers, (HEADER_CLAIMS, str(len(claims_in(sent))).encode())]
    read = doc_examples["read_experience_group"](sent, headers, str(tmp_path))
    assert read["samples"][0]["response_tokens"] == list(range(3000)) and read["group_id"] == group.group_id
    (tmp_path / claims_in(sent)[0].key).write_bytes(b"something else")
    with pytest.raises(ValueError, match="does not match its size or SHA-256"):
        doc_examples["read_experience_group"](sent, headers, str(tmp_path))
