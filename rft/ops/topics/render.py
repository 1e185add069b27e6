"""Human views of topic records: one message's position, time, key and headers; a record's type, ids and
policy version; its content (prompt/response text with a tokenizer, token ids without). Shared by
`rft topics tail` (printed lines) and `rft topics export --decoded` (JSON lines). Functions of a Message and, for a
claim-checked record (rft/transport/claims.py), a claim store: its claims are listed (SHA-256 prefix, size) and,
given a store, fetched, verified and the record shown whole; without one, what the record itself holds (its ids,
or a whole-body stub's) is shown and nothing is fetched."""
from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import msgpack

from rft.schema import (
    HEADER_ERROR,
    ControlMessage,
    ExperienceGroup,
    Feedback,
    RecordError,
    ServedCompletion,
    TaskRecord,
    decode,
)
from rft.text.tokens import Detokenizer
from rft.transport import ClaimStore, Message, claims_in, resolve_claims

TOKENS_SHOWN = 32  # token ids printed per array when no tokenizer is given
CLAIMS_SHOWN = 8  # claims listed per record on a tail line
SHA_SHOWN = 12  # hex digits of a claim's SHA-256 shown
IDS = ("type", "run_id", "group_id", "task_id", "explorer_id", "policy_version", "attempt", "request_id")


