"""The push path over vLLM's weight transfer (rft.weights.vllm_transfer), everything of it that runs without a GPU:
the selection rule and its errors; the mapping from rft buckets to `update_weights` arguments, checked against
vLLM's own packer / unpacker and update-info class; the vLLM entry points and classes rft calls, with the signatures
it calls them with (so a vLLM upgrade that changes them fails here); and the control protocol over a real TCPStore.

Stand-ins, for what cannot be produced on CPU only: `WireDataPlane` replaces vLLM's NCCL group (PyNcclCommunicator
needs CUDA) by handing each bucket to the receivers in memory, and `EngineStandIn` replaces a CUDA vLLM `LLM`'s
weight-transfer entry points (the CPU build cannot build an NCCL weight-transfer engine), checking each bucket
against the update_info it was announced with, as vLLM's packed consumer relies on."""
from __future__ import annotations

import inspect
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rft.config import ConfigError
from rft.explorer.config import ExplorerConfig
from rft.weights.config import SyncConfig
from rft.weights.push import RANK_COUNTER, PushError
from rft.weights.vllm_transfer import (
    BACKEND,
    PACKED_BUFFER_BYTES,
    PACKED_BUFFERS,
    VLLM_BACKEND,
    VLLMReceiver,
    VLLMSender,
    push_transport,
    update_info,
    worker_init_info,
)

# ---------------------------------------------------------------------------------------------------------------
# Selection


@pytest.mark.parametrize("method, transport, engine, cuda, expected", [
    ("push", "auto", "vllm", True, "vllm"),
    ("push", "auto", "vllm", False, "rft"),
    ("push", "auto", "transformers", True, "rft"),
    ("push", "rft", "vllm", True, "rft"),
    ("push", "vllm", "vllm", True, "vllm"),
    ("pull", "vllm", "vllm", False, "rft"),  # nothing is pushed
])
def test_selection_rule(method, transport, engine, cuda, expected):
    assert push_transport(SyncConfig(method=method, push_transport=transport), ExplorerConfig(engine=engine),
                          cuda=cuda) == expected


@pytest.mark.parametrize("engine, cuda, message", [
    ("vllm", False, r"sync.push_transport: vllm .* needs CUDA \(torch.cuda.is_available\(\) is False here\)"),
    ("transformers", True, r"sync.push_transport: vllm .* needs explorer.engine vllm \(it is transformers\)"),
])
def test_asking_for_vllm_when_impossible_is_a_clear_error(engine, cuda, message):
    with pytest.raises(ConfigError, match=message):
        push_transport(SyncConfig(method="push", push_transport="vllm"), ExplorerConfig(engine=engine), cuda=cuda)


def test_transformers_engine_refuses_a_vllm_group():
    from rft.engine import EngineError, TransformersEngine

    engine = TransformersEngine.__new__(TransformersEngine)  # the check comes before anything the model provides
    with pytest.raises(EngineError, match="set sync.push_transport: rft"):
        engine.join_push_group({"backend": BACKEND})


# ---------------------------------------------------------------------------------------------------------------
# Buckets -> update_weights arguments


def bucket() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(6, generator=g),
            "model.embed_tokens.weight": torch.randn(3, 6, generator=g).to(torch.float16),
            "lm_head.scale": torch.randn((), generator=g)}


def test_update_info_names_dtypes_shapes():
    assert update_info(bucket()) == {
        "names": ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight",
                  "lm_head.scale"],
        "dtype_names": ["bfloat16", "float32", "float16", "float32"],
        "shapes": [[4, 6], [6], [3, 6], []]}


def test_update_info_is_what_vllms_packed_consumer_unpacks():
    """vLLM's producer packs the tensors; the consumer splits the bytes with sizes it computes from update_info
    (prod(shape) x dtype.itemsize, packed_tensor.packed_nccl_broadcast_consumer) and unpacks them."""
    import math

    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    sent = bucket()
    info = update_info(sent)
    NCCLWeightTransferUpdateInfo(**info)  # the worker parses it into this
    chunk = pack_tensors(iter(sent.items()), lambda item: item[1], PACKED_BUFFER_BYTES)
    dtypes = [getattr(torch, name) for name in info["dtype_names"]]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(info["shapes"], dtypes, strict=True)]
    assert sizes == chunk.tensor_sizes and sum(sizes) == chunk.packed_tensor.numel()
    received = dict(unpack_tensor(chunk.packed_tensor, info["names"], info["shapes"], dtypes, sizes))
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


