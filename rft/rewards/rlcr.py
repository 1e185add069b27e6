"""RLCR (Damani et al., 2025, "Beyond Binary Rewards"): the answer's correctness plus a Brier term on the confidence
the response states, so that the policy learns to be right and to say how sure it is.

    r = c - (q - c)^2        in [-1, 1]

c is the correctness that the per-response verifier `explorer.rlcr_verifier` gives (math: 0 or 1; a verifier with
partial credit gives c in [0, 1]); q is the number in the response's last `<confidence>...</confidence>` block. A
response without that block, or whose content is not a number in [0, 1] (a percentage such as `80` included), gets
the lowest reward, r = -1, as the paper's code does (its format check fails, which zeroes both its accuracy and its
Brier reward); `correct` still records c.

rft's rewards lie in [0, 1] (rft/rewards/registry.py), so the score is r mapped affinely, (1 + r) / 2: exactly half
of the paper's code's accuracy + (1 - Brier). Group-normalised advantages (GRPO) are unchanged by the map; an
algorithm on raw rewards sees them halved and shifted. Components: `rlcr` (r itself), `correct` (c), `confidence`
(q, 0 when missing), `confidence_parsed`, `brier` ((q - c)^2, 1 when missing) and the verifier's own components
under `<verifier>.<name>`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.rewards.limits import RewardWorkers, score_in_process
from rft.rewards.registry import REWARDS, RewardError, RewardFn, RewardResult, is_factory, register_reward_factory

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.rewards.context import RewardContext
    from rft.schema import TaskRecord

_CONFIDENCE = re.compile(r"<confidence>(.*?)</confidence>", re.DOTALL)


def parse_confidence(response: str) -> float | None:
    """The number in the last `<confidence>` block if it is a finite number in [0, 1], else None."""
    found = _CONFIDENCE.findall(response)
    if not found:
        return None
    try:
        q = float(found[-1].strip())
    except ValueError:
        return None
    return q if math.isfinite(q) and 0.0 <= q <= 1.0 else None


def rlcr_value(correct: float, confidence: float | None) -> float:
    """r = c - (q - c)^2; -1 when there is no confidence."""
    return -1.0 if confidence is None else correct - (confidence - correct) ** 2


def verifier_of(spec: str) -> RewardFn:
    """The per-response reward `spec` names; RewardError naming explorer.rlcr_verifier if it is not one."""
    obj = REWARDS.resolve(spec, key="explorer.rlcr_verifier")
    if is_factory(obj):
        raise RewardError(f"explorer.rlcr_verifier: {spec!r} is a stateful reward; rlcr needs a per-response "
                          "verifier such as math, reasoning_gym_tagged or exact_match")
    return obj


class RlcrReward:
    """A `Reward`: the verifier's correctness and the response's stated confidence (module docstring)."""

    def __init__(self, verifier: str):
        self.name, self.verifier = verifier, verifier_of(verifier)
        self.workers: RewardWorkers | None = None

    @staticmethod
    def check_config(explorer: ExplorerConfig) -> None:
        verifier_of(explorer.rlcr_verifier)

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> RlcrReward:
        reward = cls(explorer.rlcr_verifier)
        reward.workers = context.workers if context is not None else None
        return reward

    def score_one(self, response: str, task: TaskRecord, verdict: RewardResult | None = None) -> RewardResult:
        """One response's reward from the verifier's `verdict` (None: the verifier is called here, in-process)."""
        verdict = verdict or score_in_process(self.name, self.verifier, response, task)
        if verdict.failure:  # the verifier could not say whether it is correct
            return verdict
        c, q = verdict.score, parse_confidence(response)
        r = rlcr_value(c, q)
        components = {f"{self.name}.{k}": v for k, v in verdict.components.items()}
        components.update(rlcr=r, correct=c, confidence=0.0 if q is None else q, confidence_parsed=float(q is not None),
                          brier=1.0 if q is None else (q - c) ** 2)
        return RewardResult(min(max((1.0 + r) / 2.0, 0.0), 1.0), components)

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        """The verifier runs in the reward workers (under their time limit) when the reward was built with them."""
        if self.workers is None:
            return [self.score_one(r, task) for r in responses]
        verdicts = self.workers.score(self.name, responses, task)
        return [self.score_one(r, task, v) for r, v in zip(responses, verdicts, strict=True)]


register_reward_factory("rlcr", RlcrReward)
