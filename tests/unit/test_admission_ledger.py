"""Admission that counts the fleet (rft/explorer/admission.py, the ledger): the fold against hand-worked logs, and a
fleet of explorers (the production StalenessAdmission and KafkaFleetFeed, over the in-memory transport: an
in-memory implementation of rft's own transport protocols) in seeded random interleavings with a trainer, checked
against the ground truth at every admission: the groups the fleet has taken never exceed AReaL's bound
(k + version + 1) * B for the admitting explorer's version. The same schedules without the ledger (each explorer
dividing what is left without counting the others' running groups) break the bound, so the check can fail. The
trainer takes groups one at a time, so readings often find it waiting with a partial step (its `trainer_waiting`
says how many groups it holds: counted in the accepted groups)."""
from __future__ import annotations

import random

import pytest

from rft.explorer.admission import AdmissionLedger, KafkaFleetFeed, StalenessAdmission
from rft.schema import ControlMessage
from rft.transport.control import (
    AdmissionClaim,
    AdmissionRelease,
    ExplorerHeartbeat,
    ExplorerJoin,
    TrainerWaiting,
    Weights,
)
from rft.transport.memory import MemoryTransport
from tests.records import make_group


def claim(explorer: str, groups: int, limit: int, seen: int, cid: str = "") -> AdmissionClaim:
    return AdmissionClaim(explorer_id=explorer, claim_id=cid or f"{explorer}-{groups}-{seen}", groups=groups,
                          limit=limit, seen=seen)


def test_the_fold_counts_outstanding_groups_as_each_claim_read_the_fleet():
    ledger = AdmissionLedger()
    log = [
        claim("a", 3, limit=4, seen=0),                   # 0: granted 3
        claim("b", 3, limit=4, seen=0),                   # 1: 4 - 3 outstanding -> 1
        AdmissionRelease(explorer_id="a", groups=2),      # 2: a's 2 produced
        claim("b", 2, limit=4, seen=2),                   # 3: read before the release: 4 - 4 -> 0
        claim("b", 2, limit=2, seen=3),                   # 4: read after it (limit counts the 2 in the backlog): 2 - 2
        AdmissionRelease(explorer_id="b", groups=5),      # 5: b holds 1: releases 1, not 5
        claim("c", 9, limit=6, seen=6),                   # 6: outstanding 4 - 3 = 1 -> 5
        AdmissionRelease(explorer_id="c", reset=True, by="a"),  # 7: c silent: all 5 of it
        claim("a", 1, limit=0, seen=8),                   # 8: no capacity
    ]
    grants = [ledger.apply(offset, kind) for offset, kind in enumerate(log)]
    assert grants == [3, 1, None, 0, 0, None, 5, None, 0]
    assert ledger.outstanding == {"a": 1, "b": 0, "c": 0}
    assert (ledger.granted, ledger.released, ledger.position) == (9, 8, 9)
    assert [ledger.outstanding_at(seen) for seen in (0, 2, 3, 6, 7, 8)] == [9, 9, 7, 6, 6, 1]
    assert ledger.apply(3, claim("z", 5, limit=99, seen=0)) is None  # an offset already applied is not applied again
    assert ledger.granted == 9


def test_every_explorer_folding_the_same_log_agrees_on_every_grant():
    rng = random.Random(7)
    log = []
    for offset in range(300):
        explorer = rng.choice("abc")
        if rng.random() < 0.5:
            log.append(claim(explorer, rng.randint(1, 4), limit=rng.randint(-2, 12), seen=rng.randint(0, offset),
                             cid=str(offset)))
        else:
            log.append(AdmissionRelease(explorer_id=explorer, groups=rng.randint(0, 3), reset=rng.random() < 0.05))
    folds = []
    for _ in range(3):
        ledger = AdmissionLedger()
        folds.append([ledger.apply(o, k) for o, k in enumerate(log)] + [dict(ledger.outstanding)])
        assert all(v >= 0 for v in ledger.outstanding.values())
    assert folds[0] == folds[1] == folds[2]


# ------------------------------------------------------------------------------ a fleet against the ground truth

CONTROL, EXPERIENCES = "fleet.control", "fleet.experiences"