# ---------------------------------------------------------------------------------------------------------------
# The vLLM API rft calls


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_vllm_entry_points_rft_calls_exist_with_these_signatures():
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, trainer_init
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
        packed_nccl_broadcast_producer,
    )
    from vllm.engine.arg_utils import EngineArgs

    # explorer side: VLLMReceiver drives these on the LLM
    assert parameters(LLM.init_weight_transfer_engine) == ["self", "request"]
    assert parameters(LLM.start_weight_update) == ["self"]
    assert parameters(LLM.update_weights) == ["self", "request"]
    assert parameters(LLM.finish_weight_update)[:1] == ["self"]
    assert parameters(LLM.shutdown_weight_transfer_engine) == ["self"]
    assert "include_dp" in parameters(LLM.get_world_size)
    # the engine is built with weight_transfer_config=WeightTransferConfig(backend=VLLM_BACKEND)
    assert "weight_transfer_config" in {f.name for f in __import__("dataclasses").fields(EngineArgs)}
    assert WeightTransferConfig(backend=VLLM_BACKEND).backend == VLLM_BACKEND
    assert WeightTransferEngineFactory.create_engine is not None and VLLM_BACKEND == "nccl"
    assert issubclass(NCCLWeightTransferEngine.init_info_cls, NCCLWeightTransferInitInfo)
    # the workers parse worker_init_info(...) into NCCLWeightTransferInitInfo
    init = {"master_address": "10.0.0.1", "master_port": 29511, "world_size": 5,
            "packed_buffer_size_bytes": PACKED_BUFFER_BYTES, "packed_num_buffers": PACKED_BUFFERS}
    parsed = NCCLWeightTransferInitInfo(**worker_init_info(init, rank_offset=3))
    assert (parsed.rank_offset, parsed.world_size, parsed.packed, parsed.master_port) == (3, 5, True, 29511)
    # trainer side: NcclDataPlane
    assert parameters(trainer_init)[:2] == ["init_info", "rank"]
    assert parameters(packed_nccl_broadcast_producer) == ["iterator", "group", "src", "post_iter_func",
                                                          "buffer_size_bytes", "num_buffers"]
    assert (PACKED_BUFFER_BYTES, PACKED_BUFFERS) == (DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS)


# ---------------------------------------------------------------------------------------------------------------
# The control protocol over a real TCPStore (stand-ins for NCCL and the CUDA engine: module docstring)


class WireDataPlane:
    """Stand-in for vLLM's NCCL group: `broadcast` hands copies of a bucket to every receiver's queue."""
    wires: list[queue.Queue] = []

    def __init__(self, init: dict):
        self.init = init

    def open(self) -> None:
        pass

    def broadcast(self, bucket) -> None:
        for wire in self.wires:
            wire.put({name: t.clone() for name, t in bucket.items()})

    def close(self) -> None:
        pass


class EngineStandIn:
    """Stand-in for a CUDA vLLM LLM's weight-transfer entry points (one worker). `fail_at`: the bucket whose
    update_weights raises."""

    def __init__(self, wire: queue.Queue, fail_at: int | None = None):
        self.wire, self.fail_at = wire, fail_at
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(weight_transfer_config=object()))
        self.init_info, self.loaded, self.calls, self.buckets = None, {}, [], 0

    def get_world_size(self, include_dp: bool = True) -> int:
        return 1

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.init_info = request["init_info"]

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, request: dict) -> None:
        info = request["update_info"]
        tensors = self.wire.get(timeout=10)
        if self.buckets == self.fail_at:
            raise RuntimeError("load_weights: unknown parameter")
        self.buckets += 1
        assert update_info(tensors) == info  # what vLLM's consumer sizes its receive buffers from
        self.loaded.update(tensors)
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append("shutdown")


class StandInSender(VLLMSender):
    data_plane_cls = WireDataPlane


