"""RULER-style group ranking: a judge model reads all responses to one task and scores them against each other.

A group-level reward needs no new hook: every `Reward` scores one task's whole group at once
(`score(responses, task)`, rft/rewards/registry.py), and the workflows pass the group (single_turn, multi_turn's
final turns). The judge reads `explorer.ruler_template` (fields `{prompt}`, `{answer}`, `{n}` and `{responses}`,
the responses numbered `Response 1:` ... `Response n:`), rendered by its chat template when `model.chat_template`
is on, and writes up to `explorer.ruler_max_tokens` tokens greedily. Relative scores are what group-normalised
advantages (GRPO) need; with a group of one the judge scores it alone.

Parsing (`parse_scores`): the last flat `[...]` in the judge's text must be a JSON list of exactly n finite numbers;
each is clipped to [0, 1] (as Trinity-RFT's RULER workflow does). Anything else is a named failure: every response
of the group scores 0 with component `judge_success` 0 (a warning logs the judge's text). An all-zero group gives
no group-normalised advantage, so a failed judgement teaches nothing rather than something wrong. A group whose
prompt cannot fit the judge's context even with every response cut to a few tokens fails the same way; otherwise
each response is cut to an equal share of the room left, keeping its end (where the answer is).

Components: `judge_success` (1 when the list was read) and `rank` (the response's 0-based place by score, 0 the
best; ties share the better place).
"""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft.engine import SamplingSettings
from rft.rewards.judge import check_judge_model, check_template, start_judge
from rft.rewards.registry import RewardError, RewardResult, register_reward_factory
from rft.text.chat import ChatPrompt

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.rewards.context import RewardContext
    from rft.schema import TaskRecord

log = logging.getLogger(__name__)

FIELDS = ("prompt", "answer", "n", "responses")
MIN_RESPONSE_TOKENS = 8  # below this share per response the judge would read nothing useful: a failure
_FLAT_LIST = re.compile(r"\[[^\[\]]*\]")


def parse_scores(text: str, n: int) -> list[float] | None:
    """The scores in the judge's last flat JSON list, clipped to [0, 1]; None unless it is n finite numbers."""
    found = _FLAT_LIST.findall(text)
    if not found:
        return None
    try:
        values = json.loads(found[-1])
    except ValueError:
        return None
    if not isinstance(values, list) or len(values) != n:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    return [min(max(float(v), 0.0), 1.0) for v in values]


def ranks(scores: Sequence[float]) -> list[int]:
    """Each score's 0-based place, best first; equal scores share the better place."""
    return [sum(other > s for other in scores) for s in scores]


def numbered(responses: Sequence[str]) -> str:
    return "\n\n".join(f"Response {i + 1}:\n{r}" for i, r in enumerate(responses))


class RulerReward:
    """A `Reward` whose scores are the judge's relative judgement of the whole group (module docstring)."""

    def __init__(self, engine: Engine, *, template: str, max_tokens: int, max_prompt_tokens: int,
                 chat: ChatPrompt | None = None):
        if max_prompt_tokens < 1:
            raise RewardError(f"explorer.ruler_max_tokens: {max_tokens} leaves no room for the judge's prompt in "
                              f"its context ({max_prompt_tokens + max_tokens} tokens: model.max_prompt_len + "
                              "model.max_response_len)")
        self.engine, self.template, self.chat = engine, template, chat
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = SamplingSettings(n=1, temperature=0.0, max_tokens=max_tokens)

    @staticmethod
    def check_config(explorer: ExplorerConfig) -> None:
        check_judge_model(explorer, "ruler")
        check_template(explorer.ruler_template, FIELDS, key="explorer.ruler_template")

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> RulerReward:
        """The judge of `explorer.judge_model`; its prompt and reply share the policy's context length."""
        engine = start_judge(explorer, context, "ruler")
        assert context is not None  # start_judge checked
        model = context.model
        return cls(engine, template=explorer.ruler_template, max_tokens=explorer.ruler_max_tokens,
                   max_prompt_tokens=model.max_prompt_len + model.max_response_len - explorer.ruler_max_tokens,
                   chat=ChatPrompt() if model.chat_template else None)

    def _encode(self, text: str) -> list[int]:
        return self.engine.encode_chat(text, self.chat) if self.chat is not None else self.engine.encode(text)

    def _render(self, responses: Sequence[str], task: TaskRecord) -> str:
        return self.template.format(prompt=task.prompt, answer="" if task.answer is None else task.answer,
                                    n=len(responses), responses=numbered(responses))

    def judge_prompt(self, responses: Sequence[str], task: TaskRecord) -> list[int] | None:
        """The judge's prompt ids, each response cut (keeping its end) to fit; None when it cannot fit."""
        n = len(responses)
        room = self.max_prompt_tokens - len(self._encode(self._render([""] * n, task)))
        share = room // n - 2  # a little slack: text cut at token boundaries may re-tokenise longer
        if share < MIN_RESPONSE_TOKENS:
            return None
        cut = []
        for r in responses:
            ids = self.engine.encode(r, add_special_tokens=False)
            cut.append(self.engine.decode(ids[-share:]) if len(ids) > share else r)
        ids = self._encode(self._render(cut, task))
        return ids if len(ids) <= self.max_prompt_tokens else None

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        n = len(responses)
        if n == 0:
            return []
        prompt = self.judge_prompt(responses, task)
        if prompt is None:
            log.warning("ruler: task %r: the judge's prompt does not fit its context (%d tokens) with %d responses; "
                        "the group scores 0", task.task_id, self.max_prompt_tokens, n)
            return self.failed(n)
        text = self.engine.generate([prompt], self.sampling)[0].completions[0].text
        scores = parse_scores(text, n)
        if scores is None:
            log.warning("ruler: task %r: no list of %d scores in the judge's reply; the group scores 0: %r",
                        task.task_id, n, text[-300:])
            return self.failed(n)
        return [RewardResult(s, {"judge_success": 1.0, "rank": float(k)})
                for s, k in zip(scores, ranks(scores), strict=True)]

    @staticmethod
    def failed(n: int) -> list[RewardResult]:
        return [RewardResult(0.0, {"judge_success": 0.0}) for _ in range(n)]


register_reward_factory("ruler", RulerReward)
