"""What a stateful reward (a judge) receives besides the explorer section: `RewardContext`, the policy model's
section and a way to start an engine of the explorer's kind on another model directory. Built by the composition
(entry points) and passed through `build_reward` to the rewards that need it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.engine import build_engine
from rft.rewards.limits import RewardWorkers

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.run.config import Config


@dataclass(frozen=True)
class RewardContext:
    """What a stateful reward may need beyond the explorer section: the policy model's section (lengths) and a
    way to start an engine of the explorer's kind on another model directory (`engine(path)`); `workers`: the
    reward worker processes per-response rewards run in under their time limit (rft/rewards/limits.py; None: in
    this process, without a limit)."""
    model: ModelConfig
    engine: Callable[[str], Engine]
    workers: RewardWorkers | None = None

    @classmethod
    def of(cls, explorer: ExplorerConfig, model: ModelConfig, *, seed: int,
           workers: RewardWorkers | None = None) -> RewardContext:
        """Engines of `explorer.engine`'s kind over `model`'s settings, seeded with `seed` (`run.seed`)."""
        return cls(model, lambda path: build_engine(explorer, model, seed=seed, model_path=path), workers)

    @classmethod
    def for_run(cls, cfg: Config) -> RewardContext:
        """Composition helper for entry points: `of` over the run's sections (holds no reference to `cfg`), with
        reward workers of explorer.reward_timeout_s / reward_workers (started on first use)."""
        return cls.of(cfg.explorer, cfg.model, seed=cfg.run.seed, workers=RewardWorkers.from_config(cfg.explorer))
