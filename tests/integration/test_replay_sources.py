"""Where re-trained experiences come from, against the real broker: `RecordSource.fetch` re-reads records by
offset (the replay buffer's seek + fetch), `ExperienceReplay` drops a candidate whose offset no longer holds its
group, and SFT demonstrations published from a jsonl dataset carry the tokenized prompt and answer + EOS."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rft.data.demonstrations import publish_demonstrations
from rft.data.tasks import DatasetError
from rft.experience.priorities import resolve_priority
from rft.run.config import config_from_dict
from rft.schema import decode_group
from rft.trainer.replay_buffer import Candidate, ExperienceReplay, RecordReader, ReplayBuffer
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group

pytestmark = pytest.mark.integration


def publish_demonstrations_of(cfg):
    """`rft run`'s composition: the replay's topic (replay.topic, else the run's experiences topic)."""
    return publish_demonstrations(cfg.data, cfg.model, cfg.kafka, topic=cfg.replay.topic or cfg.topic("experiences"),
                                  run_id=cfg.run.name)


def topic_with_groups(bootstrap: str, topic: str, n: int):
    cfg = KafkaConfig(partitions=1)
    connect(cfg, bootstrap).admin().create_topics([topic], partitions=1)
    groups = [make_group("recorded", i) for i in range(n)]
    sink = connect(cfg, bootstrap).sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()
    sink.close()
    return cfg, groups


def test_fetch_rereads_records_by_offset(bootstrap, topic_prefix):
    topic = f"{topic_prefix}.experiences"
    cfg, groups = topic_with_groups(bootstrap, topic, 6)
    source = connect(cfg, bootstrap).source()
    try:
        for offset in (4, 1, 5, 1):
            message = source.fetch(f"{topic}:0", offset)
            assert message.offset == offset and decode_group(message.value).group_id == groups[offset].group_id
    finally:
        source.close()


def test_replay_forgets_a_group_no_longer_at_its_offset(bootstrap, topic_prefix):
    topic = f"{topic_prefix}.experiences"
    cfg, groups = topic_with_groups(bootstrap, topic, 4)
    buffer = ReplayBuffer(max_reuse=2, decay=1.0, capacity=10, seed=0)
    buffer.add([Candidate(f"{topic}:0", 1, groups[1].group_id, 1.0, 1),
                Candidate(f"{topic}:0", 2, "another-run/task-9/e0", 1.0, 1),  # as after the topic was recreated
                Candidate(f"{topic}:0", 3, groups[3].group_id, 1.0, 1)])
    reader = RecordReader(lambda: connect(cfg, bootstrap).source())
    replay = ExperienceReplay(buffer, groups_per_step=3, score=resolve_priority("uniform"), reader=reader)
    try:
        replayed = replay.replay(step=2)
    finally:
        reader.close()
    assert sorted((r.group.group_id, r.message.offset, r.reuse) for r in replayed) == [
        (groups[1].group_id, 1, 1), (groups[3].group_id, 3, 1)]
    assert replay.missing == 1
    assert sorted((c.offset, c.reuse) for c in buffer.candidates) == [(1, 1), (3, 1)]


def demo_config(tmp_path, model, bootstrap, run_name, rows, **model_overrides):
    dataset = tmp_path / "demos.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return config_from_dict({
        "run": {"name": run_name, "mode": "offline"}, "replay": {"from_data": True},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 4, **model_overrides},
        "kafka": {"bootstrap_servers": bootstrap}, "algorithm": {"name": "sft"},
        "data": {"format": "jsonl", "path": str(dataset), "epochs": 2, "prompt_template": "Q{prompt}="},
    })


def test_demonstrations_from_a_jsonl_dataset(tmp_path, tiny_model, bootstrap, topic_prefix):
    rows = [{"prompt": "12", "answer": "3"}, {"prompt": "4", "answer": 56}]
    cfg = demo_config(tmp_path, tiny_model, bootstrap, topic_prefix, rows)
    assert publish_demonstrations_of(cfg) == 4  # 2 rows x 2 epochs
    assert publish_demonstrations_of(cfg) == 0  # the topic holds them already: a resumed run publishes nothing

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    vocab = tokenizer.get_vocab()  # char-level: one token per character
    source = connect(cfg.kafka, bootstrap).source()
    try:
        groups = [decode_group(m.value) for m in source.read_range(cfg.topic("experiences"))]
    finally:
        source.close()
    assert len(groups) == 4 and len({g.group_id for g in groups}) == 4
    for g in groups:
        (sample,) = g.samples
        row = rows[0] if sample.prompt_tokens.tolist() == [vocab[c] for c in "Q12="] else rows[1]
        assert sample.prompt_tokens.tolist() == [vocab[c] for c in f"Q{row['prompt']}="]
        assert sample.response_tokens.tolist() == [vocab[c] for c in str(row["answer"])] + [tokenizer.eos_token_id]
        assert sample.loss_mask.tolist() == [1] * len(sample.response_tokens) and g.policy_version == 0
    assert sorted(g.group_id.rsplit("/", 1)[1] for g in groups) == ["e0", "e0", "e1", "e1"]


def test_a_demonstration_too_long_names_the_row(tmp_path, tiny_model, bootstrap, topic_prefix):
    cfg = demo_config(tmp_path, tiny_model, bootstrap, topic_prefix, [{"prompt": "1", "answer": "2"},
                                                                      {"prompt": "1", "answer": "23456"}])
    with pytest.raises(DatasetError, match=r"demos.jsonl row 1: the answer is 6 tokens; .*max_response_len=4"):
        publish_demonstrations_of(cfg)
