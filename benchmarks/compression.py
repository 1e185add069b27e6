"""`rft bench compression`: bytes on the wire and CPU per experience group for kafka.compression none, gzip, lz4, zstd.

Three kinds of real records, generated here with the transformers engine (real samples and log-probs):

- flagship: the groups of `make quickstart` (configs/smollm2-arithmetic.yaml: SmolLM2-135M-Instruct at
  assets/smollm2-135m-instruct, reasoning-gym two-term arithmetic through the chat template, 8 samples of up to
  `--flagship-tokens` new tokens);
- long: a long-trace group, 8 samples x `--long-tokens` tokens from a tiny random Qwen2 (rft.models.tiny) with a
  2,048-token vocabulary (`LONG_VOCAB`), sampled at temperature 1 (random weights: ids near uniform over the
  vocabulary, log-probs near -log(2048): less regular than a trained model's in their spread, more in their ids'
  width (11 bits, a real vocabulary's 16-18));
- routing: groups of a tiny random Qwen3-MoE with Qwen3-30B-A3B's routing shape (48 MoE layers, 128 experts, top-8:
  384 bytes a position) recording its routing (rft/engine/routing.py, from the last prompt position), 8 samples x
  `--routing-tokens` tokens; the routing map's ids alone are compressed too (`ids` column: "stored compactly").

For each kind and codec: `wire B` is the Kafka v2 record batch kafka-python 3.0.12 builds for one group (what the
producer sends and the broker stores: `MemoryRecordsBuilder` with that codec), `ratio` raw / wire, `codec ms` the CPU
time (this process) to build the batch and read the group back out of it (compress + decompress), `e2e ms` this
process's CPU per group to produce every group through the local broker (Tansu) with `rft.transport` and consume them
back (producer and consumer, the broker's own CPU not counted), best of `--repeat`.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import msgpack
import numpy as np

from rft.broker.local import LocalBroker
from rft.schema import ExperienceGroup, Sample, decode_group, encode
from rft.transport import connect
from rft.transport.config import KafkaConfig

CODECS = {"none": 0, "gzip": 1, "lz4": 3, "zstd": 4}  # kafka-python's record batch codec ids
FLAGSHIP_CONFIG = "configs/smollm2-arithmetic.yaml"
Payload = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers
# the tiny models' vocabulary: HF generate keeps every step's scores (steps x samples x vocab floats: 1 GB for 8 x 16k
# tokens at 2,048), so not a real model's 49-152k; their random weights sample ids across all of it
LONG_VOCAB = 2048


@dataclass
class Row:
    kind: str
    codec: str
    groups: int
    raw_bytes: int  # mean encoded group (the record value)
    wire_bytes: int  # mean record batch of one group
    codec_ms: float
    e2e_ms: float
    routing_raw: int = 0  # mean routing-map ids per group (routing kind)
    routing_wire: int = 0  # those ids compressed with this codec alone

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes


# --------------------------------------------------------------------------------------------------
# records


def group_of(engine, prompt: list[int], n: int, max_tokens: int, index: int, kind: str) -> ExperienceGroup:
    from rft.engine import SamplingSettings

    completions = engine.generate([prompt], SamplingSettings(n=n, max_tokens=max_tokens))[0].completions
    samples = [Sample(sample_index=j, prompt_tokens=np.asarray(prompt, np.int32),
                      response_tokens=np.asarray(c.token_ids, np.int32), logprobs=np.asarray(c.logprobs, np.float32),
                      loss_mask=np.ones(len(c.token_ids), np.uint8), reward=float(j % 2), finish_reason=c.finish_reason,
                      routed_experts=c.routed_experts) for j, c in enumerate(completions)]
    return ExperienceGroup(run_id="bench", task_id=f"{kind}-{index}", group_id=f"bench/{kind}-{index}/e0", attempt=0,
                           explorer_id="bench-explorer", policy_version=0, samples=samples)


def flagship_groups(count: int, max_tokens: int) -> list[ExperienceGroup]:
    from rft.data.gym_tasks import build_dataset
    from rft.engine import TransformersEngine
    from rft.run.config import load_config
    from rft.text.chat import ChatPrompt

    cfg = load_config(FLAGSHIP_CONFIG)
    engine = TransformersEngine(cfg.model.path, seed=0, chat_template=True)
    chat = ChatPrompt.of(cfg.model)
    assert chat is not None
    data = build_dataset(cfg.data.path, dict(cfg.data.options), seed=0, size=count)
    prompts = [engine.encode_chat(cfg.data.prompt_template.format(prompt=data[i]["question"]), chat)
               for i in range(count)]
    return [group_of(engine, p, cfg.explorer.n_samples, max_tokens, i, "flagship") for i, p in enumerate(prompts)]


def tiny_groups(model_dir: Path, count: int, n: int, tokens: int, kind: str, record_routing: bool
                ) -> list[ExperienceGroup]:
    from rft.engine import TransformersEngine

    engine = TransformersEngine(model_dir, seed=0, record_routing=record_routing)
    prompts = [engine.encode(f"Q{i}: think step by step about {i * 7919 % 1000} + {i * 104729 % 1000}. A:")
               for i in range(count)]
    return [group_of(engine, p, n, tokens, i, kind) for i, p in enumerate(prompts)]


def make_records(kinds: list[str], args, work: Path) -> dict[str, list[ExperienceGroup]]:
    from rft.models.tiny import make_tiny_model

    out = {}
    if "flagship" in kinds:
        out["flagship"] = flagship_groups(args.flagship_groups, args.flagship_tokens)
    if "long" in kinds:
        model = make_tiny_model(work / "tiny-long", arch="qwen2", vocab_size=LONG_VOCAB,
                                max_position_embeddings=args.long_tokens + 256)
        out["long"] = tiny_groups(model, args.long_groups, 8, args.long_tokens, "long", False)
    if "routing" in kinds:
        model = make_tiny_model(work / "tiny-moe", arch="qwen3_moe", hidden_size=64, layers=48, heads=2, kv_heads=1,
                                experts=128, experts_per_token=8, moe_intermediate_size=8, intermediate_size=64,
                                vocab_size=LONG_VOCAB, max_position_embeddings=args.routing_tokens + 256)
        out["routing"] = tiny_groups(model, args.routing_groups, 8, args.routing_tokens, "routing", True)
    return out


def payloads(groups: list[ExperienceGroup]) -> list[Payload]:
    out = []
    for g in groups:
        value, headers = encode(g)
        out.append((g.group_id.encode(), value, headers))
    return out


# --------------------------------------------------------------------------------------------------
# measurements


def batch_of(payload: Payload, codec: int) -> bytes:
    """The v2 record batch kafka-python's producer builds for this one record (what goes on the wire)."""
    from kafka.record.memory_records import MemoryRecordsBuilder

    key, value, headers = payload
    builder = MemoryRecordsBuilder(magic=2, compression_type=codec, batch_size=len(value) + (1 << 20))
    builder.append(int(time.time() * 1000), key, value, headers)
    builder.close()
    return bytes(builder.buffer())


