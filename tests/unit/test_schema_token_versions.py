"""The optional `version_spans` of a sample (docs/schema.md): every response token's weights version, written as
spans. Round trip, records without it (older records) still read as the group's version, and each way a span list
that does not fit its sample or its group is rejected with a reason."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rft.schema import RecordError, decode_group, encode, version_spans, versions_from_spans
from tests.records import make_group


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2 ** 40), max_size=30))
def test_spans_round_trip_any_versions(versions):
    spans = version_spans(versions)
    assert versions_from_spans(spans, len(versions)).tolist() == versions
    assert [start for _, start in spans] == sorted({0} | {i for i in range(1, len(versions))
                                                          if versions[i] != versions[i - 1]}) if versions else not spans


def group_with_versions(policy_version: int = 3):
    group = make_group("run", 1, response_len=6, policy_version=policy_version)
    group.samples[0].token_versions = np.array([3, 3, 4, 4, 4, 5])  # the sample that saw two weight updates
    group.samples[1].token_versions = np.full(6, 4)
    return group


def test_a_group_round_trips_with_spans_and_samples_without_them_take_the_groups_version():
    group = group_with_versions()
    value, _ = encode(group)
    body = msgpack.unpackb(value)
    assert body["samples"][0]["version_spans"] == [[3, 0], [4, 2], [5, 5]]
    assert "version_spans" not in body["samples"][2]
    back = decode_group(value)
    assert back == group
    assert back.samples[0].versions_of(back.policy_version).tolist() == [3, 3, 4, 4, 4, 5]
    assert back.samples[2].token_versions is None and back.samples[2].versions_of(3).tolist() == [3] * 6
    other = group_with_versions()
    other.samples[1].token_versions = np.full(6, 5)
    assert other != group  # versions take part in equality


def test_records_without_spans_still_read():
    """A record written before version_spans existed (the field absent, or nil) reads as before."""
    body = msgpack.unpackb(encode(make_group("run", 1, policy_version=7))[0])
    assert all("version_spans" not in s for s in body["samples"])
    body["samples"][0]["version_spans"] = None
    group = decode_group(msgpack.packb(body, use_bin_type=True))
    assert all(s.token_versions is None and s.versions_of(7).tolist() == [7] * 6 for s in group.samples)


def corrupt(change) -> bytes:
    body = msgpack.unpackb(encode(group_with_versions())[0])
    change(body)
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("change,reason", [
    (lambda b: b["samples"][0].update(version_spans=[[3, 1], [4, 2]]), r"samples\[0\]: version_spans: starts \[1, 2\]"),
    (lambda b: b["samples"][0].update(version_spans=[[3, 0], [4, 4], [5, 4]]), r"starts \[0, 4, 4\] must ascend"),
    (lambda b: b["samples"][0].update(version_spans=[[3, 0], [4, 6]]), "stay below the 6 response tokens"),
    (lambda b: b["samples"][0].update(version_spans=[]), r"starts \[\] must ascend from 0"),
    (lambda b: b["samples"][0].update(version_spans=[[3, 0], [-1, 2]]), "pairs of integers >= 0"),
    (lambda b: b["samples"][0].update(version_spans=[[3, 0, 1]]), "pairs of integers >= 0"),
    (lambda b: b["samples"][0].update(version_spans={"3": 0}), "pairs of integers >= 0"),
    (lambda b: b["samples"][0].update(version_spans=[[2, 0]]), "policy_version 3 is not the oldest token version"),
    (lambda b: b.update(policy_version=2), None),  # older than every token: allowed only if a sample has no spans
    (lambda b: [s.update(version_spans=[[4, 0]]) for s in b["samples"]], "policy_version 3 is not the oldest"),
])
def test_spans_that_do_not_fit_are_rejected_with_their_reason(change, reason):
    if reason is None:
        assert decode_group(corrupt(change)).policy_version == 2
        return
    with pytest.raises(RecordError, match=reason):
        decode_group(corrupt(change))


def test_the_writer_refuses_versions_that_do_not_fit():
    group = group_with_versions()
    group.samples[0].token_versions = np.array([3, 4])
    with pytest.raises(ValueError, match="token_versions: 2 versions for 6 response tokens"):
        encode(group)
    group = group_with_versions(policy_version=4)  # a token of version 3 is older than the group says
    with pytest.raises(ValueError, match="policy_version 4 is not the oldest token version"):
        encode(group)


def test_the_engines_version_spans_become_one_version_per_token():
    """vLLM's weight-version spans (output-token index ranges -> the version label rft set) as token versions; spans
    that do not cover the tokens exactly (none reported, a stop string's cut, a label that is not a version) give
    None, and the completion then carries no per-token versions."""
    from types import SimpleNamespace as Span

    from rft.engine.vllm_engine import token_versions

    spans = [Span(version="3", start=0, end=2), Span(version="4", start=2, end=5)]
    assert token_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert token_versions(spans, 4) is None  # a stop string cut the last token after the spans were counted
    assert token_versions([], 0) is None and token_versions(None, 3) is None
    assert token_versions([Span(version="default", start=0, end=3)], 3) is None  # vLLM's own label, not rft's
    assert token_versions([Span(version="1", start=1, end=3)], 3) is None  # a gap