def iso_time(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def printable(data: bytes | None) -> str | None:
    """Bytes as text when they are UTF-8, else as `base64:...`."""
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(data).decode()


def message_view(m: Message) -> dict[str, Any]:
    return {"partition": m.partition, "offset": m.offset, "timestamp_ms": m.timestamp_ms,
            "timestamp": iso_time(m.timestamp_ms), "key": printable(m.key), "size": len(m.value or b""),
            "headers": {name: printable(value) for name, value in m.headers}}


Record = TaskRecord | ExperienceGroup | ControlMessage | ServedCompletion | Feedback  # what rft.schema.decode returns


def record_summary(record: Record) -> dict[str, Any]:
    """Type, ids and policy version: what identifies a record, without its content."""
    if isinstance(record, ExperienceGroup):
        return {"type": "experience_group", "policy_version": record.policy_version, "group_id": record.group_id,
                "task_id": record.task_id, "run_id": record.run_id, "explorer_id": record.explorer_id,
                "attempt": record.attempt, "n_samples": len(record.samples)}
    if isinstance(record, TaskRecord):
        return {"type": "task", "group_id": record.group_id, "task_id": record.task_id, "run_id": record.run_id,
                "epoch": record.epoch}
    if isinstance(record, ServedCompletion):
        return {"type": "served", "policy_version": record.policy_version, "request_id": record.request_id,
                "run_id": record.run_id, "model": record.model, "n_choices": len(record.choices)}
    if isinstance(record, Feedback):
        return {"type": "feedback", "request_id": record.request_id, "run_id": record.run_id, "index": record.index,
                "reward": record.reward}
    return {"type": "control", "kind": record.kind, "sender": record.sender}



def _tokens_or_text(name: str, tokens, detok: Detokenizer) -> dict[str, Any]:
    text = detok.text(tokens)
    if text is not None:
        return {name: text}
    return {f"{name}_tokens": [int(t) for t in tokens]}


def record_content(record: Record, detok: Detokenizer) -> dict[str, Any]:
    """The human-readable content: prompt/response text (token ids without a tokenizer), rewards."""
    if isinstance(record, TaskRecord):
        return {"prompt": record.prompt, "answer": record.answer, "metadata": record.metadata,
                "created_at": record.created_at}
    if isinstance(record, ControlMessage):
        return {"body": record.body, "created_at": record.created_at}
    if isinstance(record, Feedback):
        return {"reward": record.reward, "components": record.components, "created_at": record.created_at}
    if isinstance(record, ServedCompletion):
        choices = [{"index": c.index, "finish_reason": c.finish_reason, "response_len": len(c.response_tokens),
                    **_tokens_or_text("response", c.response_tokens, detok)} for c in record.choices]
        return {**_tokens_or_text("prompt", record.prompt_tokens, detok), "metadata": record.metadata,
                "created_at": record.created_at, "choices": choices}
    samples = []
    for s in record.samples:
        samples.append({
            "sample_index": s.sample_index, "reward": s.reward, "reward_components": s.reward_components,
            "finish_reason": s.finish_reason, "prompt_len": len(s.prompt_tokens),
            "response_len": len(s.response_tokens), "loss_tokens": int(s.loss_mask.sum()),
            "mean_logprob": float(s.logprobs.mean()) if len(s.logprobs) else None,
            **_tokens_or_text("prompt", s.prompt_tokens, detok),
            **_tokens_or_text("response", s.response_tokens, detok), "metadata": s.metadata})
    return {"rewards": [s.reward for s in record.samples], "answer": record.answer, "metadata": record.metadata,
            "created_at": record.created_at, "samples": samples}


def claims_view(value: bytes | None) -> list[dict[str, Any]]:
    """The claims a record carries ({"sha256", "size", "codec"}, in body order); [] for none, or for a value whose
    claims are malformed (decoding it then says what is wrong)."""
    try:
        return [{"sha256": c.sha256, "size": c.size, "codec": c.codec} for c in claims_in(value or b"")]
    except RecordError:
        return []


def claimed_summary(value: bytes) -> dict[str, Any]:
    """What a claim-checked record says of itself without its claims fetched: the ids at the top of its body (a
    whole-body stub keeps type, run_id, group_id) and its number of samples; {} when the body is not a msgpack map."""
    try:
        body = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types for garbage; decoding reports it
        return {}
    if not isinstance(body, dict):
        return {}
    out = {k: body[k] for k in IDS if isinstance(body.get(k), (str, int)) and not isinstance(body.get(k), bool)}
    if isinstance(body.get("samples"), list):
        out["n_samples"] = len(body["samples"])
    return out


def _with_claims(m: Message, claims: ClaimStore | None, shown: Callable[[Message], Any],
                 unresolved: Callable[[list[dict[str, Any]], str], Any]) -> Any:
    """`shown(m)` for a record without claims, or with them resolved from `claims`; else `unresolved(claim views,
    why)` (no store, or one that cannot give back the parts)."""
    held = claims_view(m.value)
    if not held:
        return shown(m)
    if claims is None:
        return unresolved(held, "not fetched (-c CONFIG or --claims STORE fetches them)")
    try:
        return shown(resolve_claims(m, claims))
    except RecordError as e:
        return unresolved(held, f"not resolved: {e}")


def decoded_view(m: Message, detok: Detokenizer, claims: ClaimStore | None = None) -> dict[str, Any]:
    """The message, its record's summary and content; a claim-checked record's `claims` listed, its parts fetched
    from `claims` (module docstring)."""
    view = message_view(m)
    held = claims_view(m.value)
    listed = {"claims": held} if held else {}

    def shown(inline: Message) -> dict[str, Any]:
        try:
            record = decode(inline.value, inline.headers)
        except RecordError as e:
            return {**view, **listed, "error": str(e)}
        return {**view, **listed, **record_summary(record), **record_content(record, detok)}

    return _with_claims(m, claims, shown, lambda found, why: {**view, **claimed_summary(m.value or b""),
                                                              "claims": found, "claims_status": why})


def json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "base64:" + base64.b64encode(bytes(value)).decode()
    return str(value)



def claim_line(held: list[dict[str, Any]]) -> str:
    """`claims: N (B bytes): <sha256 prefix> <size> B [zstd], ...`"""
    shown = ", ".join(f"{c['sha256'][:SHA_SHOWN]} {c['size']} B" + (" zstd" if c["codec"] == "zstd" else "")
                      for c in held[:CLAIMS_SHOWN])
    more = f", ... ({len(held) - CLAIMS_SHOWN} more)" if len(held) > CLAIMS_SHOWN else ""
    return f"  claims: {len(held)} ({sum(c['size'] for c in held)} bytes): {shown}{more}"


def format_message(m: Message, detok: Detokenizer | None, claims: ClaimStore | None = None) -> str:
    """A few lines per record: position, time, key, size and headers; its claims, if claim-checked (fetched from
    `claims` when given); type, ids and policy version; with a detokenizer (`--decode`) also the content."""
    view = message_view(m)
    lines = [f"{m.topic}:{m.partition}@{m.offset}  {view['timestamp']}  key={view['key']}  {view['size']} bytes",
             "  headers: " + (" ".join(f"{k}={v}" for k, v in view["headers"].items()) or "(none)")]
    if held := claims_view(m.value):
        lines.append(claim_line(held))

    def shown(inline: Message) -> str:
        try:
            record = decode(inline.value, inline.headers)
        except RecordError as e:
            lines.append(f"  not a valid rft record: {e}")
            if HEADER_ERROR in view["headers"]:
                lines.append(f"  dead-letter reason: {view['headers'][HEADER_ERROR]}")
            return "\n".join(lines)
        lines.append("  " + "  ".join(f"{k}={v}" for k, v in record_summary(record).items()))
        if detok is not None:
            lines.extend(f"  {line}" for line in _content_lines(record_content(record, detok)))
        return "\n".join(lines)

    def unresolved(_: list[dict[str, Any]], why: str) -> str:
        summary = claimed_summary(m.value or b"")
        lines.append("  " + "  ".join(f"{k}={v}" for k, v in summary.items()) + f"  (claim-checked parts {why})")
        if HEADER_ERROR in view["headers"]:
            lines.append(f"  dead-letter reason: {view['headers'][HEADER_ERROR]}")
        return "\n".join(lines)

    return _with_claims(m, claims, shown, unresolved)


def _content_lines(content: dict[str, Any]) -> list[str]:
    lines, last_prompt = [], None
    for key, value in content.items():
        if key == "samples":
            for s in value:
                lines.append(f"sample {s['sample_index']}: reward={s['reward']:g} {s['reward_components'] or ''} "
                             f"finish={s['finish_reason']} response_len={s['response_len']} "
                             f"mean_logprob={_fmt(s['mean_logprob'])}")
                prompt = s.get("prompt", s.get("prompt_tokens"))
                parts = ("prompt", "response") if prompt != last_prompt else ("response",)  # GRPO: one prompt
                last_prompt = prompt
                lines += [f"  {line}" for line in _text_lines(s, parts)]
        elif key != "created_at":
            lines.append(f"{key}: {json.dumps(value, ensure_ascii=False, default=json_default)}")
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _text_lines(sample: dict[str, Any], parts: tuple[str, ...]) -> list[str]:
    lines = []
    for part in parts:
        if part in sample:
            lines.append(f"{part}: {sample[part]!r}")
        else:
            ids = sample[f"{part}_tokens"]
            more = f" ... ({len(ids)} tokens; --tokenizer DIR shows text)" if len(ids) > TOKENS_SHOWN else ""
            lines.append(f"{part} tokens: {ids[:TOKENS_SHOWN]}{more}")
    return lines
