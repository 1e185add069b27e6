"""Building real (randomly filled) records for tests: valid by construction, seeded."""
from __future__ import annotations

import io
import zlib

import numpy as np

from rft.schema import ExperienceGroup, Image, Sample, encode, group_id_for


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


def make_image(width: int = 8, height: int = 8, *, fmt: str = "PNG", seed: int = 0, noise: bool = False) -> Image:
    """A real image drawn with PIL: `fmt` PNG, JPEG or WEBP; `noise`: random pixels (a PNG of about 3 bytes a
    pixel, which compression cannot shrink), else one seeded colour."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    if noise:
        picture = PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    else:
        picture = PILImage.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 256, 3)))
    out = io.BytesIO()
    picture.save(out, fmt)
    return Image.of(out.getvalue())


def png_bomb(width: int = 8192, height: int = 8192) -> bytes:
    """A valid 1-bit greyscale PNG of `width` x `height` black pixels: a few kB that decode to width x height."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    idat = zlib.compress(b"\x00" * ((1 + (width + 7) // 8) * height), 1)  # each row: filter byte 0, then its bits
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([1, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
