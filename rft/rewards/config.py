"""The reward's keys of the `explorer` section: which reward scores a response, the judge rewards' model and prompts
(judge, rubric, ruler) and the rlcr reward's verifier (the range every reward must lie in is the run's:
run.reward_min / run.reward_max)."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import COUNT, POSITIVE, Section, option


@dataclass(frozen=True)
class RewardOptions(Section):
    KEY = "explorer"
    reward: str = option("exact_match",
        help="registered name, `weighted` (uses reward_weights) or package.module:function")
    reward_weights: dict[str, float] = option(factory=dict, help="reward name -> weight, for reward: weighted")
    reward_timeout_s: float = option(10.0, range=POSITIVE,
        help="seconds one response's per-response reward (a verifier) may take, in a reward worker process; past it "
        "the worker is killed and the sample is a failed rollout (timeout), not a stall (rft/rewards/limits.py)")
    reward_workers: int = option(1, range=COUNT,
        help="reward worker processes per explorer: a group's responses are scored this many at a time")


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


@dataclass(frozen=True)
class RubricOptions(Section):
    """The `rubric` reward: the judge checks a response against weighted criteria (rft/rewards/rubric.py); it uses
    the judge's model and yes/no tokens (explorer.judge_model, judge_yes, judge_no)."""
    KEY = "explorer"
    rubric_default: dict[str, float] = option(factory=dict,
        help="rubric reward: criterion text -> weight, for tasks without metadata.rubric (empty: such a task goes "
        "to the dead-letter topic)")
    rubric_template: str = option(
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\nCriterion: {criterion}\n"
        "Does the response meet the criterion? Answer Yes or No.\nAnswer:",
        help="rubric reward: the judge's prompt for one criterion (fields prompt, answer, response, criterion)")


@dataclass(frozen=True)
class RulerOptions(Section):
    """The `ruler` reward: the judge scores a task's whole group relative to each other (rft/rewards/ruler.py)."""
    KEY = "explorer"
    ruler_template: str = option(
        "You are a fair judge. Below are a question and {n} candidate responses to it. Compare the responses "
        "with each other and give each a score between 0 and 1 for how well it answers the question: a better "
        "response gets a higher score.\n\nQuestion: {prompt}\n\n{responses}\n\nThink briefly if you need to, then "
        "end your reply with a JSON list of exactly {n} numbers, the scores of response 1 to response {n} in "
        "order.\n",
        help="ruler reward: the judge's prompt (fields prompt, answer, responses: the numbered responses, n)")
    ruler_max_tokens: int = option(512, range=COUNT,
        help="ruler reward: the most tokens the judge writes (greedy) before its list of scores")


@dataclass(frozen=True)
class RlcrOptions(Section):
    """The `rlcr` reward: correctness plus a Brier term on the stated confidence (rft/rewards/rlcr.py)."""
    KEY = "explorer"
    rlcr_verifier: str = option("math",
        help="rlcr reward: the per-response reward that says whether the answer is correct (e.g. math, "
        "reasoning_gym_tagged, exact_match, or package.module:function)")
