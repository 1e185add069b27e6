"""torchrun worker for tests/distributed/test_ppo_trainer.py: the trainer's loop (rft/trainer/main.py) with ppo, the
real MegatronPolicy and MegatronCritic (2 processes: data parallel 2), experiences from the in-memory transport.

Usage: torchrun --nproc-per-node 2 _worker_ppo_trainer.py SPEC.json, with SPEC {"out_dir", "qwen"}.
- straight: one trainer, 2 steps over groups 0-3 (2 groups a step, checkpoint every step).
- resumed: a trainer that stops after step 1 (its Kafka side closed, like a crash after the checkpoint), then a
  fresh trainer resumes from the step-1 checkpoint and runs step 2; `resumed.json` records the step and critic step
  count right after the resume.
After each: the critic's values and the policy's log-probs on _worker_policy.micro_batches(seed=1) ->
`<name>.values.safetensors`, `<name>.logprobs.safetensors` (rank 0); the run directories are `<out>/<name>`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import _worker_policy as cases  # noqa: E402

GROUPS, SAMPLES = 4, 3


def config(out: Path, model: str, max_steps: int):
    from rft.run.config import config_from_dict

    return config_from_dict({
        "run": {"name": "run", "mode": "train", "max_steps": max_steps, "output_dir": str(out), "groups_per_step": 2},
        "model": {"path": model},
        "kafka": {"bootstrap_servers": "memory"},
        "algorithm": {"name": "ppo", "critic_lr": 1e-3, "gamma": 0.99, "lam": 0.9, "value_clip": 0.1},
        "trainer": {"micro_batch_size": 2, "checkpoint_every": 1, "poll_timeout_s": 5.0, "data_parallel": 2,
                    "lr": 1e-4},
        "monitor": {"progress": False},
    })


def trainer_for(cfg, transport):
    from rft.trainer.main import Trainer, open_trainer_io

    return Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                   run_dir=cfg.run_dir, temperature=1.0, progress=False,
                   open_io=lambda feed_state, replay_state: open_trainer_io(
                       cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))


def filled_transport(cfg):
    from rft.transport.memory import MemoryTransport
    from rft.transport.run_topics import RunTopics, create_run_topics
    from tests.records import make_group, send_groups

    transport = MemoryTransport(partitions=1)
    if os.environ["RANK"] == "0":  # only rank 0 reads the experiences
        create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
        send_groups(transport.sink(), cfg.topic("experiences"),
                    [make_group("run", i, n_samples=SAMPLES) for i in range(GROUPS)])
    return transport


def record(trainer, out: Path, name: str) -> None:
    batches = cases.micro_batches(seed=1, vocab_size=trainer.policy.vocab_size)
    values, logprobs = trainer.critic.values(batches), trainer.policy.forward_logprobs(batches)
    cases.save_logprobs(values, out / f"{name}.values.safetensors")
    cases.save_logprobs(logprobs, out / f"{name}.logprobs.safetensors")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out, model = Path(spec["out_dir"]), spec["qwen"]

    cfg = config(out / "straight", model, max_steps=2)
    straight = trainer_for(cfg, filled_transport(cfg))
    straight.run()
    record(straight, out, "straight")
    if straight.io is not None:
        straight.io.close()

    first_cfg = config(out / "resumed", model, max_steps=1)
    transport = filled_transport(first_cfg)
    first = trainer_for(first_cfg, transport)
    first.run()
    if first.io is not None:
        first.io.close()
    resumed = trainer_for(config(out / "resumed", model, max_steps=2), transport)
    if torch.distributed.get_rank() == 0:
        (out / "resumed.json").write_text(json.dumps({"step": resumed.step, "critic_steps": resumed.critic.steps,
                                                      "policy_steps": resumed.policy.steps}))
    resumed.run()
    record(resumed, out, "resumed")
    resumed.close()


if __name__ == "__main__":
    main()
