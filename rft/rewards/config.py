"""The reward's keys of the `explorer` section: which reward scores a response, and the judge reward's model (the
range every reward must lie in is the run's: run.reward_min / run.reward_max)."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import Section, option


@dataclass(frozen=True)
class RewardOptions(Section):
    KEY = "explorer"
    reward: str = option("exact_match",
        help="registered name, `weighted` (uses reward_weights) or package.module:function")
    reward_weights: dict[str, float] = option(factory=dict, help="reward name -> weight, for reward: weighted")


@dataclass(frozen=True)
class JudgeOptions(Section):
    """The `judge` reward: a model that answers whether a response is correct (rft/rewards/judge.py)."""
    KEY = "explorer"
    judge_model: str = option("", help="reward judge: HF model directory of the judge")
    judge_template: str = option(
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
        "Is the response correct? Answer Yes or No.\nAnswer:",
        help="reward judge: its prompt")
    judge_yes: str = option(" Yes", help="reward judge: the single token that means correct")
    judge_no: str = option(" No", help="reward judge: the single token that means wrong")
