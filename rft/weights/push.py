"""The push path of weight synchronisation: one torch.distributed process group (gloo on CPU, NCCL on GPU)
between the trainer's publishing rank and the workers of a fixed fleet of explorer engines.

The group is built from a TCPStore the publishing rank hosts, beside torchrun's world (never touching it). Rank 0
is the trainer; each engine worker takes the next rank from a counter in the store (world_size = 1 + explorers x
engine TP size). Every message is a broadcast from rank 0 of plain tensors (no pickle): the version (int64[1]);
per bucket, streamed one at a time: the manifest's length (int64[1], 0: no more buckets), the manifest (uint8,
JSON list of [HF name, dtype, shape] in payload order) and the payload (the tensors' bytes, concatenated); then an
ack all_reduce(sum) where each receiver adds 1 if it loaded the whole version.

Where it listens: the store on the group's host (`bound_store`); on gloo each member's socket on the group's host
(rank 0) or on the local end of the route to it (`_gloo_device`); NCCL's sockets follow NCCL_SOCKET_IFNAME for the
whole process (docs/security.md).

`send` returns only after the ack: every member then holds the version and the buffers may be reused. Any failure
or a short ack raises PushError on the sender; the group is then unusable and the caller falls back to pull.

Deadline and abort, on both sides: every collective is issued asynchronously and polled against `timeout_s`
(sync.timeout_s); on expiry, or a collective that completes with an error, the member aborts the group
(ncclCommAbort on NCCL) and raises PushError, so failure never depends on the backend raising. NCCL settings this
relies on: the push group is constructed with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (restored afterwards, so the
trainer's own groups keep the operator's setting) and TORCH_NCCL_BLOCKING_WAIT unset, with a backend timeout
(`backend_timeout_s`) beyond rft's deadline; the trainer's own group timeout must exceed sync.timeout_s.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rft.processes import listening_socket
from rft.transport.control import ControlError, PushGroup

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only (3.10 runs this module)

log = logging.getLogger(__name__)

RANK_COUNTER = "rft/push/next_rank"
JOINED_COUNTER = "rft/push/joined"


class PushError(RuntimeError):
    pass


@dataclass(frozen=True)
class PushGroupSpec(PushGroup):
    """What a member needs to join: it is the `push_group` control message (rft.transport.control.PushGroup)."""

    def to_json(self) -> dict:
        return self.body()

    @classmethod
    def from_json(cls, body: dict) -> PushGroupSpec:
        try:
            return cls.from_body(body)
        except ControlError as e:
            raise PushError(f"malformed push_group announcement {body!r}: {e}") from None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def backend_timeout_s(timeout_s: float) -> float:
    """The backend's own timeout for a group whose deadline is `timeout_s`: longer, so rft's deadline comes first."""
    return 2 * timeout_s + 30


# The push group's NCCL construction only: no watchdog error handling (it would kill the process), no blocking wait.
_NCCL_CONSTRUCTION_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0"}
_ENV_LOCK = threading.Lock()
_FIRST_POLL_S, _LAST_POLL_S = 50e-6, 0.01  # polling a Work: from 50 us, doubling, up to 10 ms


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """`values` set in os.environ for the block (read by a constructor in it), the previous values restored."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _process_group(store, rank: int, spec: PushGroupSpec):
    timeout = datetime.timedelta(seconds=backend_timeout_s(spec.timeout_s))
    if spec.backend == "nccl":  # GPU: only here, never on the CPU path
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING / _BLOCKING_WAIT in its constructor (torch 2.x,
        # ProcessGroupNCCL.cpp); only a GPU run can show the watchdog's behaviour, the CPU tests cover the gloo path.
        with _environment(_NCCL_CONSTRUCTION_ENV):
            group = torch.distributed.ProcessGroupNCCL(store, rank, spec.world_size, options)
        # create the communicator now, while every member is connecting, not in the first push
        group.eager_connect_single_device(_device(spec.backend))
        return group
    options = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch has no stub for it
    options._timeout, options._devices = timeout, [_gloo_device(spec, rank)]
    return torch.distributed.ProcessGroupGloo(store, rank, spec.world_size, options)


def _gloo_device(spec: PushGroupSpec, rank: int):
    """The gloo device of a member: the address its data-plane socket listens on. Rank 0 takes the group's host
    (sync.push_host, where its store listens); a receiver the local address its route to that host leaves from
    (loopback for a loopback host). Gloo's default device would take this host name's address instead, whatever
    sync.push_host says."""
    host = spec.host
    if rank:
        try:
            family, _, _, _, address = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)  # UDP: picks the route and its source address, sends nothing
                host = probe.getsockname()[0]
        except OSError as e:
            raise PushError(f"no route to the push group's host {spec.host!r}: {e.strerror or e}") from None
    return torch.distributed.ProcessGroupGloo.create_device(hostname=host)


