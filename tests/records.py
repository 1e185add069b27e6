"""Building real (randomly filled) records for tests: valid by construction, seeded."""
from __future__ import annotations

import numpy as np

from rft.schema import ExperienceGroup, Sample, group_id_for


def make_group(run_id: str, task: int, *, epoch: int = 0, n_samples: int = 4, policy_version: int = 0,
               prompt_len: int = 5, response_len: int = 6, seed: int | None = None, attempt: int = 0,
               explorer_id: str = "explorer-test") -> ExperienceGroup:
    rng = np.random.default_rng(task if seed is None else seed)
    task_id = f"task-{task}"
    samples = [Sample(sample_index=j,
                      prompt_tokens=rng.integers(3, 90, prompt_len),
                      response_tokens=rng.integers(3, 90, response_len),
                      logprobs=-rng.random(response_len).astype(np.float32) * 3,
                      loss_mask=np.ones(response_len, dtype=np.uint8),
                      reward=float(rng.random()), reward_components={"score": float(rng.random())})
               for j in range(n_samples)]
    return ExperienceGroup(run_id=run_id, task_id=task_id, group_id=group_id_for(run_id, task_id, epoch),
                           attempt=attempt, explorer_id=explorer_id, policy_version=policy_version, samples=samples)
