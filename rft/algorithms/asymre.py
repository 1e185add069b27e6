"""AsymRE (Arnal et al. 2025, "Asymmetric REINFORCE for off-policy RL"): OPMD's loss with the baseline shifted.

    A_i = r_i - (b + asymre_shift)       b: OPMD's baseline (opmd_baseline, the group mean by default); a group of
                                         one: A = r (no baseline, as Trinity-RFT)
    l_t = -w_t * A_i * logp_t / (1 + opmd_tau)  +  kl_coef * k3_t
A negative shift (the default -0.1, Trinity-RFT's) lowers the baseline, so more of each group is pushed up than down:
off-policy REINFORCE stays stable when the baseline sits below the behaviour policy's value (the paper's result).
Trinity-RFT runs it with no KL term (kl_coef 0 here too, the default) and opmd_tau 1.0. Everything else is OPMD's
(rft/algorithms/opmd.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rft.algorithms.opmd import OPMD, OPMDOptions
from rft.algorithms.registry import register
from rft.config import FINITE, option


@dataclass(frozen=True)
class AsymREOptions(OPMDOptions):
    """OPMD's keys and the baseline's shift."""
    asymre_shift: float = option(-0.1, range=FINITE,
        help="added to the group baseline (negative: more samples pushed up than down)")


@register("asymre", options=AsymREOptions)
class AsymRE(OPMD):
    cfg: AsymREOptions

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        if len(rewards) < 2:
            return rewards.copy()
        return rewards - (self.baseline(rewards) + self.cfg.asymre_shift)
