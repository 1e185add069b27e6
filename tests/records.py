"""Building real (randomly filled) records for tests: valid by construction, seeded."""
from __future__ import annotations

import numpy as np

from rft.schema import ExperienceGroup, Sample, encode, group_id_for


def send_groups(sink, topic: str, items) -> None:
    """Write experience groups to `topic` as explorers do (key = group id); a `bytes` item is written as a record
    that claims to be an experience group but is not (a malformed record for the dead-letter path)."""
    for item in items:
        if isinstance(item, bytes):
            sink.send(topic, item, headers=[("rft-schema", b"1"), ("rft-type", b"experience_group")])
        else:
            value, headers = encode(item)
            sink.send(topic, value, key=item.group_id, headers=headers)


def read_topic(transport, topic: str, *, timeout_s: float = 0.1) -> list:
    """Every record of `topic` from its beginning, through a Transport (the in-memory one in unit tests)."""
    source = transport.source()
    try:
        source.assign([topic])
        source.seek(source.beginning_offsets(topic))
        return source.poll(timeout_s=timeout_s, max_records=100_000)
    finally:
        source.close()


def make_group(run_id: str, task: int, *, epoch: int = 0, n_samples: int = 4, policy_version: int = 0,
               prompt_len: int = 5, response_len: int = 6, seed: int | None = None, attempt: int = 0,
               explorer_id: str = "explorer-test", rewards: list[float] | None = None,
               responses: list[list[int]] | None = None) -> ExperienceGroup:
    """`rewards` / `responses` (token ids), when given, fix the samples' rewards / responses (and their number)."""
    rng = np.random.default_rng(task if seed is None else seed)
    task_id = f"task-{task}"
    n_samples = len(rewards) if rewards is not None else len(responses) if responses is not None else n_samples
    samples = []
    for j in range(n_samples):
        prompt = rng.integers(3, 90, prompt_len)
        response = rng.integers(3, 90, response_len) if responses is None else np.asarray(responses[j], dtype=np.int32)
        samples.append(Sample(sample_index=j, prompt_tokens=prompt, response_tokens=response,
                              logprobs=-rng.random(len(response)).astype(np.float32) * 3,
                              loss_mask=np.ones(len(response), dtype=np.uint8),
                              reward=float(rng.random()) if rewards is None else float(rewards[j]),
                              reward_components={"score": float(rng.random())}))
    return ExperienceGroup(run_id=run_id, task_id=task_id, group_id=group_id_for(run_id, task_id, epoch),
                           attempt=attempt, explorer_id=explorer_id, policy_version=policy_version, samples=samples)
