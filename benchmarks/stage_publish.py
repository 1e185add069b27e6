"""Time weight publishing on the pull path through the trainer's own code (`WeightSync.publish`,
rft/trainer/weights.py), at PP=2.

Usage (CPU, gloo; 2 processes):
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/stage_publish.py MODEL_DIR OUT_DIR [--versions N] [--write-behind 0|1] [--pp 2] [--lora-rank R]

It builds a MegatronPolicy at PP=`--pp` (TP=1) from MODEL_DIR, a trainer over the in-memory transport, and
publishes N versions to the store `OUT_DIR/<run>/weights`. Per version, on every rank:
- critical_s: from a barrier before `trainer.weights.publish` to a barrier after it (what holds up the next step;
  with write-behind the store write goes on in the background);
- total_s: from that first barrier until every rank flushed (`trainer.weights.flush`) and met at a barrier: the
  version is stored and announced.
Rank 0 prints one JSON line: the median and every value of both, in seconds. The code measured is whatever the
checkout on PYTHONPATH has (a funnel through rank 0, or per-stage publishing), so one script times both.
`--lora-rank R` (> 0): the policy trains rank-R LoRA adapters on every target (alpha 2R) and each version is a PEFT
adapter (megatron_bridge.lora); `rft bench reload` then times an explorer loading the versions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from megatron_bridge.policy import MegatronPolicy
from rft.run.config import config_from_dict
from rft.trainer import distributed as dist_io
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import RunTopics, create_run_topics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--write-behind", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=0)
    args = parser.parse_args()
    cfg = config_from_dict({
        "run": {"name": f"bench-wb{args.write_behind}", "mode": "off_policy", "max_staleness": 1,
                "max_steps": args.versions, "output_dir": args.out_dir},
        "model": {"path": args.model_dir, "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}},
        "kafka": {"bootstrap_servers": "memory"},
        "trainer": {"pipeline_parallel": args.pp, "data_parallel": 1},
        "sync": {"write_behind": bool(args.write_behind), "bucket_mb": args.bucket_mb, "keep_versions": 2},
        "monitor": {"progress": False},
    })
    transport = MemoryTransport(partitions=1)
    if dist_io.rank() == 0:
        create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
    policy = MegatronPolicy(args.model_dir, pp=args.pp, lr=1e-5, lora=cfg.model.lora)
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=policy,
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    critical, total = [], []
    try:
        for version in range(args.versions):
            dist_io.barrier()
            started = time.perf_counter()
            trainer.weights.publish(version)
            dist_io.barrier()
            critical.append(time.perf_counter() - started)
            trainer.weights.flush()
            dist_io.barrier()
            total.append(time.perf_counter() - started)
        if dist_io.rank() == 0:
            stored = sum(f.stat().st_size for f in trainer.weights.store().path(args.versions - 1).glob("*"))
            print(json.dumps({"pp": args.pp, "lora_rank": args.lora_rank, "write_behind": args.write_behind,
                              "versions": args.versions,
                              "stored_mb": round(stored / 1e6, 1),
                              "critical_s_median": round(statistics.median(critical), 3),
                              "total_s_median": round(statistics.median(total), 3),
                              "critical_s": [round(x, 3) for x in critical],
                              "total_s": [round(x, 3) for x in total]}), flush=True)
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