class Fleet:
    """Explorers (StalenessAdmission + KafkaFleetFeed each) and a trainer on one broker (default: an in-memory one),
    driven one action at a time by a seeded schedule. Ground truth: `running` (groups started, not produced, per
    explorer), `produced`, `consumed` (by the trainer), the trainer's version. tests/integration/test_admission.py
    runs it on the real broker."""

    def __init__(self, *, explorers: int, k: int, groups_per_step: int, seed: int, ledger: bool, transport=None,
                 prefix: str = "fleet"):
        self.control, self.experiences = f"{prefix}.control", f"{prefix}.experiences"
        self.k, self.b, self.rng = k, groups_per_step, random.Random(seed)
        self.transport = transport or MemoryTransport(partitions=2)
        self.transport.admin().create_topics([self.control], partitions=2)
        self.transport.admin().create_topics([self.experiences], partitions=1)
        self.sink = self.transport.sink()
        self.ids = [f"e{i}" for i in range(explorers)]
        for e in self.ids:
            self.announce(ExplorerJoin(explorer_id=e).to_message())
        self.sink.flush()
        self.admissions, self.versions = {}, {e: 0 for e in self.ids}
        for e in self.ids:
            feed = KafkaFleetFeed(self.transport, control_topic=self.control, experiences_topic=self.experiences,
                                  client_id=e, live_horizon_s=1e9, explorer_id=e)
            if not ledger:  # the same feed, read as a plain FleetFeed: no claims, each explorer counts alone
                feed = PlainFeed(feed)
            self.admissions[e] = StalenessAdmission.for_mode("off_policy", max_staleness=k,
                                                             groups_per_step=groups_per_step, feed=feed, refresh_s=0.0)
        self.running = {e: [] for e in self.ids}
        self.produced = self.consumed = self.trainer_version = 0
        self.worst_excess = 0  # max over admissions of (groups taken) - (k + version + 1) * B

    def announce(self, message: ControlMessage) -> None:
        self.sink.send_record(self.control, message)

    def run(self, actions: int) -> Fleet:
        for _ in range(actions):
            self.act()
        return self

    def close(self) -> None:
        for admission in self.admissions.values():
            admission.close()
        self.sink.close()

    def act(self) -> None:
        e = self.rng.choice(self.ids)
        roll = self.rng.random()
        if roll < 0.45:
            self.admit(e)
        elif roll < 0.8 and self.running[e]:
            self.produce(e)
        elif roll < 0.95:
            self.train()
        elif self.versions[e] < self.trainer_version:
            self.versions[e] = self.trainer_version
            self.admissions[e].set_version(self.trainer_version)
        else:
            self.announce(ExplorerHeartbeat(explorer_id=e).to_message())
            self.sink.flush()

    def admit(self, e: str) -> None:
        granted = self.admissions[e].admit(self.rng.randint(1, 4))
        self.running[e] += [self.versions[e]] * granted
        if granted:
            taken = self.produced + sum(len(r) for r in self.running.values())  # every slot trained or waiting
            self.worst_excess = max(self.worst_excess, taken - (self.k + self.versions[e] + 1) * self.b)

    def produce(self, e: str) -> None:
        n = self.rng.randint(1, len(self.running[e]))
        for _ in range(n):
            self.running[e].pop(self.rng.randrange(len(self.running[e])))
            self.sink.send_record(self.experiences, make_group("fleet", self.produced), key=str(self.produced))
            self.sink.flush()
            self.produced += 1
        self.admissions[e].finish(n)

    def train(self) -> None:
        """The trainer takes one group into its step; the B-th ends the step (`weights`), the others leave it
        waiting with a partial step (`trainer_waiting` with groups_in_batch)."""
        if self.produced > self.consumed:
            self.consumed += 1
            offsets = {f"{self.experiences}:0": self.consumed}
            if self.consumed % self.b == 0:
                self.trainer_version += 1
                self.announce(Weights(version=self.trainer_version, path="/w", offsets=offsets).to_message())
            else:
                self.announce(TrainerWaiting(version=self.trainer_version, offsets=offsets,
                                             groups_in_batch=self.consumed % self.b).to_message())
            self.sink.flush()


class PlainFeed:
    """A KafkaFleetFeed read as a FleetFeed without a ledger: its readings only (the admission before issue 28)."""

    def __init__(self, feed: KafkaFleetFeed):
        self.feed = feed

    def read(self):
        return self.feed.read()

    def close(self) -> None:
        self.feed.close()


@pytest.mark.parametrize("explorers", [2, 3])
def test_the_fleet_never_takes_more_than_the_bound_with_the_ledger_and_does_without(explorers):
    with_ledger, without = [], []
    for seed in range(6):
        for ledger, out in ((True, with_ledger), (False, without)):
            fleet = Fleet(explorers=explorers, k=1, groups_per_step=4, seed=seed, ledger=ledger)
            for _ in range(400):
                fleet.act()
            assert fleet.trainer_version >= 6, "the schedule must make progress"
            out.append(fleet.worst_excess)
    assert max(with_ledger) <= 0, with_ledger
    assert max(without) > 0, "the schedules must be able to break the bound without the ledger"


def test_a_claim_given_up_on_and_granted_later_is_released():
    transport = MemoryTransport(partitions=2)
    transport.admin().create_topics([CONTROL], partitions=2)
    transport.admin().create_topics([EXPERIENCES], partitions=1)
    feed = KafkaFleetFeed(transport, control_topic=CONTROL, experiences_topic=EXPERIENCES, client_id="a",
                          live_horizon_s=60, explorer_id="a")
    reading = feed.read()
    feed._waiting.clear()  # noqa: SLF001 - as if `claim` had timed out before its claim came back
    transport.sink().send_record(CONTROL, claim("a", 3, limit=8, seen=reading.seen, cid="lost").to_message())
    # a claim written to another partition is not in the ledger's log (only partition 0 is ordered)
    feed.read()
    assert feed.ledger.outstanding.get("a", 0) == 0
    sink = transport.sink()
    from rft.schema import encode
    value, headers = encode(claim("a", 3, limit=8, seen=reading.seen, cid="late").to_message())
    sink.send(CONTROL, value, headers=headers, partition=0)
    feed.read()  # applies the late grant (3) and releases it at once
    feed.read()
    assert feed.ledger.outstanding["a"] == 0 and feed.ledger.released == 3
