"""The feedback `rft serve` accepts (`POST /v1/feedback`): `{"id", "reward", "components"?: {name: float},
"index"?: choice (0)}`, or `{"feedback": [...]}` of several, checked into `Feedback` records (`parse_feedback`)
before anything is recorded. A malformed item, a reward that is not finite or outside run.reward_min ..
reward_max, an id over MAX_ID_CHARS, or components that are not at most MAX_COMPONENTS finite numbers with names of at
most MAX_COMPONENT_NAME characters (rft.schema.components_problem) are a 400 naming the item; whether the completion
may take feedback (unknown, expired, already rewarded) is the ledger's to say (rft/serve/ledger.py)."""
from __future__ import annotations

from typing import Any

import numpy as np

from rft.schema import MAX_ID_CHARS, Feedback, RewardRange, components_problem
from rft.serve.requests import ApiError


def parse_feedback(body: Any, *, run_id: str, rewards: RewardRange) -> list[Feedback]:
    """The records of a feedback body, one per item; ApiError 400 for the first item refused (none is kept)."""
    items = body.get("feedback") if isinstance(body, dict) and "feedback" in body else [body]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "feedback: a non-empty list of {id, reward, components?, index?} objects",
                       param="feedback")
    return [_feedback_record(item, i if len(items) > 1 else None, run_id=run_id, rewards=rewards)
            for i, item in enumerate(items)]


def _feedback_record(item: Any, position: int | None, *, run_id: str, rewards: RewardRange) -> Feedback:
    where = "feedback" if position is None else f"feedback[{position}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where}: expected an object with id and reward", param=where)
    rid, reward, index = item.get("id"), item.get("reward"), item.get("index", 0)
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS:
        raise ApiError(400, f"{where}.id: required, the completion's id (at most {MAX_ID_CHARS} characters)",
                       param=f"{where}.id")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not np.isfinite(reward):
        raise ApiError(400, f"{where}.reward: required, a finite number", param=f"{where}.reward")
    if problem := rewards.problem(reward):
        raise ApiError(400, f"{where}.reward: {problem}", param=f"{where}.reward")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ApiError(400, f"{where}.index: a choice index >= 0", param=f"{where}.index")
    components = item.get("components", {})
    if problem := components_problem(components):
        raise ApiError(400, f"{where}.components: {problem}", param=f"{where}.components")
    return Feedback(run_id=run_id, request_id=rid, reward=float(reward), index=index,
                    components={k: float(v) for k, v in components.items()})
