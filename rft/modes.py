"""What each run mode means: the one table of modes, and the staleness of a sample.

Version 0 is the initial weights; optimizer step s produces version s (docs/architecture.md, "Glossary"). A sample
generated with `policy_version` and used in step s has staleness `(s - 1) - policy_version` (`staleness()`); the
mode's bound is the largest staleness a sample may have when it is used (`staleness_bound()`):

    mode        bound                explorers  trainer  trainer publishes weights  admission waits at
    sync        0                    yes        yes      yes                        0
    off_policy  run.max_staleness    yes        yes      yes                        run.max_staleness
    async       none                 yes        yes      yes                        run.async_max_staleness
    offline     none                 no         yes      no (replays a topic)       -
    explore     none                 yes        no       no trainer                 -
    train       none                 no         yes      yes (explorers elsewhere)  -
    serve       none                 no         yes      yes (for `rft serve`)      -

Serve mode's experience comes from traffic (`rft serve` and the joiner, rft/serve/). Admission holds explorers back
at the mode's admission bound (`admission_bound()`); the trainer drops what exceeds the mode's bound. They differ in
async mode only: its explorers wait `run.async_max_staleness` versions ahead of the trainer (null: never), and the
trainer keeps every sample (the off-policy correction weighs them). Other modules ask this one (`MODES`, `mode()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Mode:
    """One row of the table in the module docstring."""
    name: str
    bound: Literal["zero", "max_staleness", "none"]
    explorers: bool  # `rft run` starts explorers
    trainer: bool  # `rft run` starts a trainer
    publishes_weights: bool  # the trainer publishes each version for explorers
    serves: bool = False  # `rft run` starts `rft serve` and the joiner (experience from live traffic)
    soft_bound: bool = False  # admission waits at run.async_max_staleness; the trainer drops nothing (async)

    @property
    def roles(self) -> tuple[str, ...]:
        """The parts `rft run` starts besides the broker and the task publisher."""
        return tuple(role for role, on in (("trainer", self.trainer), ("explorers", self.explorers),
                                           ("serve", self.serves)) if on)

    def staleness_bound(self, max_staleness: int) -> int | None:
        """0, `max_staleness` (>= 0) or None (no bound)."""
        if self.bound == "zero":
            return 0
        if self.bound == "none":
            return None
        if max_staleness < 0:
            raise ValueError(f"run.max_staleness: must be >= 0, got {max_staleness}")
        return max_staleness

    def admission_bound(self, max_staleness: int, async_max_staleness: int | None = None) -> int | None:
        """The staleness admission holds explorers to: the mode's bound, or `async_max_staleness` (None: no bound)
        in a mode with a soft bound."""
        if not self.soft_bound:
            return self.staleness_bound(max_staleness)
        if async_max_staleness is not None and async_max_staleness < 0:
            raise ValueError(f"run.async_max_staleness: must be >= 0 or null, got {async_max_staleness}")
        return async_max_staleness


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("sync", "zero", explorers=True, trainer=True, publishes_weights=True),
    Mode("off_policy", "max_staleness", explorers=True, trainer=True, publishes_weights=True),
    Mode("async", "none", explorers=True, trainer=True, publishes_weights=True, soft_bound=True),
    Mode("offline", "none", explorers=False, trainer=True, publishes_weights=False),
    Mode("explore", "none", explorers=True, trainer=False, publishes_weights=False),
    Mode("train", "none", explorers=False, trainer=True, publishes_weights=True),
    Mode("serve", "none", explorers=False, trainer=True, publishes_weights=True, serves=True),
)}


def mode(name: str) -> Mode:
    """The row of `run.mode` `name`; ValueError naming the known modes for any other."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"run.mode: unknown mode {name!r} ({', '.join(MODES)})") from None


def staleness_bound(name: str, max_staleness: int) -> int | None:
    """The largest staleness a sample may have when used in mode `name`: 0 (sync), k (off_policy) or None."""
    return mode(name).staleness_bound(max_staleness)


def admission_bound(name: str, max_staleness: int, async_max_staleness: int | None = None) -> int | None:
    """The staleness admission holds the explorers of mode `name` to (`Mode.admission_bound`)."""
    return mode(name).admission_bound(max_staleness, async_max_staleness)


def staleness(step: int, policy_version: int) -> int:
    """Staleness of a sample generated with `policy_version` and used in optimizer step `step`: (step - 1) - v.
    0 is on-policy; negative means weights newer than the step's (an abandoned lineage, or another run's)."""
    return (step - 1) - policy_version
