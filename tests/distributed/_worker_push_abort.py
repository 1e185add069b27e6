"""torchrun worker for tests/distributed/test_push_abort.py: a two-rank trainer (gloo, PP=2) pushes two versions
to one explorer worker, a separate process that dies (SIGKILL) in the middle of the second.

Usage: torchrun --nproc-per-node 2 _worker_push_abort.py SPEC.json, SPEC = {"hf_dir", "out_dir", "bucket_bytes",
"timeout_s"}. Every rank runs the trainer's own `deliver_version` over the real bucket export
(megatron_bridge.export.iter_hf_buckets: stage 1's parameters reach rank 0 by point-to-point sends); rank 0 holds
the real WeightPublisher and push group and starts the explorer worker (`_worker_push_abort.py --receiver SPEC_JSON
OUT`). Rank 0 writes out_dir/result.json; the explorer writes out_dir/received.json before it dies. The assertions
are in the test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def explorer_worker(spec_json: str, out: str) -> None:
    """Join, receive and ack version 0, then die once the first tensor of the next version has arrived."""
    from rft.weights.push import PushGroupSpec, PushReceiver, receive_into

    receiver = PushReceiver.join(PushGroupSpec.from_json(json.loads(spec_json)))
    names: list[str] = []
    version = receive_into(receiver, lambda tensors: names.extend(name for name, _ in tensors))
    Path(out).write_text(json.dumps({"version": version, "tensors": len(names)}))
    _, tensors = receiver.receive()
    next(tensors)  # the push of the next version is under way
    os.kill(os.getpid(), signal.SIGKILL)


def trainer(spec: dict) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.export import iter_hf_buckets
    from megatron_bridge.model import build_model
    from rft.trainer.weights import deliver_buckets, deliver_version
    from rft.weights.config import SyncConfig
    from rft.weights.publisher import WeightPublisher
    from rft.weights.push import PushSender
    from rft.weights.store import WeightStore

    # the trainer group's own timeout bounds a hang (the failure this test guards against) to a minute
    where = parallel.initialize(tp=1, pp=2, timeout_minutes=1)
    models = build_model(spec["hf_dir"])
    out = Path(spec["out_dir"])
    deliver, publisher, explorer, announced = None, None, None, []
    if where.is_publisher:
        sync = SyncConfig(method="push", timeout_s=spec["timeout_s"], write_behind=False)
        sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="abort", timeout_s=sync.timeout_s)
        publisher = WeightPublisher(sync, store=WeightStore(out / "weights"), hf_dir=spec["hf_dir"], sender=sender,
                                    announce=lambda message: announced.append(type(message).__name__))
        explorer = subprocess.Popen([sys.executable, __file__, "--receiver", json.dumps(sender.spec.to_json()),
                                     str(out / "received.json")])

        def deliver(version, buckets):
            return publisher.deliver(version, buckets, offsets={})

    def attempt(version):
        return deliver_buckets(version, iter_hf_buckets(models, spec["bucket_bytes"]), deliver)

    started = time.monotonic()
    deliver_version(0, attempt)  # pushed
    deliver_version(1, attempt)  # the explorer dies during the push: every rank redoes it by pull
    seconds = time.monotonic() - started
    if where.is_publisher:
        result = {"seconds": seconds, "announced": announced, "method": publisher.method,
                  "stored": publisher.store.versions(), "explorer_exit": explorer.wait(timeout=30)}
        (out / "result.json").write_text(json.dumps(result))
    parallel.destroy()


if __name__ == "__main__":
    if sys.argv[1] == "--receiver":
        explorer_worker(sys.argv[2], sys.argv[3])
    else:
        trainer(json.loads(Path(sys.argv[1]).read_text()))