def _release(group, in_flight, abort: bool) -> None:
    """Abort `group` if asked, wait until its operation `in_flight` (a Work, or None) has ended, then drop it. Runs
    in a daemon thread: a group's destructor waits for an operation in flight, and may hold the GIL while it does
    (gloo, torch 2.13), so the last reference must not go before the operation ends."""
    if abort:
        try:
            group.abort()
        except RuntimeError as e:
            log.warning("aborting the push group: %s", e)
    while in_flight is not None and not in_flight.is_completed():
        time.sleep(0.5)
    del group, in_flight


class _Member:
    """A rank of the push group: the collectives both sides take part in, each under the deadline."""

    def __init__(self, spec: PushGroupSpec, store, rank: int):
        self.spec, self.store, self.rank = spec, store, rank
        self.device = _device(spec.backend)
        self.group = None

    def connect(self) -> None:
        self.group = _process_group(self.store, self.rank, self.spec)

    def _wait(self, work, what: str) -> None:
        """Wait for `work` until the deadline (spec.timeout_s from now). PushError, after aborting the group, when
        it does not complete in time or completes with an error."""
        deadline = time.monotonic() + self.spec.timeout_s
        pause = _FIRST_POLL_S
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort(work)
                raise PushError(f"{what}: no answer within sync.timeout_s={self.spec.timeout_s:g} "
                                f"(rank {self.rank} of {self.spec.world_size}); the push group is aborted")
            time.sleep(pause)
            pause = min(2 * pause, _LAST_POLL_S)
        try:
            work.wait()  # raises the backend's error; on NCCL, orders the current stream after the collective
        except RuntimeError as e:
            self.abort(work)
            raise PushError(f"{what}: {e}") from e

    def _group(self):
        if self.group is None:
            raise PushError("the push group is not connected (or was aborted)")
        return self.group

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        self._wait(self._group().broadcast([tensor], options), "broadcast")
        return tensor

    def _ack(self, ok: bool) -> int:
        flag = torch.tensor([1 if ok and self.rank else 0], dtype=torch.int64, device=self.device)
        self._wait(self._group().allreduce([flag], torch.distributed.AllreduceOptions()), "ack")
        return int(flag.item())

    def abort(self, in_flight=None) -> None:
        """Give the group up at once, whatever is in flight (`in_flight`: the Work of the collective that failed).
        NCCL: the communicator is aborted (ncclCommAbort: its pending kernels end; GPU only, not exercised by the
        CPU tests). Gloo has no abort that cancels an operation in flight (ProcessGroupGloo.abort waits for it,
        torch 2.13): it ends at gloo's own timeout (backend_timeout_s) or when the peer goes. Either way in a
        background thread (`_release`), so this returns at once. Idempotent."""
        self._drop_group(in_flight, abort=self.spec.backend == "nccl")

    def close(self) -> None:
        self._drop_group(None, abort=False)
        self.store = None

    def _drop_group(self, in_flight, *, abort: bool) -> None:
        group, self.group = self.group, None
        if group is not None:
            threading.Thread(target=_release, args=(group, in_flight, abort), name="push-group-release",
                             daemon=True).start()


