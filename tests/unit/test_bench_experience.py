"""`rft bench experience` (benchmarks/experience_path.py): the experience path's record sizes against what
rft.schema and the claim-check really make of such a group, and one fleet row worked by hand."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from benchmarks.experience_path import Assumptions, Workload, fleet_row, record
from rft.schema import ExperienceGroup, RoutedExperts, Sample, encode
from rft.transport import Claim, ClaimStore, check_out, claims_in


class CountingStore(ClaimStore):
    """Puts counted in memory (check_out only puts); nothing is written."""

    def __init__(self):
        super().__init__("unused", threshold=131072)
        self.objects_put: list[int] = []
        self.stored: dict[str, bytes] = {}

    def put(self, payload: bytes) -> Claim:
        self.objects_put.append(len(payload))
        claim = Claim(hashlib.sha256(payload).hexdigest(), len(payload), "none")
        self.stored[claim.sha256] = payload
        return claim


def group(tokens: int, routing: bool) -> ExperienceGroup:
    prompt = np.arange(512, dtype=np.int32)  # one prompt object shared by the samples, as an explorer's are
    samples = [Sample(sample_index=j, prompt_tokens=prompt, response_tokens=np.full(tokens, j, np.int32),
                      logprobs=np.full(tokens, -j, np.float32), loss_mask=np.ones(tokens, np.uint8),
                      reward=float(j % 2), finish_reason="length",
                      routed_experts=RoutedExperts(np.full((tokens, 48, 8), j, np.uint8), 128, list(range(48)), 511)
                      if routing else None) for j in range(8)]
    return ExperienceGroup(run_id="bench", task_id="task-0", group_id="bench/task-0/e0", attempt=0,
                           explorer_id="bench-explorer", policy_version=0, samples=samples)


@pytest.mark.parametrize("tokens, routing", [(1024, False), (1024, True), (16384, False), (16384, True)])
def test_record_sizes_are_what_the_schema_and_the_claim_check_make(tokens, routing):
    value, _ = encode(group(tokens, routing))
    store = CountingStore()
    sent = check_out(value, store, threshold=131072, limit=1_000_000)
    model = record(tokens, routing, 131072, 1_000_000)
    assert model.inline_bytes == pytest.approx(len(value), rel=0.002)
    assert model.claimed_bytes == pytest.approx(len(sent), rel=0.01, abs=60)
    assert model.puts == len(store.objects_put)
    assert model.put_bytes == pytest.approx(sum(store.objects_put), rel=0.002)
    gets = claims_in(sent)  # what a reader fetches: the record's claims, and those of a stub's stored body
    gets += [c for stub in gets for c in claims_in(store.stored[stub.sha256])]
    assert model.claims == len(gets)
    assert model.get_bytes == pytest.approx(sum(c.size for c in gets), rel=0.002)


def test_a_fleet_row_worked_by_hand():
    a = Assumptions(tokens_s=2500, replication=3, readers=2, partition_mb_s=10)
    long16k = Workload("long traces", 16384, 8 * 16384 / 2500)  # 52.4 s a group
    row = fleet_row(1024, long16k, True, a)
    rate = 1024 / 52.4288
    inline_mb = record(16384, True, a.threshold, a.limit).inline_bytes / 1e6  # ~51.5 MB: 8 x 16384 x 393 B
    assert row["groups_s"] == pytest.approx(rate)
    assert row["inline"]["in_mb_s"] == pytest.approx(3 * rate * inline_mb)  # leaders + 2 followers
    assert row["inline"]["out_mb_s"] == pytest.approx(4 * rate * inline_mb)  # trainer, publisher, 2 followers
    assert row["inline"]["partitions"] == 101  # 1006 MB/s at 10 MB/s a partition
    assert row["claim_check"]["partitions"] == 1 and row["claimed_bytes"] < 300  # a stub per group
    # 8 routing maps and then the whole body (still over 1 MB without the maps: 8 x 16384 x 9 B)
    assert row["store"]["puts_s"] == pytest.approx(9 * rate)
    assert row["store"]["gets_s"] == pytest.approx(2 * 9 * rate)  # each reader: the stub's body, then its 8 maps