def form_group(engines: list[EngineStandIn], timeout_s: float = 10) -> tuple[VLLMSender, list]:
    WireDataPlane.wires = [e.wire for e in engines]
    sender = StandInSender.host(host="127.0.0.1", world_size=1 + len(engines), group_id="g", timeout_s=timeout_s)
    receivers: list = [None] * len(engines)
    threads = [threading.Thread(target=lambda i=i: receivers.__setitem__(
        i, VLLMReceiver.join(engines[i], sender.spec.to_json(), cuda=True))) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sender.members_joined() == len(engines)
    sender.connect()
    return sender, receivers


def receive_all(receivers, versions: int, results: dict) -> list[threading.Thread]:
    def run(i):
        for _ in range(versions):
            try:
                results.setdefault(i, []).append(receivers[i].receive())
            except Exception as e:
                results.setdefault(i, []).append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    return threads


def test_every_engine_gets_every_version_as_one_update_session():
    engines = [EngineStandIn(queue.Queue()), EngineStandIn(queue.Queue())]
    sender, receivers = form_group(engines)
    assert sorted(r.rank_offset for r in receivers) == [1, 2]  # ranks reserved from the group's counter
    assert {e.init_info["world_size"] for e in engines} == {3}
    assert sorted(e.init_info["rank_offset"] for e in engines) == [1, 2]
    results: dict = {}
    threads = receive_all(receivers, 2, results)
    b = bucket()
    second = {"model.extra.weight": torch.arange(6, dtype=torch.int64)}
    sent = [sender.send(7, [b, {}, second]), sender.send(8, [b])]
    for t in threads:
        t.join(timeout=30)
    assert results == {0: [7, 8], 1: [7, 8]}
    assert sent[0] == sum(t.numel() * t.element_size() for t in [*b.values(), *second.values()])
    for e in engines:
        assert e.calls == ["start", "update", "update", "finish", "start", "update", "finish"]
        assert torch.equal(e.loaded["model.extra.weight"], second["model.extra.weight"])
    sender.close()


def test_an_engine_that_fails_to_load_makes_the_push_fail_and_stops_the_others():
    engines = [EngineStandIn(queue.Queue()), EngineStandIn(queue.Queue(), fail_at=0)]
    sender, receivers = form_group(engines)
    results: dict = {}
    threads = receive_all(receivers, 1, results)
    started = time.monotonic()
    with pytest.raises(PushError, match="an explorer engine failed: engine at rank .*unknown parameter"):
        sender.send(3, [bucket(), bucket()])
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - started < 5  # no waiting for the timeout
    assert isinstance(results[1][0], RuntimeError)
    assert isinstance(results[0][0], PushError) and "gave version 3 up" in str(results[0][0])
    assert engines[0].calls[-1] == "finish"  # the session is closed; the explorer then leaves and pulls
    sender.close()


def test_an_engine_that_never_comes_times_out():
    engines = [EngineStandIn(queue.Queue())]
    sender, _ = form_group(engines, timeout_s=0.5)
    with pytest.raises(PushError, match=r"ready to receive: only 0 of 1 engine workers within sync.timeout_s=0.5"):
        sender.send(1, [bucket()])
    sender.close()


def test_joining_refuses_what_cannot_work():
    sender = StandInSender.host(host="127.0.0.1", world_size=2, group_id="g", timeout_s=5)
    spec = sender.spec.to_json()
    with pytest.raises(PushError, match="this explorer has no CUDA"):
        VLLMReceiver.join(EngineStandIn(queue.Queue()), spec, cuda=False)
    plain = EngineStandIn(queue.Queue())
    plain.llm_engine.vllm_config.weight_transfer_config = None
    with pytest.raises(PushError, match="built without weight_transfer_config"):
        VLLMReceiver.join(plain, spec, cuda=True)
    with pytest.raises(PushError, match="not vLLM's weight transfer"):
        VLLMReceiver.join(EngineStandIn(queue.Queue()), {**spec, "backend": "gloo"}, cuda=True)
    sender.store.add(RANK_COUNTER, 1)  # the one slot is taken
    with pytest.raises(PushError, match="is full"):
        VLLMReceiver.join(EngineStandIn(queue.Queue()), spec, cuda=True)
    with pytest.raises(PushError, match="not connected"):
        sender.send(1, [bucket()])
    sender.close()