def read_batch(batch: bytes) -> bytes:
    """The record value back out of a batch (decompressing it), as a consumer does."""
    from kafka.record.memory_records import MemoryRecords

    return next(iter(MemoryRecords(batch).next_batch())).value


def codec_costs(items: list[Payload], codec: int, repeat: int) -> tuple[int, float]:
    """(mean batch bytes, best mean CPU ms per group to build and read back a batch)."""
    best, sizes = float("inf"), []
    read_batch(batch_of(items[0], codec))  # imports and the codec's first-use set-up, not timed
    for _ in range(repeat):
        start = time.process_time()
        sizes = []
        for item in items:
            batch = batch_of(item, codec)
            if read_batch(batch) != item[1]:
                raise RuntimeError("a record did not read back from its batch as written")
            sizes.append(len(batch))
        best = min(best, (time.process_time() - start) * 1e3 / len(items))
    return int(np.mean(sizes)), best


def end_to_end_ms(broker: LocalBroker, items: list[Payload], codec: str, repeat: int, tag: str) -> float:
    """Best CPU ms per group (this process) producing `items` through the broker with `codec`, then consuming them."""
    cfg = KafkaConfig(partitions=1, compression=None if codec == "none" else codec)  # type: ignore[arg-type]
    best = float("inf")
    for r in range(repeat):
        topic = f"bench-compression-{tag}-{codec}-{r}"
        admin = connect(cfg, broker.bootstrap_servers).admin()
        admin.create_topics([topic], partitions=1)
        start = time.process_time()
        sink = connect(cfg, broker.bootstrap_servers).sink(client_id="bench")
        for key, value, headers in items:
            sink.send(topic, value, key=key, headers=headers)
        sink.flush()
        sink.close()
        source = connect(cfg, broker.bootstrap_servers).source(client_id="bench")
        try:
            got = list(source.read_range(topic))
        finally:
            source.close()
        best = min(best, (time.process_time() - start) * 1e3 / len(items))
        if [m.value for m in got] != [v for _, v, _ in items]:
            raise RuntimeError(f"{topic}: the groups did not read back as sent")
        admin.delete_topics([topic])
        admin.close()
    return best


