"""Replay priorities (`replay_buffer.priority`): how much an experience group is worth training on again.

A priority is a function group -> score >= 0, registered by name or named by import path `package.module:function`;
the replay buffer (rft/trainer/replay_buffer.py) samples earlier groups in proportion to score x decay^age. A group
scored 0 is never replayed.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rft.registry import Registry
from rft.schema import ExperienceGroup

Score = Callable[[ExperienceGroup], float]

PRIORITIES: Registry[Score] = Registry("priority", noun="priority")
PRIORITIES.add("reward_variance", lambda group: float(np.var(group.rewards)))
PRIORITIES.add("uniform", lambda group: 1.0)


def resolve_priority(name: str) -> Score:
    """A registered priority name, or `package.module:function` (group -> score >= 0); ValueError naming
    replay_buffer.priority if neither."""
    return PRIORITIES.resolve(name, key="replay_buffer.priority")
