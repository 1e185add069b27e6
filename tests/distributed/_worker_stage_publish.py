"""torchrun worker for tests/distributed/test_stage_publish.py: per-stage weight publishing at PP=2 through the
trainer's own code (`trainer.weights.publish`: rft.trainer.weights; a real MegatronPolicy, the in-memory transport on
rank 0).

Usage: torchrun --nproc-per-node 2 _worker_stage_publish.py SPEC.json, with SPEC {"out_dir", "cases": [{"name",
"hf_dir", "write_behind", optional "sync" (more sync keys: a bucket store) and "sparse"}]}. For every case, in one
process group: a PP=2 trainer publishes version 0 (the initial weights), then every parameter of every stage gets
+1.0 in place at once (the next optimizer step, possibly while version 0 is still being written behind; with
"sparse", only every 16th element of each parameter), then version 1 is published and flushed. The store is
`<out_dir>/<name>/weights`; rank 0 writes the control topic's `Weights` announcements, in order, to
`<out_dir>/<name>/announced.json`. The test compares the store with the HF checkpoint.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_bridge import parallel
from megatron_bridge.model import unwrap
from megatron_bridge.policy import MegatronPolicy
from rft.run.config import config_from_dict
from rft.trainer import distributed as dist_io
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport.control import Weights, control_messages, parse
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import RunTopics, create_run_topics
from tests.records import read_topic


def run_case(case: dict, out: Path) -> None:
    cfg = config_from_dict({
        "run": {"name": case["name"], "mode": "off_policy", "max_staleness": 1, "max_steps": 2,
                "output_dir": str(out)},
        "model": {"path": case["hf_dir"]},
        "kafka": {"bootstrap_servers": "memory"},
        "trainer": {"pipeline_parallel": 2, "data_parallel": 1},
        # several shards a stage
        "sync": {"write_behind": case["write_behind"], "bucket_mb": 1, **case.get("sync", {})},
        "monitor": {"progress": False},
    })
    transport = MemoryTransport(partitions=1)
    if dist_io.rank() == 0:
        create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
    policy = MegatronPolicy(case["hf_dir"], pp=2, lr=1e-3)
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=policy,
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    trainer.weights.publish(0)
    with torch.no_grad():
        for p in unwrap(policy.models[0]).parameters():
            (p.view(-1)[::16] if case.get("sparse") else p).add_(1.0)
    trainer.weights.publish(1)
    trainer.weights.flush()
    if trainer.io is not None:
        announced = [m for m in map(parse, control_messages(read_topic(transport, cfg.topic("control"))))
                     if isinstance(m, Weights)]
        (cfg.run_dir / "announced.json").write_text(json.dumps([[m.version, m.path] for m in announced]))
        trainer.io.close()
    trainer.weights.close()
    dist_io.barrier()
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for case in spec["cases"]:
        run_case(case, Path(spec["out_dir"]))
    parallel.destroy()


if __name__ == "__main__":
    main()
