"""The `algorithm` section: its `name`, and beside it the keys of that algorithm, which each algorithm owns
(rft/algorithms/; docs/algorithms.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rft.config import Section, option
from rft.config.fields import REST


@dataclass(frozen=True)
class AlgorithmConfig(Section):
    """The algorithm: its `name`, and beside it the keys of that algorithm (`algorithm: {name: ppo, gamma: 0.99}`).
    Each algorithm owns its keys (rft/algorithms/; docs/algorithms.md): the rows below say which algorithms take each
    one, and a key the chosen algorithm does not take is an error."""
    KEY = "algorithm"
    name: str = option("grpo",
        help="grpo, rloo, reinforce_pp, reinforce, gspo, cispo, sapo, topr, sppo, opmd, asymre, rec, raft, remax, dpo, "
        "sft, on_policy_distill, chord, ppo, or package.module:Class")
    # the section's other keys, as written (not a key of its own); rft.algorithms builds them into the algorithm's
    # typed options, and a run's loaded config holds them with their defaults (rft.run.loading)
    options: dict[str, Any] = field(default_factory=dict, metadata={REST: True})

    @classmethod
    def of(cls, name: str = "grpo", **options: Any) -> AlgorithmConfig:
        """The section `{name: name, **options}`, as code writes it."""
        return cls(name=name, options=options)

    def to_dict(self) -> dict[str, Any]:
        """The section as YAML writes it: the name and the algorithm's keys side by side."""
        return {"name": self.name, **self.options}
