"""One explorer process serving several runs of the same base model: `rft explorer A.yaml B.yaml [...]`
(docs/lora.md, "Several runs, one explorer").

Every run trains LoRA (`model.lora`), so each of its versions is an adapter and the base never changes: one vLLM
engine holds the base once and every run's adapter beside it (rft/engine/shared.py: one `AdapterSlot` per run, an
`Engine` whose weights are that run's adapter). Around each slot sits a whole, ordinary `Explorer` of that run (its
config's sections: its tasks, experiences, control and dead-letter topics, its consumer group, its weight store,
admission with its mode's staleness bound, its workflow, reward and sampling, its heartbeats and metrics), composed
as `rft explorer A.yaml` alone would compose it. So for each run the process is one member of that run's fleet:
it loads the run's newest adapter before joining its consumer group, reloads only that run's adapter when the run
publishes a version, and stamps the run's groups with the run's version.

`run_explorers` runs each explorer's loop (`Explorer.run`, unchanged) in a thread of its own, named after its run;
the slots take turns on the engine (one call at a time). A stop (SIGTERM, Ctrl-C) reaches every run: each finishes
its batch, leaves its run's fleet and closes; a run that goes idle (`exit_when_idle_s`) leaves alone; an error in one
run stops them all, and is raised once every run has left.

`check_runs` refuses what one engine cannot serve, naming the file and the key: a run that trains no LoRA, another
engine than vllm, another base model or engine setting than the first run's (`ENGINE_KEYS`), pushed weights
(`sync.method: push`: a push group drives the whole engine), the continuous loop (it steps the engine itself), a
mode without explorers, and two configs of one run (same name, topics or weight store). The python tool's sandbox
settings (`SANDBOX_KEYS`) must be equal too: one run's `explorer.python_sandbox: none` would run its code in the
process that holds every run's keys and credentials.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rft.config import ConfigError
from rft.modes import mode

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.explorer.explorer import Explorer
    from rft.models.config import ModelConfig
    from rft.run.config import RunConfig
    from rft.transport.config import KafkaConfig
    from rft.weights.config import SyncConfig

log = logging.getLogger("rft.explorer")

# what builds the shared engine (rft.engine.VLLMEngine.from_config, rft/explorer/main.py): equal in every run
ENGINE_KEYS = ("model.path", "model.dtype", "model.chat_template", "model.max_prompt_len", "model.max_response_len",
               "explorer.tensor_parallel_size", "explorer.gpu_memory_utilization", "explorer.cpu_kvcache_gb",
               "explorer.cpu_kv_block_size", "explorer.prefill_once",
               "explorer.vllm_in_process", "run.routing_replay", "run.routing_prefill")

# the python tool's isolation (rft/agent_tools/config.py): equal in every run, or the weakest would expose the others
SANDBOX_KEYS = ("explorer.python_sandbox", "explorer.python_workdir_mb")


@dataclasses.dataclass(frozen=True)
class SharedRun:
    """One run of a shared engine, as `check_runs` reads it: the file it came from, its sections (named as in the
    YAML, so a key names its value), and its weight store's root (rft/explorer/main.py `shared_run` builds it)."""
    source: str
    run: RunConfig
    model: ModelConfig
    explorer: ExplorerConfig
    sync: SyncConfig
    kafka: KafkaConfig
    store: str


def _value(shared: SharedRun, key: str) -> Any:
    value: Any = functools.reduce(getattr, key.split("."), shared)
    return os.path.realpath(value) if key == "model.path" else value


