"""Model-as-judge: a second LLM, served by the explorer's engine class, rates each response.

The judge reads `explorer.judge_template` (fields `{prompt}`, `{response}`, `{answer}`) and the score
is the judge's probability of answering `judge_yes` rather than `judge_no` as its next token:
    score = P(yes) / (P(yes) + P(no)),
read from one constrained decoding step (no sampling noise, no parsing of free text). Both words must
be single tokens of the judge's tokenizer; that is checked when the judge starts.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.rewards.registry import RewardError, RewardResult, register_reward_factory

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.rewards.context import RewardContext
    from rft.schema import TaskRecord


class JudgeReward:
    """A `Reward` backed by an `Engine` running the judge model."""

    def __init__(self, engine: Engine, *, template: str, yes: str, no: str, max_prompt_tokens: int | None = None):
        self.engine, self.template, self.max_prompt_tokens = engine, template, max_prompt_tokens
        self.candidates = [self._single_token(yes), self._single_token(no)]

    def _single_token(self, word: str) -> int:
        ids = self.engine.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RewardError(f"judge: {word!r} is {len(ids)} tokens for the judge's tokenizer; "
                              "explorer.judge_yes / judge_no must be single tokens")
        return ids[0]

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> JudgeReward:
        """The judge of `explorer.judge_model`, on an engine that `context` starts (prompts are cut to the
        policy model's context length, `context.model`)."""
        if not explorer.judge_model:
            raise RewardError("explorer.judge_model: the judge reward needs a judge model directory")
        if context is None:
            raise RewardError("judge: building the judge needs a RewardContext (to start its engine)")
        model = context.model
        return cls(context.engine(explorer.judge_model), template=explorer.judge_template, yes=explorer.judge_yes,
                   no=explorer.judge_no, max_prompt_tokens=model.max_prompt_len + model.max_response_len - 1)

    def judge_prompt(self, response: str, task: TaskRecord) -> str:
        return self.template.format(prompt=task.prompt, response=response,
                                    answer="" if task.answer is None else task.answer)

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        prompts = [self.engine.encode(self.judge_prompt(r, task)) for r in responses]
        if self.max_prompt_tokens is not None:  # keep the end, where the question to the judge is
            prompts = [p[-self.max_prompt_tokens:] for p in prompts]
        out = []
        for p_yes, p_no in self.engine.next_token_probs(prompts, self.candidates):
            total = p_yes + p_no
            score = p_yes / total if total > 0 else 0.0
            out.append(RewardResult(min(max(score, 0.0), 1.0), {"p_yes": p_yes}))
        return out


register_reward_factory("judge", JudgeReward)
