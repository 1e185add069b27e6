"""`rft bench experience`: the experience path at fleet scale, a model (docs/scaling.md, "The experience path at
scale"): what N explorers' groups cost the broker and the claim store, inline and claim-checked.

Per explorer, a group every `1 / rate` seconds, two ways:
- stage times: the flagship's measured 2.3 s a group (configs/stages-smollm2.json, docs/scaling.md), applied to
  groups of 1,024-token responses: the high-rate, short-trace end;
- long traces: an engine decoding `tokens_s` tokens a second (assumed 2,500 for Qwen3-30B-A3B on one GPU with many
  sequences in flight) makes a group of `samples` x T tokens every samples x T / tokens_s seconds (16k: 52 s).
Records are benchmarks/transport_sizes.py's groups (8 samples, a 512-token prompt, int32 tokens, float32
log-probs, a uint8 mask; routing maps of Qwen3-30B-A3B from the last prompt position: 384 bytes a token), sized
by msgpack's framing as rft.schema encodes them. Claim-checked as rft/transport/claims.py `check_out` does with
`threshold` (records.claim_threshold_bytes) and `limit` (kafka.max_record_bytes): each part over the threshold
becomes a claim of CLAIM_BYTES (the group's shared prompt is stored once); a record still over the limit is stored
whole with its parts claimed (one more put, of the claimed body; a reader gets it, then its parts) and a stub of
STUB_BYTES goes on the topic. Store bytes are payload bytes before zstd (an upper bound: routing maps compress ~15%,
`rft bench transport --sizes`).

Per fleet of N explorers, with W = N x rate x record bytes (what the explorers produce):
    broker in  = replication x W                       (the leaders' writes and the followers' copies)
    broker out = (readers + replication - 1) x W       (each reader reads each record once; followers fetch)
    partitions = ceil(W / partition_mb_s)              (a conservative produce throughput per partition)
    store puts/s = N x rate x puts per group, and their bytes; gets/s = readers x N x rate x claims per record
`readers`: the trainer, plus the task publisher when it reads the experiences online (it resolves claims too).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

SAMPLES, PROMPT_TOKENS = 8, 512
TOKEN_BYTES, LOGPROB_BYTES, MASK_BYTES = 4, 4, 1
ROUTING_BYTES = 48 * 8  # Qwen3-30B-A3B: 48 MoE layers x top-8, uint8 ids
GROUP_FRAMING, SAMPLE_FRAMING, ROUTING_FRAMING = 200, 140, 136  # msgpack keys and scalars (measured on rft.schema)
CLAIM_BYTES = 106  # a claim map in place of a part
STUB_BYTES = 180  # a whole-body stub (its value; key and headers add ~60 bytes on the topic)
MB = 1e6


@dataclass(frozen=True)
class Assumptions:
    """What the model assumes (docs/scaling.md says why); each is a flag of `rft bench experience`."""
    stage_group_s: float = 2.3  # the flagship's seconds per group per explorer (configs/stages-smollm2.json)
    tokens_s: float = 2500.0  # a long-trace explorer's decode rate, tokens/s
    replication: int = 3  # kafka.replication_factor on a production cluster
    readers: int = 2  # the trainer and the online task publisher
    partition_mb_s: float = 10.0  # produce throughput one partition takes, conservatively
    threshold: int = 131072  # records.claim_threshold_bytes
    limit: int = 1_000_000  # kafka.max_record_bytes (a default broker's message.max.bytes)


@dataclass(frozen=True)
class Record:
    """One group's sizes: inline, on the topic when claim-checked, and what the claim-check stores."""
    inline_bytes: int
    claimed_bytes: int  # on the topic with the claim-check
    puts: int  # objects put per group
    put_bytes: int
    claims: int  # objects a reader gets per record (a stub's body, then its parts)
    get_bytes: int  # what a reader fetches


def parts(tokens: int, routing: bool) -> list[int]:
    """One sample's binary parts (prompt, response tokens, log-probs, mask[, routing ids]), bytes."""
    out = [PROMPT_TOKENS * TOKEN_BYTES, tokens * TOKEN_BYTES, tokens * LOGPROB_BYTES, tokens * MASK_BYTES]
    return out + [tokens * ROUTING_BYTES] if routing else out