def bound_store(host: str, port: int, world_size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """A master TCPStore that listens on `host` alone. TCPStore(host, is_master=True) binds every interface whatever
    `host` says (torch 2.13: the name is only where clients connect); so the socket is bound and listening here
    (rft.processes.listening_socket), and handed over as `master_listen_fd` (libuv backend: the store takes the
    descriptor over and closes it). PushError naming the address when it cannot be bound."""
    try:
        listener = listening_socket(host, port)
    except OSError as e:
        raise PushError(f"the push group (sync.push_host / push_port): {e.strerror or e}") from None
    bound_port, fd = listener.getsockname()[1], listener.detach()
    try:
        return torch.distributed.TCPStore(host, bound_port, world_size, is_master=True,
                                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                          master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


class PushSender(_Member):
    """Rank 0, in the trainer's publishing process."""

    def __init__(self, spec: PushGroupSpec, store):
        super().__init__(spec, store, 0)

    @classmethod
    def host(cls, *, host: str, world_size: int, group_id: str, timeout_s: float,
             backend: str | None = None, port: int = 0) -> Self:
        """Start the group's TCPStore listening on `host` only (`port` 0: a free one). Members join later."""
        if world_size < 2:
            raise PushError(f"a push group needs at least one explorer engine (world size {world_size})")
        store = bound_store(host, port, world_size, timeout_s)
        spec = PushGroupSpec(group_id=group_id, host=host, port=store.port, world_size=world_size,
                             backend=backend or default_backend(), timeout_s=timeout_s)
        return cls(spec, store)

    def members_joined(self) -> int:
        return int(self.store.add(JOINED_COUNTER, 0))

    def send(self, version: int, buckets: Iterable[dict[str, torch.Tensor]]) -> float:
        """Broadcast one version (see the module docstring); returns the bytes sent. Raises PushError."""
        self._group()
        try:
            self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
            sent = sum(self._send_bucket(bucket) for bucket in buckets if bucket)
            self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
            acks = self._ack(True)
        except RuntimeError as e:  # PushError from the deadline or a lost peer; anything else torch raises
            self.abort()
            raise PushError(f"pushing version {version} failed: {e}") from e
        if acks != self.spec.world_size - 1:
            raise PushError(f"version {version}: {acks} of {self.spec.world_size - 1} members loaded it")
        return sent

    def _send_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        tensors = [t.detach().contiguous() for t in bucket.values()]
        manifest = json.dumps([[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                               for name, t in zip(bucket, tensors, strict=True)]).encode()
        self._broadcast(torch.tensor([len(manifest)], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(self.device))
        payload = torch.cat([t.reshape(-1).view(torch.uint8).to(self.device) for t in tensors])
        self._broadcast(payload)
        return payload.numel()


class PushReceiver(_Member):
    """One engine worker's membership. Construct, then `connect()` (blocks until the whole group is in)."""

    @classmethod
    def join(cls, spec: PushGroupSpec) -> PushReceiver:
        store = torch.distributed.TCPStore(spec.host, spec.port, spec.world_size, is_master=False,
                                           timeout=datetime.timedelta(seconds=spec.timeout_s))
        rank = int(store.add(RANK_COUNTER, 1))
        if rank >= spec.world_size:
            raise PushError(f"push group {spec.group_id} is full ({spec.world_size - 1} members): "
                            "this engine was not counted in explorer.replicas")
        store.add(JOINED_COUNTER, 1)
        member = cls(spec, store, rank)
        member.connect()
        return member

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(version, tensors): the iterator must be drained, then `finish(ok)` called. Every step of it waits at
        most sync.timeout_s for the trainer (the module's deadline): PushError, the group aborted, past it."""
        version = int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))[0])
        return version, self._tensors()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while length := int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))[0]):
            raw = self._broadcast(torch.empty(length, dtype=torch.uint8, device=self.device))
            manifest = json.loads(bytes(raw.cpu().numpy()))
            sizes = [_nbytes(dtype, shape) for _, dtype, shape in manifest]
            payload = self._broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=self.device))
            offset = 0
            for (name, dtype, shape), size in zip(manifest, sizes, strict=True):
                chunk = payload[offset:offset + size]
                offset += size
                yield name, _typed(chunk, getattr(torch, dtype)).reshape(shape)

    def finish(self, ok: bool) -> None:
        self._ack(ok)


def _typed(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret bytes as `dtype`; a chunk that is not aligned for it (mixed dtypes in a bucket) is copied."""
    if chunk.storage_offset() % dtype.itemsize:
        chunk = chunk.clone()
    return chunk.view(dtype)


def _nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * getattr(torch, dtype).itemsize


def receive_into(receiver: PushReceiver, load) -> int:
    """Receive one version and hand its tensor iterator to `load`; ack success or failure. Returns the version.
    A failing `load` still drains the version (the group's later broadcasts stay aligned) and acks 0. PushError
    when the group fails (a collective past its deadline, a lost peer): the group is then aborted."""
    version, tensors = receiver.receive()
    try:
        load(tensors)
    except PushError:  # the group itself failed (and is aborted): nothing more to take part in
        raise
    except Exception:
        for _ in tensors:
            pass
        receiver.finish(False)
        raise
    receiver.finish(True)
    return version
