"""RL and preference algorithms, selected by `algorithm.name` (see registry.py for the interface).

Registered: grpo, rloo, reinforce_pp, reinforce (policy gradient; share GRPO's loss and differ in advantages), gspo,
cispo (GRPO's advantages with a sequence-level ratio / a clipped detached importance weight), sapo (a soft gate),
topr, sppo, opmd, asymre, rec (REINFORCE-family losses of Trinity-RFT's catalog), raft (SFT on the best rollouts),
m2po (a second-moment mask over the whole step), clip_b, clip_v (GRPO with negative tokens clipped by entropy),
remax (the reward minus the task's greedy response's reward, which the explorer generates),
dpo, sft, on_policy_distill (a teacher's per-token reverse KL as the advantage), jsd_distill (a beta-mixture JSD term
instead), chord (SFT on demonstrations mixed into GRPO steps with a scheduled weight), ppo (a critic's GAE advantages,
clipped value loss), gigpo (GRPO plus step-level credit among a group's turns from the same state: multi-turn).
DAPO's pieces are options of these: algorithm.clip_eps_high, loss_agg token_mean, and the trainer's experience
operators length_penalty and zero_variance (docs/algorithms.md).
Each algorithm owns its keys (an options dataclass registered with it) and declares what the trainer provides
(`Needs`). Any other name of the form `package.module:Class` is imported and called with its options.
"""
from rft.algorithms.asymre import AsymRE, AsymREOptions
from rft.algorithms.chord import CHORD, ChordOptions  # importing the modules registers them
from rft.algorithms.cispo import CISPO
from rft.algorithms.dpo import DPO, DPOOptions
from rft.algorithms.entropy_clip import ClipB, ClipBOptions, ClipV, ClipVOptions
from rft.algorithms.gigpo import GiGPO, GiGPOOptions
from rft.algorithms.grpo import GRPO, GRPOOptions
from rft.algorithms.gspo import GSPO
from rft.algorithms.jsd_distill import JSDDistill, JSDOptions
from rft.algorithms.m2po import M2PO, M2POOptions
from rft.algorithms.on_policy_distill import DistillOptions, OnPolicyDistill
from rft.algorithms.opmd import OPMD, OPMDOptions
from rft.algorithms.ppo import PPO, PPOOptions
from rft.algorithms.raft import RAFT, RAFTOptions
from rft.algorithms.rec import REC, RECOptions
from rft.algorithms.registry import (
    ALGORITHMS,
    REPLAY_HINT,
    Algorithm,
    Critic,
    Demonstrations,
    Needs,
    NoOptions,
    StepStart,
    build_algorithm,
    build_options,
    group_advantages,
    option_keys,
    register,
    resolve_algorithm,
)
from rft.algorithms.reinforce import REINFORCE
from rft.algorithms.reinforce_pp import ReinforcePlusPlus
from rft.algorithms.remax import ReMax
from rft.algorithms.rloo import RLOO
from rft.algorithms.sapo import SAPO, SAPOOptions
from rft.algorithms.sft import SFT, SFTOptions
from rft.algorithms.sppo import SPPO, SPPOOptions
from rft.algorithms.topr import TOPR, TOPROptions

__all__ = ["ALGORITHMS", "REPLAY_HINT", "Algorithm", "Critic", "Demonstrations", "Needs", "NoOptions", "StepStart",
           "build_algorithm", "build_options", "group_advantages", "option_keys", "register", "resolve_algorithm",
           "GRPO", "RLOO", "ReinforcePlusPlus", "GSPO", "CISPO", "DPO", "SFT", "OnPolicyDistill", "JSDDistill", "CHORD",
           "PPO", "REINFORCE", "SAPO", "TOPR", "SPPO", "OPMD", "AsymRE", "REC", "RAFT", "M2PO", "ClipB", "ClipV",
           "ReMax", "GiGPO", "GiGPOOptions",
           "GRPOOptions", "DPOOptions", "SFTOptions", "DistillOptions", "JSDOptions", "ChordOptions", "PPOOptions",
           "SAPOOptions", "TOPROptions", "SPPOOptions", "OPMDOptions", "AsymREOptions", "RECOptions", "RAFTOptions",
           "M2POOptions", "ClipBOptions", "ClipVOptions"]
