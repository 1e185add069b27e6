"""The largest experience record a config can produce (`rft validate` prints it), and where its parts go.

A group is one record (rft/schema.py): per sample, int32 prompt and response ids, float32 log-probs, a uint8 loss mask,
per-token weight versions as spans (with in-flight updates), and with `run.routing_replay` the routing map (uint8 or
uint16 ids, positions x MoE layers x top_k, from P - 1 unless `run.routing_prefill`). Every array is one msgpack `bin`
part; a part over `records.claim_threshold_bytes` leaves the record for the claim store (a claim stays in its place),
and a record still over `kafka.max_record_bytes` is claim-checked whole (docs/schema.md). The framing (keys, ids,
scalars) is measured by encoding a one-token group with rft.schema; workflows' free-form metadata is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from rft.models.moe import MoEShape, read_moe_shape
from rft.run.config import Config
from rft.schema import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, ExperienceGroup, RoutedExperts, Sample, encode

CLAIM_TEMPLATE = {"rft-claim": {"sha256": "0" * 64, "size": 2**32, "codec": "none"}}  # the wire form, a large size
VERSION_SPAN_BYTES = 11  # one [version, first token] span: a fixarray of two uint32 at most
TASK_ID_CHARS = 24  # room for the task ids data sets write


@dataclass(frozen=True)
class RecordEstimate:
    """The largest group: `samples` x (`prompt_tokens` + `response_tokens`); `parts`: the byte size of each `bin`
    part of one sample (name -> bytes); `framing`: everything else in the record, all samples."""
    samples: int
    prompt_tokens: int
    response_tokens: int
    parts: dict[str, int]
    framing: int
    moe: MoEShape | None = None

    @property
    def inline_bytes(self) -> int:
        """The record with every part inline (no claim-check)."""
        return self.framing + self.samples * sum(self.parts.values())

    @property
    def routing_bytes(self) -> int:
        return self.samples * self.parts.get("routed_experts", 0)

    def claimed_bytes(self, threshold: int) -> int:
        """The record once every part over `threshold` (> 0) is a claim."""
        per_sample = sum(size if size <= threshold else claim_bytes() for size in self.parts.values())
        return self.framing + self.samples * per_sample

    def claimed_parts(self, threshold: int) -> list[str]:
        return [name for name, size in self.parts.items() if threshold and size > threshold]


def claim_bytes() -> int:
    """The bytes a claim takes in a record instead of its part (the map, with a large size)."""
    return len(msgpack.packb(CLAIM_TEMPLATE, use_bin_type=True))


def _bin_bytes(n: int) -> int:
    """A msgpack `bin` of `n` bytes: its header and the bytes."""
    return n + (2 if n < 1 << 8 else 3 if n < 1 << 16 else 5)


def image_parts(cfg: Config) -> dict[str, int]:
    """Hook for images: {part name: bytes} that a sample's images add. None yet: records carry no images."""
    return {}


def response_tokens(cfg: Config) -> int:
    """The longest response: explorer.max_tokens (capped by model.max_response_len) for a single-turn workflow; any
    other workflow's response (model and environment turns) fills up to model.max_response_len."""
    if cfg.explorer.workflow == "single_turn":
        return min(cfg.explorer.max_tokens, cfg.model.max_response_len)
    return cfg.model.max_response_len


def samples_per_group(cfg: Config) -> int:
    """The most samples a group holds: explorer.n_samples, but for agent_program one per branch of each episode, at
    most one per model call (explorer.agent_max_calls)."""
    if cfg.explorer.workflow == "agent_program":
        return cfg.explorer.n_samples * cfg.explorer.agent_max_calls
    return cfg.explorer.n_samples


def version_spans(cfg: Config) -> int:
    """Spans of per-token versions a sample may carry: one without in-flight updates (none written); with them, one
    per version a sample can see while it generates (the run's staleness bound + 1)."""
    if not cfg.explorer.inflight_updates:
        return 0
    bound = cfg.run.max_staleness if cfg.run.mode != "async" else (cfg.run.async_max_staleness or 8)
    return bound + 1


def estimate_record(cfg: Config, moe: MoEShape | None = None) -> RecordEstimate:
    """The largest experience record of `cfg`. `moe`: the model's MoE layers (default: read from model.path's
    config.json when run.routing_replay; a model without experts records no routing)."""
    n, prompt, response = samples_per_group(cfg), cfg.model.max_prompt_len, response_tokens(cfg)
    parts = {"prompt_tokens": _bin_bytes(prompt * TOKEN_DTYPE.itemsize),
             "response_tokens": _bin_bytes(response * TOKEN_DTYPE.itemsize),
             "logprobs": _bin_bytes(response * LOGPROB_DTYPE.itemsize),
             "loss_mask": _bin_bytes(response * MASK_DTYPE.itemsize)}
    if cfg.run.routing_replay and moe is None:
        moe = read_moe_shape(cfg.model.path)
    routing = moe if cfg.run.routing_replay else None
    if routing is not None:
        positions = prompt + response - 1 - RoutedExperts.start(prompt, cfg.run.routing_prefill)
        width = RoutedExperts.dtype_for(routing.num_experts).itemsize
        parts["routed_experts"] = _bin_bytes(positions * len(routing.layers) * routing.top_k * width)
    parts.update(image_parts(cfg))
    framing = _framing(cfg, n, routing) + n * version_spans(cfg) * VERSION_SPAN_BYTES
    return RecordEstimate(samples=n, prompt_tokens=prompt, response_tokens=response, parts=parts, framing=framing,
                          moe=routing)