def check_runs(runs: Sequence[SharedRun]) -> None:
    """ConfigError (`SOURCE: KEY: why`) unless one shared engine can serve every run of `runs`, the first run's
    settings being the engine's (module docstring)."""
    for r in runs:
        _check_run(r)
    first = runs[0]
    seen: dict[tuple[str, Any], str] = {}
    for r in runs:
        for key in ENGINE_KEYS:
            if _value(r, key) != _value(first, key):
                raise ConfigError(f"{r.source}: {key}: {_value(r, key)!r}, while {first.source} has "
                                  f"{_value(first, key)!r}: runs sharing an explorer share its engine, which needs the "
                                  "same base model and engine settings")
        for key in SANDBOX_KEYS:
            if _value(r, key) != _value(first, key):
                raise ConfigError(f"{r.source}: {key}: {_value(r, key)!r}, while {first.source} has "
                                  f"{_value(first, key)!r}: runs sharing an explorer share its process, and the "
                                  "python tool's code of one run could reach the others' unless every run "
                                  "isolates it alike")
        for key, value in (("run.name", r.run.name), ("kafka.topic_prefix", r.kafka.topic_prefix or r.run.name),
                           ("sync.weight_store", os.path.realpath(r.store))):
            if (key, value) in seen:
                raise ConfigError(f"{r.source}: {key}: {value!r} is also {seen[key, value]}'s: each config given to "
                                  "one explorer must be another run, with topics and a weight store of its own")
            seen[key, value] = r.source


def _check_run(r: SharedRun) -> None:
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{r.source}: {key}: {message} (an explorer serving several runs: docs/lora.md)")

    require(mode(r.run.mode).explorers, "run.mode", f"mode {r.run.mode} runs no explorers")
    require(r.model.lora.rank > 0, "model.lora.rank", "must be > 0: one engine serves several runs only as LoRA "
            "adapters of the base they share")
    require(r.explorer.engine == "vllm", "explorer.engine", f"must be vllm (LoRA adapters side by side in one "
            f"engine), got {r.explorer.engine}")
    require(r.sync.method == "pull", "sync.method", "must be pull: a push group drives the whole engine, which "
            "other runs share")
    require(not r.explorer.continuous, "explorer.continuous", "must be false: the continuous loop steps the engine "
            "itself, which other runs share")


def engine_sections(runs: Sequence[SharedRun]) -> tuple[ExplorerConfig, ModelConfig]:
    """The sections the shared engine is built from: the first run's explorer section and the model section of the
    run with the largest LoRA rank (the engine takes adapters up to it; the keys the engine reads otherwise agree,
    `check_runs`), without its `lora.init_from`: each run's starting adapter is its own slot's version 0, loaded into
    that slot (`run_shared`), never the engine's default adapter, which a slot without an adapter would use."""
    model = max(runs, key=lambda r: r.model.lora.rank).model
    return runs[0].explorer, dataclasses.replace(model, lora=dataclasses.replace(model.lora, init_from=""))


def run_explorers(explorers: Sequence[Explorer], stop: threading.Event,
                  exit_when_idle_s: Sequence[float | None]) -> dict[str, str]:
    """Each explorer's `run(stop, exit_when_idle_s=...)` in a thread named after its run, then its `close(reason)`;
    returns run -> reason ("stopped", "idle", "error") once every thread has ended. An error in one sets `stop` (the
    others finish their batch and leave) and is raised at the end. The threads are daemons: a second SIGTERM / Ctrl-C
    (KeyboardInterrupt while this waits) ends the process without waiting for them."""
    reasons: dict[str, str] = {}
    errors: list[BaseException] = []

    def one(explorer: Explorer, idle_s: float | None) -> None:
        reason = "error"
        try:
            reason = explorer.run(stop, exit_when_idle_s=idle_s)
        except BaseException as e:
            log.exception("run %s failed; stopping every run of this explorer", explorer.topics.run)
            errors.append(e)
            stop.set()
        finally:
            reasons[explorer.topics.run] = reason
            explorer.close(reason)
            log.info("run %s: %s after %d groups", explorer.topics.run, reason, explorer.stats.groups)

    threads = [threading.Thread(target=one, args=(e, idle_s), name=e.topics.run, daemon=True)  # a 2nd signal aborts
               for e, idle_s in zip(explorers, exit_when_idle_s, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return reasons