def routing_ids(groups: list[ExperienceGroup]) -> list[bytes]:
    return [np.ascontiguousarray(s.routed_experts.ids).tobytes() for g in groups for s in g.samples
            if s.routed_experts is not None]


def compressed_size(data: bytes, codec: str) -> int:
    import gzip

    import lz4.frame
    import zstandard

    if codec == "none":
        return len(data)
    if codec == "gzip":
        return len(gzip.compress(data))
    if codec == "lz4":
        return len(lz4.frame.compress(data))
    return len(zstandard.ZstdCompressor().compress(data))


def measure(records: dict[str, list[ExperienceGroup]], repeat: int) -> list[Row]:
    rows = []
    with LocalBroker() as broker:
        for kind, groups in records.items():
            items = payloads(groups)
            raw = int(np.mean([len(v) for _, v, _ in items]))
            ids = routing_ids(groups)
            for codec, code in CODECS.items():
                wire, codec_ms = codec_costs(items, code, repeat)
                e2e = end_to_end_ms(broker, items, codec, repeat, kind)
                rows.append(Row(kind=kind, codec=codec, groups=len(items), raw_bytes=raw, wire_bytes=wire,
                                codec_ms=codec_ms, e2e_ms=e2e,
                                routing_raw=sum(len(b) for b in ids) // len(groups) if ids else 0,
                                routing_wire=sum(compressed_size(b, codec) for b in ids) // len(groups) if ids else 0))
    return rows


def describe_records(records: dict[str, list[ExperienceGroup]]) -> list[str]:
    lines = []
    for kind, groups in records.items():
        s = [s for g in groups for s in g.samples]
        routed = [x.routed_experts for x in s if x.routed_experts is not None]
        shape = f", routing {routed[0].ids.shape[1]} layers x top-{routed[0].ids.shape[2]}" if routed else ""
        lines.append(f"{kind}: {len(groups)} groups x {len(groups[0].samples)} samples, prompt "
                     f"{np.mean([len(x.prompt_tokens) for x in s]):.0f} + response "
                     f"{np.mean([len(x.response_tokens) for x in s]):.0f} tokens (mean){shape}")
    return lines


def print_table(rows: list[Row]) -> None:
    print(f"{'records':<9} {'codec':<5} {'groups':>6} {'raw B/group':>12} {'wire B/group':>12} {'ratio':>6} "
          f"{'codec ms':>9} {'e2e ms':>8} {'routing ids B -> codec B':>26}")
    for r in rows:
        routing = f"{r.routing_raw:>12,} -> {r.routing_wire:>10,}" if r.routing_raw else ""
        print(f"{r.kind:<9} {r.codec:<5} {r.groups:>6} {r.raw_bytes:>12,} {r.wire_bytes:>12,} {r.ratio:>6.2f} "
              f"{r.codec_ms:>9.2f} {r.e2e_ms:>8.2f} {routing:>26}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rft bench compression", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="flagship,long,routing", help="comma-separated: flagship, long, routing")
    parser.add_argument("--flagship-groups", type=int, default=16)
    parser.add_argument("--flagship-tokens", type=int, default=8, help="explorer.max_tokens of the flagship config")
    parser.add_argument("--long-groups", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=16384)
    parser.add_argument("--routing-groups", type=int, default=2)
    parser.add_argument("--routing-tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--records", type=Path, default=None,
                        help="a file of generated groups: read when it exists, else written (msgpack)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.records is not None and args.records.exists():
        stored = msgpack.unpackb(args.records.read_bytes(), raw=False)
        records = {k: [decode_group(v) for v in stored[k]] for k in kinds}
    else:
        started = time.perf_counter()
        with TemporaryDirectory(prefix="rft-bench-compression-") as work:
            records = make_records(kinds, args, Path(work))
        print(f"generated the records in {time.perf_counter() - started:.0f} s")
        if args.records is not None:
            args.records.write_bytes(msgpack.packb({k: [encode(g)[0] for g in gs] for k, gs in records.items()},
                                                   use_bin_type=True))
    print("\n".join(describe_records(records)))
    rows = measure(records, args.repeat)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
