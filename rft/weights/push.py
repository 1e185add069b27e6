"""The push path of weight synchronisation: one torch.distributed process group (gloo on CPU, NCCL on GPU)
between the trainer's publishing rank and the workers of a fixed fleet of explorer engines.

The group is not the trainer's own world: it is built from a TCPStore that the publishing rank hosts,
so it lives beside torchrun's group and never touches it. Rank 0 is the trainer; each engine worker
takes the next rank from a counter in the store (ranks 1..world_size-1, world_size = 1 + explorers x
engine TP size). Every message is a broadcast from rank 0 of plain tensors (no pickle):

    header   int64[1]  the version
    per bucket (streamed as the trainer gathers them; one bucket in memory at a time):
      int64[1]         length of the manifest (0: no more buckets)
      uint8[length]    manifest: JSON list of [name, dtype, shape], in payload order (HF names)
      uint8[bytes]     payload: the bucket's tensors' bytes, concatenated
    ack      int64[1]  all_reduce(sum): each receiver adds 1 if it loaded the whole version, else 0

`send` returns only after the ack, so when it returns every member holds the version: the sender may
then reuse or overwrite the buffers (next optimizer step), and receivers resume generating with it.
Any failure or an ack below world_size - 1 raises PushError on the sender; the group is then unusable
and the caller falls back to the pull path (rft.weights.publisher.WeightPublisher).
"""
from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from rft.control import ControlError, PushGroup

log = logging.getLogger(__name__)

RANK_COUNTER = "rft/push/next_rank"
JOINED_COUNTER = "rft/push/joined"


class PushError(RuntimeError):
    pass


@dataclass(frozen=True)
class PushGroupSpec(PushGroup):
    """What a member needs to join: it is the `push_group` control message (rft.control.PushGroup)."""

    def to_json(self) -> dict:
        return self.body()

    @classmethod
    def from_json(cls, body: dict) -> "PushGroupSpec":
        try:
            return cls.from_body(body)
        except ControlError as e:
            raise PushError(f"malformed push_group announcement {body!r}: {e}") from None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _process_group(store, rank: int, spec: PushGroupSpec):
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "nccl":  # GPU: only here, never on the CPU path
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, spec.world_size, options)
    return torch.distributed.ProcessGroupGloo(store, rank, spec.world_size, timeout)


class _Member:
    """A rank of the push group: the broadcasts both sides take part in."""

    def __init__(self, spec: PushGroupSpec, store, rank: int):
        self.spec, self.store, self.rank = spec, store, rank
        self.device = _device(spec.backend)
        self.group = None

    def connect(self) -> None:
        self.group = _process_group(self.store, self.rank, self.spec)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor

    def _ack(self, ok: bool) -> int:
        flag = torch.tensor([1 if ok and self.rank else 0], dtype=torch.int64, device=self.device)
        self.group.allreduce([flag], torch.distributed.AllreduceOptions()).wait()
        return int(flag.item())

    def close(self) -> None:
        self.group = None
        self.store = None


class PushSender(_Member):
    """Rank 0, in the trainer's publishing process."""

    def __init__(self, spec: PushGroupSpec, store):
        super().__init__(spec, store, 0)

    @classmethod
    def host(cls, *, host: str, world_size: int, group_id: str, timeout_s: float,
             backend: str | None = None, port: int = 0) -> "PushSender":
        """Start the group's TCPStore on `host` (`port` 0: a free one). Members join later."""
        if world_size < 2:
            raise PushError(f"a push group needs at least one explorer engine (world size {world_size})")
        store = torch.distributed.TCPStore(host, port, world_size, is_master=True,
                                           timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        spec = PushGroupSpec(group_id=group_id, host=host, port=store.port, world_size=world_size,
                             backend=backend or default_backend(), timeout_s=timeout_s)
        return cls(spec, store)

    def members_joined(self) -> int:
        return int(self.store.add(JOINED_COUNTER, 0))

    def send(self, version: int, buckets: Iterable[dict[str, torch.Tensor]]) -> float:
        """Broadcast one version (see the module docstring); returns the bytes sent. Raises PushError."""
        if self.group is None:
            raise PushError("the push group is not connected")
        try:
            self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
            sent = sum(self._send_bucket(bucket) for bucket in buckets if bucket)
            self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
            acks = self._ack(True)
        except RuntimeError as e:  # gloo / NCCL report timeouts and lost peers as RuntimeError
            raise PushError(f"pushing version {version} failed: {e}") from e
        if acks != self.spec.world_size - 1:
            raise PushError(f"version {version}: {acks} of {self.spec.world_size - 1} members loaded it")
        return sent

    def _send_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        tensors = [t.detach().contiguous() for t in bucket.values()]
        manifest = json.dumps([[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                               for name, t in zip(bucket, tensors)]).encode()
        self._broadcast(torch.tensor([len(manifest)], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(self.device))
        payload = torch.cat([t.reshape(-1).view(torch.uint8).to(self.device) for t in tensors])
        self._broadcast(payload)
        return payload.numel()


class PushReceiver(_Member):
    """One engine worker's membership. Construct, then `connect()` (blocks until the whole group is in)."""

    @classmethod
    def join(cls, spec: PushGroupSpec) -> "PushReceiver":
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
        """(version, tensors): the iterator must be drained, then `finish(ok)` called."""
        version = int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))[0])
        return version, self._tensors()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while length := int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))[0]):
            raw = self._broadcast(torch.empty(length, dtype=torch.uint8, device=self.device))
            manifest = json.loads(bytes(raw.cpu().numpy()))
            sizes = [_nbytes(dtype, shape) for _, dtype, shape in manifest]
            payload = self._broadcast(torch.empty(sum(sizes), dtype=torch.uint8, device=self.device))
            offset = 0
            for (name, dtype, shape), size in zip(manifest, sizes):
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
    A failing `load` still drains the version (the group's later broadcasts stay aligned) and acks 0."""
    version, tensors = receiver.receive()
    try:
        load(tensors)
    except Exception:
        for _ in tensors:
            pass
        receiver.finish(False)
        raise
    receiver.finish(True)
    return version
