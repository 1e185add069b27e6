"""The push path's wire protocol (rft.weights.push) over a real gloo group on TCP loopback: rank 0 in this thread,
each member in its own thread (each with its own TCPStore client and gloo pairs, as separate processes would have).
Bit-exact delivery of mixed dtypes, the ack, and the failures the coordinator falls back on, each within the
push's deadline on both sides (the deadline code is the same on NCCL; only a GPU run shows NCCL's own behaviour)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rft.weights.push import PushError, PushGroupSpec, PushReceiver, PushSender, backend_timeout_s, receive_into
from tests.waiting import wait_until


def versions_for(n: int) -> list[list[dict[str, torch.Tensor]]]:
    """n versions of two buckets: odd-sized float32, bfloat16 and int64 tensors (mixed alignment in one payload)."""
    g = torch.Generator().manual_seed(0)
    return [[{"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)},
             {"c.index": torch.arange(5, dtype=torch.int64) + v, "d.scale": torch.randn((), generator=g)}]
            for v in range(n)]


def start_members(sender: PushSender, count: int, body) -> list[threading.Thread]:
    """`count` member threads running body(receiver, index); the sender connects once all have joined."""
    threads = [threading.Thread(target=lambda i=i: body(PushReceiver.join(sender.spec), i)) for i in range(count)]
    for t in threads:
        t.start()
    wait_until(lambda: sender.members_joined() >= count, timeout=30, interval=0.02, what=f"{count} members to join")
    sender.connect()
    return threads


def test_every_member_receives_every_version_bit_exactly():
    versions = versions_for(2)
    sender = PushSender.host(host="127.0.0.1", world_size=3, group_id="g", timeout_s=30)
    received: dict[int, list] = {0: [], 1: []}

    def member(receiver: PushReceiver, i: int) -> None:
        for _ in versions:
            got = {}
            version = receive_into(receiver, lambda tensors, got=got: got.update((n, t.clone()) for n, t in tensors))
            received[i].append((version, got, receiver.rank))

    threads = start_members(sender, 2, member)
    sent = [sender.send(10 + v, buckets) for v, buckets in enumerate(versions)]
    for t in threads:
        t.join(timeout=30)
    assert sent == [sum(t.numel() * t.element_size() for b in buckets for t in b.values()) for buckets in versions]
    assert sorted(r[0][2] for r in received.values()) == [1, 2]  # ranks from the store's counter
    for i in (0, 1):
        assert [version for version, _, _ in received[i]] == [10, 11]
        for (_, got, _), buckets in zip(received[i], versions, strict=True):
            expected = {n: t for b in buckets for n, t in b.items()}
            assert list(got) == list(expected)
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
                assert torch.equal(got[name], tensor), name


def test_a_member_that_fails_to_load_makes_the_push_fail():
    sender = PushSender.host(host="127.0.0.1", world_size=3, group_id="g", timeout_s=30)
    errors = []

    def member(receiver: PushReceiver, i: int) -> None:
        def load(tensors):
            for _ in tensors:
                if i == 1:
                    raise ValueError("shape mismatch in the engine")
        try:
            receive_into(receiver, load)
        except ValueError as e:
            errors.append(str(e))

    threads = start_members(sender, 2, member)
    with pytest.raises(PushError, match="1 of 2 members loaded it"):
        sender.send(3, versions_for(1)[0])
    for t in threads:
        t.join(timeout=30)
    assert errors == ["shape mismatch in the engine"]


@pytest.mark.parametrize("fault", ["exits", "hangs"])
def test_a_member_that_stops_answering_fails_the_push_in_time(fault):
    """A member that joined and then never takes part fails the push instead of blocking the trainer: one that
    exits (an explorer killed between batches: its connections close) at once, one that hangs at the push's
    deadline (timeout_s), which the sender enforces itself: gloo's own timeout is set far later (and NCCL's
    watchdog would kill the process rather than raise)."""
    sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="g", timeout_s=2)
    assert backend_timeout_s(2) > 2 * 2
    released = threading.Event()  # a hanging member hangs until the push has failed
    threads = start_members(sender, 1, lambda receiver, i: fault == "hangs" and released.wait(30))
    try:
        started = time.monotonic()
        expected = "no answer within sync.timeout_s=2" if fault == "hangs" else "pushing version 1 failed"
        with pytest.raises(PushError, match=expected):
            sender.send(1, versions_for(1)[0])
        assert time.monotonic() - started < 4
    finally:
        released.set()
    for t in threads:
        t.join(timeout=10)


def test_a_receiver_whose_trainer_stalls_mid_version_gives_up_in_time():
    """The deadline on the receiver's side: the trainer stops sending in the middle of a version (its export
    stalls), and the explorer gives the group up after timeout_s instead of waiting for it; the trainer, once it
    goes on, finds the group gone."""
    sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="g", timeout_s=2)
    outcome: dict = {}

    def member(receiver: PushReceiver, i: int) -> None:
        started = time.monotonic()
        try:
            receive_into(receiver, lambda tensors: [None for _ in tensors])
        except PushError as e:
            outcome.update(error=str(e), seconds=time.monotonic() - started)

    threads = start_members(sender, 1, member)
    first, second = versions_for(1)[0]

    def stalled_export():
        yield first
        threads[0].join(timeout=10)  # the trainer's side stalls until the member has given up
        yield second

    with pytest.raises(PushError, match="pushing version 1 failed"):
        sender.send(1, stalled_export())
    assert "no answer within sync.timeout_s=2" in outcome["error"]
    assert outcome["seconds"] < 4


def test_a_full_group_refuses_one_more_member():
    sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="g", timeout_s=10)
    sender.store.add("rft/push/next_rank", 1)  # the one member's rank is taken
    with pytest.raises(PushError, match="full"):
        PushReceiver.join(sender.spec)


def test_a_malformed_announcement_names_what_is_missing():
    with pytest.raises(PushError, match="port"):
        PushGroupSpec.from_json({"group_id": "g", "host": "h", "world_size": 2, "backend": "gloo", "timeout_s": 1})