def record(tokens: int, routing: bool, threshold: int, limit: int) -> Record:
    """The sizes of a group of SAMPLES responses of `tokens` tokens (module docstring)."""
    sample = parts(tokens, routing)
    inline = GROUP_FRAMING + SAMPLES * (SAMPLE_FRAMING + sum(sample) + (ROUTING_FRAMING if routing else 0))
    if threshold <= 0:
        return Record(inline, inline, 0, 0, 0, 0)
    claimed = [i for i, n in enumerate(sample) if n > threshold]
    refs = SAMPLES * len(claimed)
    distinct = [(1 if i == 0 else SAMPLES) * sample[i] for i in claimed]  # the shared prompt is stored once
    puts = sum(1 if i == 0 else SAMPLES for i in claimed)
    on_topic = inline - sum(SAMPLES * sample[i] for i in claimed) + refs * CLAIM_BYTES
    if on_topic <= limit:
        return Record(inline, on_topic, puts, sum(distinct), refs, sum(SAMPLES * sample[i] for i in claimed))
    fetched = sum(SAMPLES * sample[i] for i in claimed)  # the body stored whole holds the parts' claims
    return Record(inline, STUB_BYTES, puts + 1, sum(distinct) + on_topic, 1 + refs, on_topic + fetched)


@dataclass(frozen=True)
class Workload:
    name: str
    tokens: int
    group_s: float  # seconds per group per explorer


def workloads(a: Assumptions) -> list[Workload]:
    """Stage times (1k tokens) and long traces (16k, 32k tokens) at `a`'s rates."""
    return [Workload("stage times", 1024, a.stage_group_s),
            *[Workload("long traces", t, SAMPLES * t / a.tokens_s) for t in (16384, 32768)]]


def fleet_row(explorers: int, work: Workload, routing: bool, a: Assumptions) -> dict:
    """The broker's and the store's load for `explorers` explorers of `work` (module docstring), MB/s."""
    rate = explorers / work.group_s
    rec = record(work.tokens, routing, a.threshold, a.limit)

    def broker(record_bytes: int) -> dict:
        w = rate * record_bytes / MB
        return {"in_mb_s": a.replication * w, "out_mb_s": (a.readers + a.replication - 1) * w,
                "partitions": max(1, math.ceil(w / a.partition_mb_s))}

    return {"explorers": explorers, "workload": work.name, "tokens": work.tokens, "routing": routing,
            "group_s": work.group_s, "groups_s": rate, "inline_bytes": rec.inline_bytes,
            "claimed_bytes": rec.claimed_bytes, "inline": broker(rec.inline_bytes),
            "claim_check": broker(rec.claimed_bytes),
            "store": {"puts_s": rate * rec.puts, "put_mb_s": rate * rec.put_bytes / MB,
                      "gets_s": a.readers * rate * rec.claims, "get_mb_s": a.readers * rate * rec.get_bytes / MB}}


FLEETS = (64, 256, 1024)


def table(a: Assumptions) -> list[dict]:
    return [fleet_row(n, w, routing, a) for w in workloads(a) for routing in (False, True) for n in FLEETS]


def _mb(x: float) -> str:
    return f"{x / 1000:.1f} GB/s" if x >= 1000 else f"{x:.3g} MB/s" if x >= 0.1 else f"{x * 1000:.2g} KB/s"


def _bytes(n: int) -> str:
    return f"{n / MB:.2f} MB" if n >= 100_000 else f"{n:,} B"


def markdown(rows: list[dict], a: Assumptions) -> str:
    lines = ["| workload | tokens | routing | explorers | groups/s | record inline | broker in / out inline | "
             "partitions inline | record claim-checked | broker in / out claim-checked | partitions | "
             "store puts/s (in) | store gets/s (out) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        inline, claimed, store = r["inline"], r["claim_check"], r["store"]
        over = " (over the limit)" if r["inline_bytes"] > a.limit else ""
        lines.append(
            f"| {r['workload']} ({r['group_s']:.3g} s/group) | {r['tokens']:,} | {'yes' if r['routing'] else 'no'} | "
            f"{r['explorers']:,} | {r['groups_s']:.3g} | {_bytes(r['inline_bytes'])}{over} | "
            f"{_mb(inline['in_mb_s'])} / {_mb(inline['out_mb_s'])} | {inline['partitions']} | "
            f"{_bytes(r['claimed_bytes'])} | {_mb(claimed['in_mb_s'])} / {_mb(claimed['out_mb_s'])} | "
            f"{claimed['partitions']} | {store['puts_s']:.3g} ({_mb(store['put_mb_s'])}) | "
            f"{store['gets_s']:.3g} ({_mb(store['get_mb_s'])}) |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench experience", description=__doc__.splitlines()[0])
    for name, value in asdict(Assumptions()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    a = Assumptions(**{name: getattr(args, name) for name in asdict(Assumptions())})
    rows = table(a)
    print(json.dumps({"assumptions": asdict(a), "rows": rows}) if args.json else markdown(rows, a))
    return 0
