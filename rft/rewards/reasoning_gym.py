"""reasoning-gym rewards: a reply scored by the reasoning-gym dataset's own `score_answer` on the task's entry.

The entry is rebuilt from the task's `metadata["reasoning_gym"]` spec (rft/data/gym_tasks.py), validated field
by field first; a task without a valid spec, or whose answer is not its entry's, raises `TaskError` (the workflow
sends it to the dead-letter topic). Two answer-extraction conventions, one reward each:

- `reasoning_gym`: the last number of the reply (`rft.rewards.text.last_number`). For numeric datasets
  (basic_arithmetic, chain_sum, leg_counting, gsm_symbolic, ...) with prompts that do not teach a format: an
  instruct model's natural "17 + 25 = 42." scores (docs/benchmarks.md: the initial signal).
- `reasoning_gym_tagged`: the content of the reply's last `<answer>...</answer>` block, for prompts that teach the
  tags (prompt_template); a reply without tags scores 0.

The score is `score_answer(extracted, entry)` clamped to [0, 1] (reasoning-gym's default gives partial credit
len(answer) / len(extracted) when the right answer is inside a longer extraction); nothing extracted scores 0.
Components: `extracted` (1 when an answer was found in the reply) and `correct` (1 when the score is 1).
"""
from __future__ import annotations

from rft.data.gym_tasks import GymError, GymSpec, gym_entry
from rft.rewards.registry import RewardResult, TaskError, register_reward
from rft.rewards.text import answer_tag_content, last_number
from rft.schema import TaskRecord

GYM_REWARDS = ("reasoning_gym", "reasoning_gym_tagged")  # the rewards that need reasoning_gym tasks


def score_gym(extracted: str | None, task: TaskRecord) -> RewardResult:
    """reasoning-gym's score of `extracted` on the task's entry; TaskError for a task without a valid spec."""
    try:
        dataset, entry = gym_entry(GymSpec.from_metadata(task.metadata))
    except GymError as e:
        raise TaskError(f"task {task.task_id!r}: {e}") from None
    if task.answer != entry["answer"]:
        raise TaskError(f"task {task.task_id!r}: its answer {task.answer!r} is not the answer of the reasoning_gym "
                        f"entry it names ({entry['answer']!r})")
    if extracted is None:
        return RewardResult(0.0, {"extracted": 0.0, "correct": 0.0})
    score = min(1.0, max(0.0, float(dataset.score_answer(extracted, entry))))
    return RewardResult(score, {"extracted": 1.0, "correct": float(score == 1.0)})


@register_reward("reasoning_gym")
def reasoning_gym_last_number(response: str, task: TaskRecord) -> RewardResult:
    """The dataset's score of the reply's last number (see the module docstring)."""
    return score_gym(last_number(response), task)


@register_reward("reasoning_gym_tagged")
def reasoning_gym_tagged(response: str, task: TaskRecord) -> RewardResult:
    """The dataset's score of the reply's last `<answer>` block; no block scores 0."""
    return score_gym(answer_tag_content(response), task)
