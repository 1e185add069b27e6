"""Rubric as reward: a judge model checks a response against weighted criteria (RaR's explicit aggregation).

The rubric is the task's `metadata["rubric"]`, a list of `{"criterion": str, "weight": number}` (`description` is
accepted for `criterion`, as RaR-style data sets name it; weight defaults to 1), else `explorer.rubric_default`
(criterion -> weight). A task whose rubric is missing, empty, longer than `MAX_CRITERIA`, or has an item without
text or with a weight that is not a finite number (or all weights 0) raises `TaskError` (dead-letter topic).

One judge step per (response, criterion), batched over the group: the judge reads `explorer.rubric_template` and
its verdict c_j is P(yes) / (P(yes) + P(no)) of its next token (`rft.rewards.judge.YesNoJudge`, the `judge`
reward's constrained step: nothing is parsed, so no verdict is unparseable). The score is the weighted fraction of
criteria met, min-max normalised so that negative weights (pitfalls: meeting them costs) keep it in [0, 1]:

    score = (sum_j w_j c_j - sum_{w_j < 0} w_j) / sum_j |w_j|    (= sum_j w_j c_j / sum_j w_j when all w_j >= 0)

Components: `criterion.<j>` (c_j, in rubric order) and `judge_success` (0 when some verdict had no probability on
either token, i.e. the judge gave no verdict; that criterion counts as not met).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rft.rewards.judge import YesNoJudge, check_judge_model, check_template, judge_context_tokens, start_judge
from rft.rewards.registry import RewardError, RewardResult, TaskError, register_reward_factory

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.rewards.context import RewardContext
    from rft.schema import TaskRecord

MAX_CRITERIA = 64  # a task's rubric costs one judge step per criterion and response: bounded
FIELDS = ("prompt", "answer", "response", "criterion")


@dataclass(frozen=True)
class Criterion:
    text: str
    weight: float


def parse_rubric(raw: Any, *, where: str) -> list[Criterion]:
    """The criteria of a rubric read from a task or a config; ValueError naming `where` and the item if invalid."""
    if isinstance(raw, Mapping):
        raw = [{"criterion": k, "weight": v} for k, v in raw.items()]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: a rubric is a non-empty list of {{criterion, weight}} objects")
    if len(raw) > MAX_CRITERIA:
        raise ValueError(f"{where}: {len(raw)} criteria, over the limit of {MAX_CRITERIA}")
    criteria = []
    for j, item in enumerate(raw):
        text = item.get("criterion", item.get("description")) if isinstance(item, Mapping) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}[{j}]: needs a non-empty 'criterion' string")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{where}[{j}].weight: must be a finite number, got {weight!r}")
        criteria.append(Criterion(text, float(weight)))
    if not any(c.weight for c in criteria):
        raise ValueError(f"{where}: the weights must not all be 0")
    return criteria


def rubric_score(weights: Sequence[float], verdicts: Sequence[float]) -> float:
    """(sum w c - sum_{w<0} w) / sum |w|: the weighted fraction of criteria met, in [0, 1] for verdicts in [0, 1]."""
    total = sum(abs(w) for w in weights)
    low = sum(w for w in weights if w < 0)
    score = (sum(w * c for w, c in zip(weights, verdicts, strict=True)) - low) / total
    return min(max(score, 0.0), 1.0)


class RubricReward:
    """A `Reward` scoring each response by the judge's verdicts on the task's rubric (module docstring)."""

    def __init__(self, engine: Engine, *, template: str, yes: str, no: str, default: Mapping[str, float] | None = None,
                 max_prompt_tokens: int | None = None):
        self.template = template
        self.default = parse_rubric(dict(default), where="explorer.rubric_default") if default else None
        self.judge = YesNoJudge(engine, yes=yes, no=no, max_prompt_tokens=max_prompt_tokens)

    @staticmethod
    def check_config(explorer: ExplorerConfig) -> None:
        check_judge_model(explorer, "rubric")
        check_template(explorer.rubric_template, FIELDS, key="explorer.rubric_template")
        if explorer.rubric_default:
            try:
                parse_rubric(dict(explorer.rubric_default), where="explorer.rubric_default")
            except ValueError as e:
                raise RewardError(str(e)) from None

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> RubricReward:
        engine = start_judge(explorer, context, "rubric")
        assert context is not None  # start_judge checked
        return cls(engine, template=explorer.rubric_template, yes=explorer.judge_yes, no=explorer.judge_no,
                   default=explorer.rubric_default, max_prompt_tokens=judge_context_tokens(context))

    def rubric(self, task: TaskRecord) -> list[Criterion]:
        """The task's criteria (metadata, else the default); TaskError when it has none or they are invalid."""
        raw = task.metadata.get("rubric") if isinstance(task.metadata, Mapping) else None
        if raw is None:
            if self.default is None:
                raise TaskError(f"task {task.task_id!r}: no metadata.rubric and no explorer.rubric_default")
            return self.default
        try:
            return parse_rubric(raw, where="metadata.rubric")
        except ValueError as e:
            raise TaskError(f"task {task.task_id!r}: {e}") from None

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        criteria = self.rubric(task)
        answer = "" if task.answer is None else task.answer
        prompts = [self.template.format(prompt=task.prompt, answer=answer, response=r, criterion=c.text)
                   for r in responses for c in criteria]
        verdicts = self.judge.verdicts(prompts)
        weights = [c.weight for c in criteria]
        out = []
        for i in range(len(responses)):
            mine = verdicts[i * len(criteria):(i + 1) * len(criteria)]
            components = {f"criterion.{j}": v.score for j, v in enumerate(mine)}
            components["judge_success"] = float(all(v.given for v in mine))
            out.append(RewardResult(rubric_score(weights, [v.score for v in mine]), components))
        return out


register_reward_factory("rubric", RubricReward)
