"""RL and preference algorithms, selected by `algorithm.name` (see registry.py for the interface).

Registered: grpo, rloo, reinforce_pp (policy gradient; share GRPO's loss and differ in advantages), dpo, sft.
Any other name of the form `package.module:object` is imported and called with the AlgorithmConfig.
"""
from rft.algorithms.registry import ALGORITHMS, Algorithm, build_algorithm, register, resolve_algorithm
from rft.algorithms.dpo import DPO  # importing the modules registers them
from rft.algorithms.grpo import GRPO
from rft.algorithms.reinforce_pp import ReinforcePlusPlus
from rft.algorithms.rloo import RLOO
from rft.algorithms.sft import SFT

__all__ = ["ALGORITHMS", "Algorithm", "build_algorithm", "register", "resolve_algorithm",
           "GRPO", "RLOO", "ReinforcePlusPlus", "DPO", "SFT"]
