"""rft/explorer/pipeline.py `Offsets`: with tasks finishing out of order, a partition is committed only up to its
lowest unfinished task; checked against a brute-force reference over random finishing orders."""
from __future__ import annotations

import random

from rft.explorer.pipeline import Offsets


def reference(started: dict[str, list[int]], done: set[tuple[str, int]]) -> dict[str, int]:
    """Per partition: the longest prefix of started offsets that are all done, as the next offset to commit."""
    out = {}
    for position, offsets in started.items():
        k = 0
        while k < len(offsets) and (position, offsets[k]) in done:
            k += 1
        if k:
            out[position] = offsets[k - 1] + 1
    return out


def test_commit_stops_below_the_lowest_unfinished_task():
    offsets = Offsets()
    for o in (10, 11, 12):
        offsets.start("t:0", o)
    offsets.done("t:0", 12)
    assert offsets.committable() == {}  # 10 and 11 are still in flight
    offsets.done("t:0", 10)
    assert offsets.committable() == {"t:0": 11}
    offsets.committed({"t:0": 11})
    assert offsets.committable() == {}  # nothing new
    offsets.done("t:0", 11)
    assert offsets.committable() == {"t:0": 13} and offsets.unfinished() == 0
    offsets.forget({"t:0"})
    offsets.done("t:0", 13)  # a forgotten partition's late finish commits nothing
    assert offsets.committable() == {}


def test_random_finishing_orders_match_the_reference():
    rng = random.Random(0)
    for _ in range(200):
        offsets, started, done, committed = Offsets(), {}, set(), {}
        pending = []
        for position in ("t:0", "t:1", "t:2"):
            first = rng.randrange(5)
            started[position] = list(range(first, first + rng.randrange(1, 8)))
            for o in started[position]:
                offsets.start(position, o)
                pending.append((position, o))
        rng.shuffle(pending)
        for position, o in pending:
            offsets.done(position, o)
            done.add((position, o))
            expected = {p: v for p, v in reference(started, done).items() if v > committed.get(p, -1)}
            assert offsets.committable() == expected
            if rng.random() < 0.5:
                offsets.committed(expected)
                committed.update(expected)
        assert offsets.unfinished() == 0
