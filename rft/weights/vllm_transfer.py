"""The push path over vLLM's own weight transfer (`vllm.distributed.weight_transfer`, NCCL backend), for GPU fleets.

Not exercised without a GPU: the NCCL data plane and an engine built with `weight_transfer_config`.

Selection (`push_transport`): `sync.method: push` + CUDA + `explorer.engine: vllm` uses this transport
(`sync.push_transport: auto`); `rft` forces rft's own broadcast (rft.weights.push); `vllm` demands this one and
fails naming what is missing. The trainer announces the choice in `PushGroup.backend` (`vllm-nccl`); an explorer
that cannot follow refuses to join, so the group does not form and everyone falls back to pull.

Control protocol, through the TCPStore, JSON values (no pickle). Rank 0 is the trainer; each engine reserves
`workers` (its TP x PP) consecutive ranks, adds them to the joined count, reads INIT_KEY and calls
`LLM.init_weight_transfer_engine`. The group's n-th push (n = 0, 1, ...) uses keys `rft/push/vllm/<n>/`:
`version` (set by the trainer), `ready` (each engine adds `workers` before receiving), `b<i>` (the trainer's
`update_info(bucket)` for bucket i; null after the last; {"abort": reason} to give up), `b<i>.got` (engines add
`workers` once bucket i is loaded; the trainer waits before bucket i+1), `ok` (after `finish_weight_update`; `send`
returns when all did), `failed` (an engine's reason: the trainer raises PushError). An engine receives a version as
one vLLM update session (`start_weight_update`, one `update_weights` per bucket, `finish_weight_update`).
Limit: vLLM's PyNcclCommunicator has no timeout; the trainer gives up after `sync.timeout_s`, but a receiver dying
mid-bucket leaves that helper thread stuck on the trainer's GPU until the process exits.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from rft.config import ConfigError
from rft.processes import free_port
from rft.weights.push import JOINED_COUNTER, RANK_COUNTER, PushError, PushGroupSpec, PushSender

if TYPE_CHECKING:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    from rft.explorer.config import ExplorerConfig
    from rft.weights.config import SyncConfig

log = logging.getLogger(__name__)

BACKEND = "vllm-nccl"  # PushGroup.backend of a group that uses this transport
INIT_KEY = "rft/push/vllm/init"
VLLM_BACKEND = "nccl"  # vLLM's WeightTransferConfig.backend on the explorer's engine
PACKED_BUFFER_BYTES = 1 << 30  # vLLM's packed broadcast: bytes per NCCL call (DEFAULT_PACKED_BUFFER_SIZE_BYTES)
PACKED_BUFFERS = 2  # ... and buffers in flight (DEFAULT_PACKED_NUM_BUFFERS); both sent to the workers at init
POLL_S = 0.005


# --------------------------------------------------------------------------------------------------
# Selection


def push_transport(sync: SyncConfig, explorer: ExplorerConfig, *, cuda: bool | None = None,
                   lora: bool = False) -> str:
    """Which push transport a run uses: "vllm" (this module) or "rft" (rft.weights.push); "rft" too when
    `sync.method` is not push (nothing is pushed), and for LoRA adapters (`lora`: vLLM's transfer loads whole
    models). `cuda`: whether CUDA is usable here (default: ask torch). Raises ConfigError naming the key when
    `sync.push_transport: vllm` is impossible."""
    if sync.method != "push" or sync.push_transport == "rft" or (lora and sync.push_transport == "auto"):
        return "rft"
    if cuda is None:
        cuda = torch.cuda.is_available()
    possible = cuda and explorer.engine == "vllm"
    if sync.push_transport == "vllm" and not possible:
        missing = "CUDA (torch.cuda.is_available() is False here)" if not cuda else \
            f"explorer.engine vllm (it is {explorer.engine})"
        raise ConfigError(f"sync.push_transport: vllm (vLLM's NCCL weight transfer) needs {missing}; "
                          "use auto or rft")
    return "vllm" if possible else "rft"


# --------------------------------------------------------------------------------------------------
# The mapping from rft buckets to vLLM's update_weights arguments


def dtype_name(dtype: torch.dtype) -> str:
    """The name vLLM's workers resolve with `getattr(torch, name)`: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def update_info(bucket: Mapping[str, torch.Tensor]) -> dict:
    """vLLM's NCCL `update_info` for one rft bucket (HF names -> tensors, in broadcast order): the `names`,
    `dtype_names` and `shapes` fields of `NCCLWeightTransferUpdateInfo`. The workers size and split the packed
    broadcast from exactly this, so it must list the tensors in the order they are sent."""
    return {"names": list(bucket), "dtype_names": [dtype_name(t.dtype) for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()]}


