"""torchrun worker for tests/distributed/test_teacher_logprobs.py: MegatronPolicy with a teacher model, 2 processes.

Usage: torchrun --nproc-per-node 2 _worker_teacher.py SPEC.json, with SPEC {"out_dir", "student", "other",
"wide"} (HF model directories: the student, another model of the same vocabulary, one of a different vocabulary).
Cases (micro-batches: _worker_policy.micro_batches(seed=1), behaviour log-probs = the policy's own, i.e. on-policy,
advantages 0), each one on_policy_distill step with lr 1e-3 through the trainer's loss wrapper:
- same (TP=2, teacher = the student's directory): teacher_logprobs and forward_logprobs -> `same.*.safetensors`,
  step metrics -> `same.metrics.json`;
- other (PP=2, teacher = `other`): the same files under `other.`;
- wide: building a policy whose teacher has another vocabulary; the error message -> `wide.error.txt`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402

LR = 1e-3


def run_case(spec: dict, *, name: str, teacher: str, tp: int, pp: int) -> None:
    from megatron_bridge import parallel
    from megatron_bridge.policy import MegatronPolicy
    from rft.algorithms import build_algorithm
    from rft.algorithms.aggregation import with_kl_metric
    from rft.algorithms.config import AlgorithmConfig

    out = Path(spec["out_dir"])
    algorithm = build_algorithm(AlgorithmConfig.of(name="on_policy_distill", teacher_path=spec[teacher]))
    policy = MegatronPolicy(spec["student"], tp=tp, pp=pp, seed=0, lr=LR, teacher=algorithm.needs.teacher)
    batches = cases.micro_batches(seed=1, vocab_size=policy.vocab_size)
    student = policy.forward_logprobs(batches)
    teacher_logprobs = policy.teacher_logprobs(batches)
    for mb, own, scored in zip(batches, student, teacher_logprobs, strict=True):
        mb.update(old_logprobs=own * mb["loss_mask"], teacher_logprobs=scored,
                  advantages=torch.zeros(mb["input_ids"].shape[0]))
    metrics = policy.train_step(batches, with_kl_metric(algorithm.loss_fn))
    cases.save_logprobs(student, out / f"{name}.student.safetensors")
    cases.save_logprobs(teacher_logprobs, out / f"{name}.teacher.safetensors")
    if torch.distributed.get_rank() == 0:
        (out / f"{name}.metrics.json").write_text(json.dumps(metrics))
    parallel.destroy(keep_process_group=True)


def main() -> None:
    from megatron_bridge.policy import MegatronPolicy

    spec = json.loads(Path(sys.argv[1]).read_text())
    run_case(spec, name="same", teacher="student", tp=2, pp=1)
    run_case(spec, name="other", teacher="other", tp=1, pp=2)
    try:
        MegatronPolicy(spec["student"], lr=LR, teacher=spec["wide"])
    except ValueError as e:
        if torch.distributed.get_rank() == 0:
            (Path(spec["out_dir"]) / "wide.error.txt").write_text(str(e))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
