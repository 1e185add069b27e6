"""`rft bench transport --sizes`: experience groups at production size through a broker that enforces Kafka's
message size limit, sent whole (inline) against claim-checked (rft/transport/claims.py).

The broker is the local one behind its size-limit proxy (`LocalBroker(max_message_bytes=1000000)`: a record batch
over 1,000,000 bytes is refused with MESSAGE_TOO_LARGE, as a default Kafka broker does), and the sinks' limit
(kafka.max_record_bytes) is the same. Per cell (response length x routing maps x inline / claim-check):
- produce: `RecordSink.send_record` of each group (encode, the claim-check's put of its large parts into a
  directory store in a temporary directory, send), then `flush` (every record acknowledged): what an explorer does;
- consume: a fresh `RecordSource` reads the topic from its beginning; each record goes through `resolve_claims`
  (fetch and verify its parts) and `decode_group`: what the trainer's feed does. Each group read back is checked
  (its id, its first response token, its routing map's shape).
Groups are built before the clock starts (not encoded: encoding is part of producing). A cell whose record cannot
be sent inline (over the limit) is reported "refused: over N bytes" with its size, not run.

The groups: 8 samples sharing one 512-token prompt; each sample a response of T tokens (1,024, 16,384, 32,768),
token ids drawn Zipf-like (exponent 1.3) over Qwen3's 151,936-token vocabulary through a fixed permutation, log-probs
float32 from a gamma distribution (most near 0, a long tail: -Gamma(0.3, 1.5)), the loss mask all ones. Routing
maps are Qwen3-30B-A3B's shape: 48 MoE layers, top-8 of 128 experts, uint8 ids, recorded from the last prompt
position (T rows: 384 bytes a token); each token's 8 ids are distinct, one per 16-wide band offset by a random base
(39 bits of entropy per token and layer, about what a real top-8 of 128 has: log2 C(128, 8) = 40). Each group's
arrays are distinct slices of per-sample pools (no two groups store the same object).

MB are 10^6 bytes of the groups' inline encoding (what the consumer decodes), whatever the topic carried; the
store's MB are the bytes of its objects (zstd-compressed when that is shorter). Rates are each phase's own (the
explorer and the trainer run on other machines; a pipeline runs at the slower of the two).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rft.broker.local import LocalBroker
from rft.schema import ExperienceGroup, RoutedExperts, Sample, decode_group, encode
from rft.transport import Claim, ClaimStore, RecordTooLarge, connect, record_size, resolve_claims
from rft.transport.config import KafkaConfig

BROKER_LIMIT = 1_000_000  # a default Kafka broker's message.max.bytes
SAMPLES = 8
PROMPT_TOKENS = 512
VOCAB = 151_936  # Qwen3
MOE_LAYERS, TOP_K, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B
TOKENS = (1024, 16384, 32768)
QUICK_TOKENS = (1024, 16384)
PATHS = ("inline", "claim-check")
THRESHOLD = 131072  # records.claim_threshold_bytes' default


@dataclass(frozen=True)
class Shape:
    tokens: int  # response tokens per sample
    routing: bool


@dataclass
class CellResult:
    tokens: int
    routing: bool
    path: str
    group_bytes: int  # one group's inline encoding
    refused: str = ""  # why the cell was not run ("" when it was)
    groups: int = 0
    record_bytes: float = 0.0  # mean bytes a record took on the topic (value, key, headers)
    produce_s: float = 0.0
    consume_s: float = 0.0
    produce_groups_s: float = 0.0
    produce_mb_s: float = 0.0
    consume_groups_s: float = 0.0
    consume_mb_s: float = 0.0
    puts: int = 0
    put_mb: float = 0.0
    gets: int = 0
    get_mb: float = 0.0
    puts_s: float = 0.0  # store requests/s while producing
    put_mb_s: float = 0.0
    gets_s: float = 0.0  # while consuming
    get_mb_s: float = 0.0


class CountingClaimStore(ClaimStore):
    """A directory ClaimStore that counts its puts and gets and the bytes of the objects they wrote and read."""

    def __init__(self, location: str | os.PathLike, *, threshold: int):
        super().__init__(location, threshold=threshold)
        self.puts = self.gets = self.put_bytes = self.get_bytes = 0
        self._count_lock = threading.Lock()

    def _object_bytes(self, claim: Claim) -> int:
        return os.path.getsize(Path(self.location) / claim.key)

    def put(self, payload: bytes) -> Claim:
        claim = super().put(payload)
        size = self._object_bytes(claim)
        with self._count_lock:
            self.puts, self.put_bytes = self.puts + 1, self.put_bytes + size
        return claim

    def get(self, claim: Claim) -> bytes:
        payload = super().get(claim)
        size = self._object_bytes(claim)
        with self._count_lock:
            self.gets, self.get_bytes = self.gets + 1, self.get_bytes + size
        return payload


class GroupMaker:
    """Groups of one shape (module docstring), group i distinct from every other: its arrays are slices starting at
    row i of per-sample pools `count` rows longer than a response."""

    def __init__(self, shape: Shape, count: int, *, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.shape, self.count = shape, count
        vocab = rng.permutation(VOCAB).astype(np.int32)
        pool = shape.tokens + count
        self.prompt = self._tokens(rng, vocab, PROMPT_TOKENS)
        self.tokens = [self._tokens(rng, vocab, pool) for _ in range(SAMPLES)]
        self.logprobs = [(-rng.gamma(0.3, 1.5, pool)).astype(np.float32) for _ in range(SAMPLES)]
        self.mask = np.ones(shape.tokens, np.uint8)
        self.routing = [self._routing(rng, pool) for _ in range(SAMPLES)] if shape.routing else None

    @staticmethod
    def _tokens(rng: np.random.Generator, vocab: np.ndarray, n: int) -> np.ndarray:
        return vocab[(rng.zipf(1.3, n) - 1) % VOCAB]

    @staticmethod
    def _routing(rng: np.random.Generator, rows: int) -> np.ndarray:
        base = rng.integers(0, EXPERTS, (rows, MOE_LAYERS, 1), dtype=np.uint8)
        bands = (np.arange(TOP_K, dtype=np.uint8) * (EXPERTS // TOP_K))[None, None, :]
        return (base + bands + rng.integers(0, EXPERTS // TOP_K, (rows, MOE_LAYERS, TOP_K), dtype=np.uint8)) \
            & np.uint8(EXPERTS - 1)

    def group(self, i: int) -> ExperienceGroup:
        t = self.shape.tokens
        samples = []
        for j in range(SAMPLES):
            routed = None
            if self.routing is not None:
                routed = RoutedExperts(ids=self.routing[j][i:i + t], num_experts=EXPERTS,
                                       layers=list(range(MOE_LAYERS)), first_position=PROMPT_TOKENS - 1)
            samples.append(Sample(sample_index=j, prompt_tokens=self.prompt, response_tokens=self.tokens[j][i:i + t],
                                  logprobs=self.logprobs[j][i:i + t], loss_mask=self.mask, reward=float(j % 2),
                                  finish_reason="length", routed_experts=routed))
        return ExperienceGroup(run_id="bench", task_id=f"task-{i}", group_id=f"bench/task-{i}/e0", attempt=0,
                               explorer_id="bench-explorer", policy_version=0, samples=samples)


def group_count(group_bytes: int, volume_bytes: float, least: int, most: int) -> int:
    """Groups in a cell: about `volume_bytes` of them, within [least, most]."""
    return max(least, min(most, round(volume_bytes / max(1, group_bytes))))


def run_cell(shape: Shape, path: str, maker: GroupMaker, *, bootstrap: str, cfg: KafkaConfig, work: Path,
             group_bytes: int) -> CellResult:
    """Produce then consume `maker.count` groups of `shape` by `path` on the broker at `bootstrap`."""
    result = CellResult(shape.tokens, shape.routing, path, group_bytes)
    first, headers = encode(maker.group(0))
    inline_size = record_size(first, maker.group(0).group_id.encode(), headers)
    if path == "inline" and inline_size > cfg.max_record_bytes:
        result.refused = f"refused: over {cfg.max_record_bytes} bytes (a record of {inline_size})"
        return result
    store = CountingClaimStore(work / f"store-{shape.tokens}-{int(shape.routing)}", threshold=THRESHOLD) \
        if path == "claim-check" else None
    transport = connect(cfg, bootstrap, claims=store)
    topic = f"bench-sizes-{shape.tokens}-{'routing' if shape.routing else 'plain'}-{path}"
    admin = transport.admin()
    try:
        admin.create_topics([topic], partitions=1)
        groups = [maker.group(i) for i in range(maker.count)]
        sink = transport.sink(client_id="bench-explorer")
        try:
            start = time.perf_counter()
            for g in groups:
                sink.send_record(topic, g, key=g.group_id)
            sink.flush()
            result.produce_s = time.perf_counter() - start
        except RecordTooLarge as e:
            result.refused = f"refused: {e}"
            return result
        finally:
            sink.close()
        put_count, put_bytes = (store.puts, store.put_bytes) if store else (0, 0)
        on_topic = consume(transport.source(client_id="bench-trainer"), topic, groups, store)
        result.consume_s = on_topic.pop()
        result.record_bytes = sum(on_topic) / len(on_topic)
    finally:
        admin.delete_topics([topic])
        admin.close()
    n, mb = len(groups), len(groups) * group_bytes / 1e6
    result.groups = n
    result.produce_groups_s, result.produce_mb_s = n / result.produce_s, mb / result.produce_s
    result.consume_groups_s, result.consume_mb_s = n / result.consume_s, mb / result.consume_s
    if store is not None:
        result.puts, result.put_mb = put_count, put_bytes / 1e6
        result.gets, result.get_mb = store.gets, store.get_bytes / 1e6
        result.puts_s, result.put_mb_s = put_count / result.produce_s, result.put_mb / result.produce_s
        result.gets_s, result.get_mb_s = store.gets / result.consume_s, result.get_mb / result.consume_s
    return result


def consume(source, topic: str, groups: list[ExperienceGroup], store: ClaimStore | None,
            stall_s: float = 60.0) -> list[float]:
    """Read `topic` from its beginning, resolving and decoding each record as the trainer does, checking each
    group against the one sent; the bytes of each record on the topic, then the seconds it took."""
    sizes: list[float] = []
    try:
        source.assign([topic])
        source.seek_to_beginning()
        start = last = time.perf_counter()
        while len(sizes) < len(groups):
            messages = source.poll(timeout_s=1.0)
            for m in messages:
                inline = resolve_claims(m, store)
                got, sent = decode_group(inline.value, inline.headers), groups[len(sizes)]
                if (got.group_id != sent.group_id or int(got.samples[-1].response_tokens[0])
                        != int(sent.samples[-1].response_tokens[0])
                        or (got.samples[0].routed_experts is None) != (sent.samples[0].routed_experts is None)):
                    raise RuntimeError(f"{topic}: record {len(sizes)} read back as {got.group_id}, not as sent "
                                       f"({sent.group_id})")
                sizes.append(record_size(m.value, m.key, m.headers))
            now = time.perf_counter()
            if messages:
                last = now
            elif now - last > stall_s:
                raise RuntimeError(f"{topic}: {len(sizes)} of {len(groups)} groups arrived, then nothing for "
                                   f"{stall_s:.0f} s")
        return [*sizes, time.perf_counter() - start]
    finally:
        source.close()


def run_study(tokens: tuple[int, ...] = TOKENS, *, volume_mb: float = 100.0, least: int = 3, most: int = 200,
              limit: int = BROKER_LIMIT, cfg: KafkaConfig | None = None) -> list[CellResult]:
    """Every cell (module docstring) on one local broker that refuses batches over `limit` bytes."""
    cfg = dataclasses.replace(cfg or KafkaConfig(), max_record_bytes=limit, partitions=1)
    results = []
    with tempfile.TemporaryDirectory(prefix="rft-bench-sizes-") as tmp, \
            LocalBroker(max_message_bytes=limit) as broker:
        for t in tokens:
            for routing in (False, True):
                shape = Shape(t, routing)
                probe = GroupMaker(shape, 1)
                group_bytes = len(encode(probe.group(0))[0])
                maker = GroupMaker(shape, group_count(group_bytes, volume_mb * 1e6, least, most))
                del probe
                for path in PATHS:
                    results.append(run_cell(shape, path, maker, bootstrap=broker.bootstrap_servers, cfg=cfg,
                                            work=Path(tmp), group_bytes=group_bytes))
                    print(f"  {format_row(results[-1])}", file=sys.stderr, flush=True)
    return results


HEADER = (f"{'tokens':>6} {'routing':>7} {'path':<11} {'group MB':>8} {'on topic':>9} {'groups':>6} "
          f"{'produce g/s':>11} {'MB/s':>6} {'consume g/s':>11} {'MB/s':>6} {'puts/s':>7} {'MB/s':>6} "
          f"{'gets/s':>7} {'MB/s':>6}")


def format_row(r: CellResult) -> str:
    lead = f"{r.tokens:>6} {'yes' if r.routing else 'no':>7} {r.path:<11} {r.group_bytes / 1e6:>8.2f}"
    if r.refused:
        return f"{lead} {r.refused}"
    store = (f"{r.puts_s:>7.1f} {r.put_mb_s:>6.1f} {r.gets_s:>7.1f} {r.get_mb_s:>6.1f}" if r.path == "claim-check"
             else f"{'-':>7} {'-':>6} {'-':>7} {'-':>6}")
    return (f"{lead} {r.record_bytes:>9.0f} {r.groups:>6} {r.produce_groups_s:>11.2f} {r.produce_mb_s:>6.1f} "
            f"{r.consume_groups_s:>11.2f} {r.consume_mb_s:>6.1f} {store}")


def markdown(results: list[CellResult]) -> str:
    """The table for docs/benchmarks.md."""
    lines = ["| tokens/sample | routing | path | group MB | bytes/record on topic | groups | produce groups/s (MB/s) "
             "| consume groups/s (MB/s) | store puts/s (MB/s) | store gets/s (MB/s) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lead = f"| {r.tokens:,} | {'yes' if r.routing else 'no'} | {r.path} | {r.group_bytes / 1e6:.2f}"
        if r.refused:
            lines.append(f"{lead} | {r.refused} | | | | | |")
            continue
        store = (f"{r.puts_s:.1f} ({r.put_mb_s:.1f}) | {r.gets_s:.1f} ({r.get_mb_s:.1f})" if r.path == "claim-check"
                 else "- | -")
        lines.append(f"{lead} | {r.record_bytes:,.0f} | {r.groups} | {r.produce_groups_s:.2f} ({r.produce_mb_s:.1f})"
                     f" | {r.consume_groups_s:.2f} ({r.consume_mb_s:.1f}) | {store} |")
    return "\n".join(lines)
