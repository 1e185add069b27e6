"""torchrun worker for tests/distributed/test_algorithm_catalog.py: the trainer's loop (rft/trainer/main.py) with each
algorithm of ALGORITHMS in turn (jsd_distill with the model as its own teacher), in one process pair (data parallel
2, gloo, the real MegatronPolicy on the tiny model), 2 steps of 2 groups each from the in-memory transport.

Usage: torchrun --nproc-per-node 2 _worker_algorithm_catalog.py SPEC.json, with SPEC {"out_dir", "qwen"}. Each
algorithm's run directory is `<out>/<name>`, with its metrics.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TEACHER = "<model>"  # an option's value replaced by the model's path: the tiny model is its own teacher
# name -> its keys (the defaults otherwise); rec with a clip mode, a weight and a regulariser
ALGORITHMS = {"reinforce": {}, "sapo": {}, "topr": {}, "sppo": {"sppo_eps": 500.0}, "opmd": {}, "asymre": {},
              "rec": {"rec_clip_mode": "one_side", "rec_weight": "token_is", "rec_regularizer": "k2",
                      "rec_regularizer_coef": 0.1},
              "raft": {}, "remax": {}, "m2po": {}, "clip_b": {"entropy_clip_mu": 0.5},
              "clip_v": {"entropy_clip_mu": 0.5, "entropy_clip_max_frac": 0.05},
              "jsd_distill": {"teacher_path": TEACHER, "distill_reward_coef": 1.0}, "gigpo": {}}
# sppo_eps 500: the recorded behaviour log-probs are random, so the ratios are far below 1 (the band [1 / 501, 501]);
# m2po then drops most of its trust region; clip_b / clip_v with a narrow mu, so that they drop some tokens;
# jsd_distill is its own teacher, so its first step learns from the rewards alone (distill_reward_coef 1)
GROUPS, REWARDS = 4, [1.0, 0.0, -0.5]
GREEDY_REWARD = {"remax": 0.25}  # the groups of an algorithm that subtracts the greedy response's reward carry one


def with_turns_and_a_failure(groups) -> None:
    """gigpo's groups: two turns per sample (3 response tokens each; the first from one shared state, the second
    from one of two), and the first group's last sample failed (a timeout: the feed leaves it out, counted)."""
    from rft.schema import Turn

    for g in groups:
        for j, sample in enumerate(g.samples):
            sample.turns = [Turn(0, 3, "start", 0.0), Turn(3, 6, f"cell{j % 2}", sample.reward)]
    groups[0].samples[-1].failure = "timeout"


def config(out: Path, model: str, name: str, options: dict):
    from rft.run.loading import run_config_from_dict

    return run_config_from_dict({
        "run": {"name": name, "mode": "train", "max_steps": 2, "output_dir": str(out), "groups_per_step": 2},
        "model": {"path": model},
        "kafka": {"bootstrap_servers": "memory"},
        "algorithm": {"name": name, **{k: model if v == TEACHER else v for k, v in options.items()}},
        "trainer": {"micro_batch_size": 2, "checkpoint_every": 2, "poll_timeout_s": 5.0, "data_parallel": 2,
                    "lr": 1e-2},
        "monitor": {"progress": False},
    }, f"{name}.yaml")


def train(out: Path, model: str, name: str, options: dict, *, last: bool) -> None:
    """Two steps of `name`; then its trainer's parts are closed, keeping the process group for the next algorithm's
    (one cannot be re-created under one torchrun rendezvous) unless this is the `last`."""
    from megatron_bridge import parallel
    from rft.trainer.main import Trainer, open_trainer_io
    from rft.transport.memory import MemoryTransport
    from rft.transport.run_topics import RunTopics, create_run_topics
    from tests.records import make_group, send_groups

    cfg = config(out, model, name, options)
    transport = MemoryTransport(partitions=1)
    if os.environ["RANK"] == "0":  # only rank 0 reads the experiences
        create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
        groups = [make_group(name, i, rewards=REWARDS) for i in range(GROUPS)]
        for g in groups:
            g.greedy_reward = GREEDY_REWARD.get(name)
        if name == "gigpo":
            with_turns_and_a_failure(groups)
        send_groups(transport.sink(), cfg.topic("experiences"), groups)
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False,
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    trainer.run()
    if last:
        trainer.close()
        return
    trainer.weights.close()
    if trainer.io is not None:
        trainer.io.close()
    parallel.destroy(keep_process_group=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for k, (name, options) in enumerate(ALGORITHMS.items()):
        train(Path(spec["out_dir"]), spec["qwen"], name, options, last=k == len(ALGORITHMS) - 1)


if __name__ == "__main__":
    main()
