"""The `explorer` section, composed of its owners' keys: the engine and sampling (rft/engine/config.py), the workflow
(rft/workflows/config.py), the reward (rft/rewards/config.py), the tools (rft/agent_tools/config.py), and the
explorer's own: the fleet, its loops, admission and membership. YAML keeps one flat `explorer:` mapping."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rft.agent_tools.config import PythonToolOptions, ToolOptions
from rft.config import COUNT, OPTIONAL, POSITIVE, Range, Section, SectionError, option
from rft.engine.config import EngineOptions, SamplingOptions
from rft.rewards.config import JudgeOptions, RewardOptions, RlcrOptions, RubricOptions, RulerOptions
from rft.workflows.config import AgentProgramOptions, WorkflowOptions

ADMISSIONS = ("staleness", "all")  # the built-in explorer.admission policies; anything else is an import path


@dataclass(frozen=True)
class LoopOptions(Section):
    """How an explorer takes tasks: in batches, or continuously with in-flight weight updates."""
    KEY = "explorer"
    tasks_per_batch: int = option(8, range=COUNT,
        help="batch loop (continuous false): tasks an explorer takes from the tasks topic and generates together "
        "per batch")
    continuous: bool = option(False,
        help="vllm engine, single_turn: submit tasks as engine slots free up and produce each group when its n "
        "samples are done (rft/explorer/continuous.py); false: batches of tasks_per_batch")
    max_inflight: int = option(64, range=COUNT,
        help="continuous: the engine holds at most max_inflight x n_samples unfinished sequences (tasks' worth)")
    inflight_updates: bool = option(False,
        help="continuous: load a newer weights version between engine steps without draining the requests in "
        "flight (each token records the version that generated it: version_spans); false: stop admitting, "
        "drain, reload, resume")
    inflight_kv: Literal["recompute", "keep"] = option("recompute",
        help="inflight_updates: recompute: the requests in flight recompute their KV cache with the new weights "
        "(exact per version, one prefill of each sequence per version); keep: they keep the KV the old "
        "weights computed (PipelineRL; turns vLLM's prefix cache off)")

    def validate(self) -> None:
        if self.inflight_updates and not self.continuous:
            raise SectionError("inflight_updates", "needs explorer.continuous: true (the batch loop reloads between "
                              "batches)")


@dataclass(frozen=True)
class AdmissionOptions(Section):
    """Which rollouts an explorer starts (rft/explorer/admission.py)."""
    KEY = "explorer"
    admission: str = option("staleness",
        help="staleness (the mode's bound, fleet-wide), all, or package.module:factory(config, explorer_id)")
    admission_counts_drops: bool = option(True,
        help="staleness admission: start enough groups to fill each step when the trainer's operators drop some "
        "(the share it kept over its last steps, `keep_fraction`); a group beyond its step trains one version"
        " later or is dropped as stale by the trainer. false: every group takes a step's slot (the trainer "
        "waits for replacements)")


@dataclass(frozen=True)
class MembershipOptions(Section):
    """How an explorer stays in the fleet: heartbeats, the tasks consumer group, idling out
    (rft/explorer/membership.py)."""
    KEY = "explorer"
    heartbeat_s: float = option(5.0, help="seconds between explorer heartbeats on the control topic", range=POSITIVE)
    max_batch_s: float = option(300.0, range=POSITIVE,
        help="longest one batch may take before the consumer group presumes the explorer dead")
    exit_when_idle_s: float = option(0.0, range=OPTIONAL,
        help="> 0: an explorer exits (code 0) after this long without tasks, counted from when its consumer group "
        "answered its join; 0: never, except that `rft run` in explore mode uses 30 s (its explorers end the "
        "run once the task set is exhausted)")
    static_membership: bool = option(False,
        help="join the tasks group with group_instance_id = explorer id (KIP-345; docs/operations.md)")
    unassigned_rejoin_s: float = option(30.0, range=OPTIONAL,
        help="membership watchdog: rejoin / move the tasks group after this long without partitions (0: off)")


@dataclass(frozen=True)
class ExplorerConfig(MembershipOptions, AdmissionOptions, LoopOptions, PythonToolOptions, ToolOptions, RlcrOptions,
                     RulerOptions, RubricOptions, JudgeOptions, RewardOptions, AgentProgramOptions, WorkflowOptions,
                     SamplingOptions, EngineOptions):
    """One flat `explorer:` mapping whose keys the components that use them declare: the engine and sampling, the
    workflow, the reward and its judge, the tools, and the explorer's own loops, admission and membership;
    `replicas` is the fleet's size."""
    KEY = "explorer"
    replicas: int = option(1, range=Range(0, 1024, note="each is a process `rft run` starts"),
        help="explorers `rft run` starts in modes with explorers; also the fixed fleet a push serves (sync.method "
        "push) and, with tasks_per_batch, data.tasks_ahead's default")

    def validate(self) -> None:
        if self.continuous and self.engine != "vllm":
            raise SectionError("continuous", f"needs explorer.engine vllm (its engine-level request API), got "
                              f"{self.engine}")
