"""Model-as-judge: a second LLM, served by the explorer's engine class, rates each response.

The judge reads `explorer.judge_template` (fields `{prompt}`, `{response}`, `{answer}`) and the score
is the judge's probability of answering `judge_yes` rather than `judge_no` as its next token:
    score = P(yes) / (P(yes) + P(no)),
read from one constrained decoding step (no sampling noise, no parsing of free text). Both words must
be single tokens of the judge's tokenizer; that is checked when the judge starts.

The other judge rewards build on this module: `rubric` (rft/rewards/rubric.py) asks the same yes/no question once
per criterion (`YesNoJudge`), `ruler` (rft/rewards/ruler.py) lets the judge write scores for a whole group; all
start their judge with `start_judge` and check their templates with `check_template`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.rewards.registry import RewardError, RewardResult, register_reward_factory

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.rewards.context import RewardContext
    from rft.schema import TaskRecord


def check_template(template: str, fields: Iterable[str], *, key: str) -> None:
    """RewardError naming `key` when `template` uses a field outside `fields` or is not a valid format string."""
    try:
        template.format(**{f: "" for f in fields})
    except (KeyError, IndexError, ValueError) as e:
        raise RewardError(f"{key}: invalid template ({type(e).__name__}: {e}); its fields are "
                          f"{', '.join('{' + f + '}' for f in fields)}") from None


def check_judge_model(explorer: ExplorerConfig, reward: str) -> None:
    if not explorer.judge_model:
        raise RewardError(f"explorer.judge_model: the {reward} reward needs a judge model directory")


def start_judge(explorer: ExplorerConfig, context: RewardContext | None, reward: str) -> Engine:
    """The judge engine (`explorer.judge_model`, started by `context` with the explorer's engine kind)."""
    check_judge_model(explorer, reward)
    if context is None:
        raise RewardError(f"{reward}: building the judge needs a RewardContext (to start its engine)")
    return context.engine(explorer.judge_model)


def judge_context_tokens(context: RewardContext) -> int:
    """The longest prompt a judge engine takes for one next-token step (it runs with the policy's lengths)."""
    return context.model.max_prompt_len + context.model.max_response_len - 1


@dataclass(frozen=True)
class Verdict:
    """One constrained yes/no step: `score` = P(yes) / (P(yes) + P(no)) in [0, 1]; `given` is False when both
    probabilities were 0 (no verdict; `score` is then 0)."""
    score: float
    p_yes: float
    given: bool


class YesNoJudge:
    """The constrained yes/no step: for each prompt (text), P(yes) / (P(yes) + P(no)) of the judge's next token.
    Prompts longer than `max_prompt_tokens` keep their end, where the question to the judge is."""

    def __init__(self, engine: Engine, *, yes: str, no: str, max_prompt_tokens: int | None = None):
        self.engine, self.max_prompt_tokens = engine, max_prompt_tokens
        self.candidates = [self._single_token(yes), self._single_token(no)]

    def _single_token(self, word: str) -> int:
        ids = self.engine.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RewardError(f"judge: {word!r} is {len(ids)} tokens for the judge's tokenizer; "
                              "explorer.judge_yes / judge_no must be single tokens")
        return ids[0]

    def verdicts(self, prompts: Sequence[str]) -> list[Verdict]:
        """One `Verdict` per prompt (text), in order."""
        if not prompts:
            return []
        ids = [self.engine.encode(p) for p in prompts]
        if self.max_prompt_tokens is not None:
            ids = [p[-self.max_prompt_tokens:] for p in ids]
        out = []
        for p_yes, p_no in self.engine.next_token_probs(ids, self.candidates):
            total = p_yes + p_no
            score = p_yes / total if total > 0 else 0.0
            out.append(Verdict(min(max(score, 0.0), 1.0), p_yes, total > 0))
        return out


class JudgeReward:
    """A `Reward` backed by an `Engine` running the judge model."""
    FIELDS = ("prompt", "response", "answer")

    def __init__(self, engine: Engine, *, template: str, yes: str, no: str, max_prompt_tokens: int | None = None):
        self.engine, self.template = engine, template
        self.judge = YesNoJudge(engine, yes=yes, no=no, max_prompt_tokens=max_prompt_tokens)

    @staticmethod
    def check_config(explorer: ExplorerConfig) -> None:
        """Config-time checks (`rft.rewards.check_reward_config` calls them for the rewards a config names)."""
        check_judge_model(explorer, "judge")
        check_template(explorer.judge_template, JudgeReward.FIELDS, key="explorer.judge_template")

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> JudgeReward:
        """The judge of `explorer.judge_model`, on an engine that `context` starts (prompts are cut to the
        policy model's context length, `context.model`)."""
        engine = start_judge(explorer, context, "judge")
        assert context is not None  # start_judge checked
        return cls(engine, template=explorer.judge_template, yes=explorer.judge_yes, no=explorer.judge_no,
                   max_prompt_tokens=judge_context_tokens(context))

    def judge_prompt(self, response: str, task: TaskRecord) -> str:
        return self.template.format(prompt=task.prompt, response=response,
                                    answer="" if task.answer is None else task.answer)

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        verdicts = self.judge.verdicts([self.judge_prompt(r, task) for r in responses])
        return [RewardResult(v.score, {"p_yes": v.p_yes}) for v in verdicts]


register_reward_factory("judge", JudgeReward)
