"""torchrun worker for tests/distributed/test_plugin_algorithm.py: the trainer's loop (rft/trainer/main.py) with the
algorithm of _plugin_algorithm.py (named by import path), the real MegatronPolicy with its reference and teacher and
the real MegatronCritic (2 processes: data parallel 2), experiences and demonstrations from the in-memory transport.

Usage: torchrun --nproc-per-node 2 _worker_plugin_algorithm.py SPEC.json, with SPEC {"out_dir", "qwen"}. The config is
checked as a run loads it (`run_config_from_dict`: the plugin's options, the teacher's vocabulary); the trainer runs
2 steps of 2 groups and 1 demonstration each; the run directory is `<out>/run`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PLUGIN = "tests.distributed._plugin_algorithm:Plugin"
GROUPS, SAMPLES, DEMONSTRATIONS = 4, 3, 2


def config(out: Path, model: str):
    from rft.run.loading import run_config_from_dict

    return run_config_from_dict({
        "run": {"name": "run", "mode": "train", "max_steps": 2, "output_dir": str(out), "groups_per_step": 2},
        "model": {"path": model},
        "kafka": {"bootstrap_servers": "memory"},
        "algorithm": {"name": PLUGIN, "scale": 2.0, "teacher_path": model, "demonstrations_per_step": 1},
        "trainer": {"micro_batch_size": 2, "checkpoint_every": 2, "poll_timeout_s": 5.0, "data_parallel": 2,
                    "lr": 1e-2},
        "monitor": {"progress": False},
    }, "plugin.yaml")


def main() -> None:
    from rft.trainer.main import Trainer, open_trainer_io
    from rft.transport.memory import MemoryTransport
    from rft.transport.run_topics import RunTopics, create_run_topics
    from tests.records import make_group, send_groups

    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = config(Path(spec["out_dir"]), spec["qwen"])
    transport = MemoryTransport(partitions=1)
    if os.environ["RANK"] == "0":  # only rank 0 reads the experiences and the demonstrations
        create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
        send_groups(transport.sink(), cfg.topic("experiences"),
                    [make_group("run", i, n_samples=SAMPLES) for i in range(GROUPS)])
        transport.admin().create_topics([cfg.topic("demonstrations")])
        send_groups(transport.sink(), cfg.topic("demonstrations"),
                    [make_group("experts", 100 + i, n_samples=1) for i in range(DEMONSTRATIONS)])
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False,
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    trainer.run()
    trainer.close()


if __name__ == "__main__":
    main()