def _framing(cfg: Config, n: int, moe: MoEShape | None) -> int:
    """The encoded bytes of a group of `n` tiny samples, less its `bin` parts."""
    def sample(j: int) -> Sample:  # a one-token prompt, a two-token response: two input positions
        routed = None
        if moe is not None:
            ids = np.zeros((2, len(moe.layers), moe.top_k), RoutedExperts.dtype_for(moe.num_experts))
            routed = RoutedExperts(ids=ids, num_experts=moe.num_experts, layers=list(moe.layers))
        return Sample(sample_index=j, prompt_tokens=np.zeros(1, np.int32), response_tokens=np.zeros(2, np.int32),
                      logprobs=np.full(2, -1.5, np.float32), loss_mask=np.ones(2, np.uint8), reward=0.5,
                      finish_reason="length", routed_experts=routed)

    task = "t" * TASK_ID_CHARS
    group = ExperienceGroup(run_id=cfg.run.name, task_id=task, group_id=f"{cfg.run.name}/{task}/e0", attempt=0,
                            explorer_id="explorer-000", policy_version=2**31 - 1,
                            samples=[sample(j) for j in range(n)])
    value, _ = encode(group)
    one = group.samples[0]
    bins = _bin_bytes(4) + _bin_bytes(8) * 2 + _bin_bytes(2)
    if one.routed_experts is not None:
        bins += _bin_bytes(one.routed_experts.ids.nbytes)
    return len(value) - n * bins


def whole_body_claim_bytes(cfg: Config) -> int:
    """A record whose whole body is claim-checked: `schema`, `type`, `run_id`, `group_id` and the claim."""
    task = "t" * TASK_ID_CHARS
    return len(msgpack.packb({"schema": 2**16, "type": "experience", "run_id": cfg.run.name,
                              "group_id": f"{cfg.run.name}/{task}/e0", **CLAIM_TEMPLATE}, use_bin_type=True))


def size_text(n: int) -> str:
    """Bytes for people: B, KB, MB, GB (powers of 10)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def claim_store_text(cfg: Config) -> str:
    store = cfg.records.store
    return f"records.store {store}" if store else \
        f"records.store: beside the weights, {cfg.sync.weight_store or '<run dir>/weights'}/records"


def describe(cfg: Config, estimate: RecordEstimate) -> tuple[list[str], list[str]]:
    """(lines, warnings) for `rft validate`: the largest record, inline and with the claim-check."""
    e, limit, threshold = estimate, cfg.kafka.max_record_bytes, cfg.records.claim_threshold_bytes
    tokens = e.prompt_tokens + e.response_tokens
    routing = ""
    if e.moe is not None:
        width = RoutedExperts.dtype_for(e.moe.num_experts).itemsize
        start = "the prompt's first position" if cfg.run.routing_prefill else "the last prompt position"
        routing = (f" (routing {size_text(e.routing_bytes)}: {len(e.moe.layers)} MoE layers x top-{e.moe.top_k} x "
                   f"{width} byte{'s' if width > 1 else ''} a position, from {start})")
    lines = [f"largest experience record: {e.samples} samples x {tokens:,} tokens ({e.prompt_tokens:,} prompt + "
             f"{e.response_tokens:,} response): {size_text(e.inline_bytes)} inline{routing}"]
    warnings = []
    claimed = e.claimed_parts(threshold)
    if not threshold:
        if e.inline_bytes > limit:
            warnings.append(f"the largest record ({size_text(e.inline_bytes)}) is over kafka.max_record_bytes "
                            f"({limit:,}) and records.claim_threshold_bytes is 0: every group will be dead-lettered "
                            "as too large: set records.claim_threshold_bytes")
        else:
            lines.append(f"inline, under kafka.max_record_bytes ({limit:,}); records.claim_threshold_bytes 0: no "
                         "claim-check")
        return lines, warnings
    record = e.claimed_bytes(threshold)
    if claimed:
        lines.append(f"parts over records.claim_threshold_bytes ({threshold:,}) go to the claim store "
                     f"({claim_store_text(cfg)}): {', '.join(claimed)}: record ~{size_text(record)}")
    if record > limit:
        lines.append(f"{'still ' if claimed else ''}over kafka.max_record_bytes ({limit:,}) at "
                     f"{size_text(record)}: the body, its parts claimed, goes to the claim store whole: record ~"
                     f"{size_text(whole_body_claim_bytes(cfg))}")
    elif not claimed:
        lines.append(f"inline, under kafka.max_record_bytes ({limit:,}); no part over "
                     f"records.claim_threshold_bytes ({threshold:,})")
    return lines, warnings
