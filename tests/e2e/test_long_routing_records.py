"""16k-token responses with routing replay on a tiny random Qwen3-MoE, through `rft run` against the suite's broker
(which refuses messages over 1,000,000 bytes, as a default Kafka broker does): every group trains, and every record on
the experiences topic, read raw by an independent client (confluent-kafka's consumer), is under 1 MB.

The smallest honest setup: one group of 2 samples, each held to
exactly 16,384 response tokens (explorer.min_tokens), a model of 2 MoE layers x 32 experts, top-16, one attention head
of 64 (the trainer's local attention materialises [heads, s, s] in float32: ~1 GiB a layer at 16k), trained in one
step by one rank with micro-batches of one row (routing replay needs unpacked rows). Inline, the group would be ~1.3 MB
(per token: 4 B id + 4 B log-prob + 1 B loss mask + 2 layers x 16 experts x 1 B of routing = 41 B; x 2 samples x
16.4k tokens) and rft would refuse it (kafka.max_record_bytes 1,000,000): it passes only when the claim-check moves
each sample's routing map (524 KB > records.claim_threshold_bytes) into the run's object store. Measured on the 2-core
machine (3 samples of top-8 before): generating the group takes 110 CPU-s and 0.6 GB (the transformers engine, routing
recorded, static KV cache); training a 16k-token row ~23 s, 6.4 GB peak (the trainer's local attention holds [1, s, s]
float32 scores a layer)."""
from __future__ import annotations

import json

import pytest
import yaml

from benchmarks.runs import log_tail, rft_run, steps_done, write_config
from rft.models.tiny import make_tiny_model
from rft.transport.claims import HEADER_CLAIMS
from tests.support.runs import finish

pytestmark = pytest.mark.e2e
TOKENS = 16384
SAMPLES = 2
KAFKA_LIMIT = 1_000_000  # message.max.bytes of a default Kafka broker, and the suite broker's limit


def raw_records(bootstrap: str, topic: str) -> list:
    """Every message of `topic` as the broker stores it (confluent-kafka, no rft decoding; [] when the topic does not
    exist)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test-raw-reader", "enable.auto.commit": False,
                         "fetch.message.max.bytes": 64 * 1024 * 1024})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return []
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30) for p in metadata.partitions}
        wanted = {p: high for p, (low, high) in ends.items() if high > low}
        consumer.assign([TopicPartition(topic, p, ends[p][0]) for p in wanted])
        messages: list = []
        remaining = dict(wanted)
        while remaining:
            message = consumer.poll(30)
            assert message is not None, f"{topic}: no message within 30 s, still to read {remaining}"
            assert message.error() is None, message.error()
            messages.append(message)
            if message.offset() + 1 >= remaining.get(message.partition(), 0):
                remaining.pop(message.partition(), None)
        return messages
    finally:
        consumer.close()


def test_16k_token_routing_replay_groups_all_train_with_records_under_1_mb(tmp_path, bootstrap, topic_prefix):
    moe = make_tiny_model(tmp_path / "tiny-moe-16k", arch="qwen3_moe", hidden_size=64, heads=1, kv_heads=1,
                          head_dim=64, layers=2, intermediate_size=64, experts=32, experts_per_token=16,
                          moe_intermediate_size=32, max_position_embeddings=TOKENS + 64)
    config = write_config(
        tmp_path, moe, "long-routing",
        run={"mode": "sync", "max_steps": 1, "groups_per_step": 1, "routing_replay": True},
        kafka={"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix, "max_record_bytes": KAFKA_LIMIT},
        explorer={"replicas": 1, "engine": "transformers", "n_samples": SAMPLES, "max_tokens": TOKENS,
                  "min_tokens": TOKENS, "tasks_per_batch": 1,
                  "max_batch_s": 900},  # one generate call of minutes: the tasks group must not presume it dead
        trainer={"micro_batch_size": 1, "data_parallel": 1, "checkpoint_every": 100, "poll_timeout_s": 600},
        monitor={"progress": False})
    body = yaml.safe_load(config.read_text())
    body["model"]["max_response_len"] = TOKENS  # (write_config's `model` argument is the model's path)
    config.write_text(yaml.safe_dump(body))
    run_dir = tmp_path / "runs" / "long-routing"
    log = tmp_path / "run.log"
    assert finish(rft_run(config, log), log, timeout_s=900) == 0, log_tail(log)

    steps = [r for r in steps_done(run_dir) if "loss" in r]
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["routing_replayed"] == 1.0  # every loss token was routed as the explorer routed it
    assert steps[0]["response_len_mean"] == TOKENS

    experiences = raw_records(bootstrap, f"{topic_prefix}.experiences")
    sizes = {m.key().decode(): len(m.value()) + len(m.key()) + sum(len(k) + len(v or b"")
                                                                    for k, v in (m.headers() or []))
             for m in experiences}
    assert sizes and all(size < KAFKA_LIMIT for size in sizes.values()), sizes
    claimed = {m.key().decode(): int(dict(m.headers() or []).get(HEADER_CLAIMS, b"0")) for m in experiences}
    assert all(n >= SAMPLES for n in claimed.values()), claimed  # each sample's routing map, at least, claim-checked
    trained = [line for line in (run_dir / "consumed.jsonl").read_text().splitlines() if line]
    assert sorted(json.loads(line)["group_id"] for line in trained) == sorted(sizes)  # every group, once
    assert raw_records(bootstrap, f"{topic_prefix}.dead_letter") == []  # none refused "too large"