def worker_init_info(init: dict, *, rank_offset: int) -> dict:
    """The `init_info` of `LLM.init_weight_transfer_engine` (vLLM's NCCLWeightTransferInitInfo fields) for an engine
    whose first worker is rank `rank_offset`, from the trainer's INIT_KEY record."""
    return {"master_address": init["master_address"], "master_port": int(init["master_port"]),
            "rank_offset": rank_offset, "world_size": int(init["world_size"]), "packed": True,
            "packed_buffer_size_bytes": int(init["packed_buffer_size_bytes"]),
            "packed_num_buffers": int(init["packed_num_buffers"])}


class _Keys:
    """The TCPStore keys of the n-th version pushed in a group (module docstring)."""

    def __init__(self, n: int):
        self.prefix = f"rft/push/vllm/{n}/"
        self.version, self.ready, self.ok, self.failed = (self.prefix + k for k in ("version", "ready", "ok", "failed"))

    def bucket(self, i: int) -> str:
        return f"{self.prefix}b{i}"

    def got(self, i: int) -> str:
        return f"{self.prefix}b{i}.got"


# --------------------------------------------------------------------------------------------------
# Trainer side


class DataPlane(Protocol):
    """How VLLMSender's buckets travel once the engines joined: vLLM's NCCL group (NcclDataPlane) or a test's
    stand-in, built from the INIT_KEY record."""

    def open(self) -> None: ...
    def broadcast(self, bucket: Mapping[str, torch.Tensor]) -> None: ...
    def close(self) -> None: ...


class NcclDataPlane:
    """Rank 0 of vLLM's NCCL weight-transfer group: opened by `open`, one packed broadcast per bucket. GPU only."""

    def __init__(self, init: dict):
        self.init = init
        self.group: PyNcclCommunicator | None = None
        self.device = torch.device("cuda", torch.cuda.current_device())

    def open(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({k: self.init[k] for k in ("master_address", "master_port", "world_size")})

    def broadcast(self, bucket: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        torch.cuda.set_device(self.device)  # the current device is per thread; this runs in a helper thread
        packed_nccl_broadcast_producer(iter(bucket.items()), self.group, 0,
                                       post_iter_func=lambda item: item[1].detach().to(self.device),
                                       buffer_size_bytes=self.init["packed_buffer_size_bytes"],
                                       num_buffers=self.init["packed_num_buffers"])

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.destroy()
            except Exception as e:  # an abandoned communicator may be unusable; closing must not raise
                log.warning("closing vLLM's weight-transfer NCCL group: %s", e)


class VLLMSender(PushSender):
    """The push group's rank 0 when the explorers are vLLM engines on CUDA (publisher.Sender). `host` is
    PushSender.host (same arguments; `backend` is always BACKEND) and also picks the port of vLLM's NCCL rendezvous
    on the same host and records it, with the packed-broadcast geometry, under INIT_KEY. `data_plane`: how the
    NCCL group is made from that record (default NcclDataPlane; tests pass a stand-in, see the module docstring)."""

    data_plane_cls: Callable[[dict], DataPlane] = NcclDataPlane

    def __init__(self, spec: PushGroupSpec, store):
        super().__init__(spec, store)
        self.init = {"master_address": spec.host, "master_port": free_port(spec.host), "world_size": spec.world_size,
                     "packed_buffer_size_bytes": PACKED_BUFFER_BYTES, "packed_num_buffers": PACKED_BUFFERS}
        self.store.set(INIT_KEY, json.dumps(self.init))
        self.pushed = 0  # versions pushed in this group
        self.plane: DataPlane | None = None

    @classmethod
    def host(cls, *, host: str, world_size: int, group_id: str, timeout_s: float,
             backend: str | None = None, port: int = 0) -> VLLMSender:
        return super().host(host=host, world_size=world_size, group_id=group_id, timeout_s=timeout_s,
                            backend=BACKEND, port=port)

    def connect(self) -> None:
        """Open rank 0 of vLLM's NCCL group; returns when every engine worker is in (they block in
        `init_weight_transfer_engine` until then)."""
        self.plane = self.data_plane_cls(self.init)
        self.plane.open()

    def send(self, version: int, buckets: Iterable[dict[str, torch.Tensor]]) -> float:
        """Push one version (module docstring: control protocol); returns the bytes sent once every engine
        finished its update session. Raises PushError (the group is then unusable; the caller falls back to pull)."""
        if self.plane is None:
            raise PushError("the push group is not connected")
        keys, members = _Keys(self.pushed), self.spec.world_size - 1
        self.pushed += 1
        sent, index = 0, 0
        try:
            self.store.set(keys.version, str(version))
            self._wait_count(keys.ready, members, keys, f"version {version}: explorer engines ready to receive")
            for bucket in buckets:
                if not bucket:
                    continue
                self.store.set(keys.bucket(index), json.dumps(update_info(bucket)))
                index += 1
                self._broadcast_bucket(bucket, f"version {version}, bucket {index - 1}")
                sent += sum(t.numel() * t.element_size() for t in bucket.values())
                self._wait_count(keys.got(index - 1), members, keys, f"version {version}: bucket {index - 1} loaded")
            self.store.set(keys.bucket(index), "null")
            index += 1
            self._wait_count(keys.ok, members, keys, f"version {version}: update finished")
        except (PushError, RuntimeError, ValueError) as e:
            try:  # receivers waiting for the next bucket stop instead of timing out
                self.store.set(keys.bucket(index), json.dumps({"abort": str(e)[:500]}))
            except RuntimeError:
                pass
            raise e if isinstance(e, PushError) else PushError(f"pushing version {version} failed: {e}") from e
        return sent

    def _broadcast_bucket(self, bucket: Mapping[str, torch.Tensor], what: str) -> None:
        """The NCCL broadcast has no timeout of its own: run it aside and wait at most sync.timeout_s."""
        error: list[BaseException] = []
        plane = self.plane
        assert plane is not None  # `send` checked it

        def run() -> None:
            try:
                plane.broadcast(bucket)
            except BaseException as e:  # handed to the sending thread below
                error.append(e)

        thread = threading.Thread(target=run, name="rft-vllm-broadcast", daemon=True)
        thread.start()
        thread.join(self.spec.timeout_s)
        if thread.is_alive():
            raise PushError(f"{what}: the broadcast did not finish within sync.timeout_s={self.spec.timeout_s:g} "
                            "(an explorer engine is gone)")
        if error:
            raise PushError(f"{what}: broadcast failed: {error[0]}") from error[0]

    def _wait_count(self, key: str, target: int, keys: _Keys, what: str) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        while int(self.store.add(key, 0)) < target:
            if self.store.check([keys.failed]):
                raise PushError(f"{what}: an explorer engine failed: {self.store.get(keys.failed).decode()}")
            if time.monotonic() > deadline:
                raise PushError(f"{what}: only {int(self.store.add(key, 0))} of {target} engine workers within "
                                f"sync.timeout_s={self.spec.timeout_s:g}")
            time.sleep(POLL_S)

    def close(self) -> None:
        plane = getattr(self, "plane", None)
        if plane is not None:
            plane.close()
            self.plane = None
        super().close()


# --------------------------------------------------------------------------------------------------
# Explorer side


class VLLMReceiver:
    """One vLLM engine's membership of a BACKEND push group, driven from the explorer process through the `LLM`'s
    weight-transfer entry points (its workers do the NCCL part). `llm` is a vllm.LLM built with
    `weight_transfer_config` (rft.engine: VLLMEngine(weight_transfer=True))."""

    def __init__(self, llm, spec: PushGroupSpec, store, *, rank_offset: int, workers: int):
        self.llm, self.spec, self.store = llm, spec, store
        self.rank_offset, self.workers = rank_offset, workers
        self.received = 0

    @classmethod
    def join(cls, llm, spec: dict, *, cuda: bool | None = None) -> VLLMReceiver:
        """Join the announced group (blocks until the whole fleet is in). PushError when this engine cannot."""
        import datetime

        group = PushGroupSpec.from_json(spec)
        if group.backend != BACKEND:
            raise PushError(f"push group {group.group_id} uses {group.backend!r}, not vLLM's weight transfer")
        if not (torch.cuda.is_available() if cuda is None else cuda):
            raise PushError(f"push group {group.group_id} uses vLLM's NCCL weight transfer, but this explorer has no "
                            "CUDA (set sync.push_transport: rft for the gloo broadcast)")
        if getattr(llm.llm_engine.vllm_config, "weight_transfer_config", None) is None:
            raise PushError("this vLLM engine was built without weight_transfer_config; build it with "
                            "VLLMEngine(weight_transfer=True) (rft explorer does so when sync.push_transport selects "
                            "vllm)")
        workers = int(llm.get_world_size(include_dp=False))
        store = torch.distributed.TCPStore(group.host, group.port, group.world_size, is_master=False,
                                           timeout=datetime.timedelta(seconds=group.timeout_s))
        last = int(store.add(RANK_COUNTER, workers))
        if last >= group.world_size:
            raise PushError(f"push group {group.group_id} is full ({group.world_size - 1} workers): this engine's "
                            f"{workers} were not counted in explorer.replicas x explorer.tensor_parallel_size")
        store.add(JOINED_COUNTER, workers)
        member = cls(llm, group, store, rank_offset=last - workers + 1, workers=workers)
        init = json.loads(store.get(INIT_KEY))
        llm.init_weight_transfer_engine({"init_info": worker_init_info(init, rank_offset=member.rank_offset)})
        return member

    def receive(self) -> int:
        """Take part in the next pushed version as one vLLM update session; returns its version. On failure the
        trainer is told (`failed`) and the error raised: the caller leaves the group (PushMembership)."""
        keys = _Keys(self.received)
        self.received += 1
        version = int(self.store.get(keys.version))
        self.store.add(keys.ready, self.workers)
        started = False
        try:
            self.llm.start_weight_update()
            started = True
            index = 0
            while (info := json.loads(self.store.get(keys.bucket(index)))) is not None:
                if "abort" in info:
                    raise PushError(f"the trainer gave version {version} up: {info['abort']}")
                self.llm.update_weights({"update_info": info})
                self.store.add(keys.got(index), self.workers)
                index += 1
            started = False
            self.llm.finish_weight_update()
        except Exception as e:
            try:
                self.store.set(keys.failed, f"engine at rank {self.rank_offset}: {e}"[:500])
                if started:
                    self.llm.finish_weight_update()  # end the session; the caller leaves the group and pulls
            except Exception:
                pass
            raise
        self.store.add(keys.ok, self.workers)
        return version

    def close(self) -> None:
        try:
            self.llm.shutdown_weight_transfer_engine()
        except Exception as e:  # leaving must not fail (the group may already be broken)
            log.warning("shutting vLLM's weight transfer down: %s", e)
        self.store = None
