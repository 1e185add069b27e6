"""Records that cross Kafka: tasks, experience groups, control messages, and serve mode's served completions and
feedback (schema version 1).

Every message value is one msgpack map; arrays are raw little-endian buffers (msgpack `bin`) with
fixed dtypes, so any language's msgpack library reads them without numpy. The schema version and the
record type travel in Kafka headers (`rft-schema`, `rft-type`) and again inside the value, so a
consumer can reject a foreign record before decoding it. No pickle anywhere. `docs/schema.md` is
the field-by-field description; keep the two in step.

Invariant: `decode_*(encode(x)) == x` for every valid record, and every decode of invalid bytes raises
`RecordError` with a reason (it never returns a half-valid record).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
HEADER_SCHEMA = "rft-schema"
HEADER_TYPE = "rft-type"
HEADER_ERROR = "rft-error"  # on dead-letter records: why the record was rejected

TYPE_TASK = "task"
TYPE_EXPERIENCE = "experience_group"
TYPE_CONTROL = "control"
TYPE_SERVED = "served"
TYPE_FEEDBACK = "feedback"

# Why a sample has no reward (`Sample.failure`): its rollout failed for a reason outside the policy, so it is
# excluded from its group's baseline and not trained (docs/schema.md, "Failed rollouts").
FAILURE_CLASSES = ("environment", "timeout", "sandbox", "verifier", "agent", "unscored")
MAX_STATE_KEY_CHARS = 256  # a turn's `state` key

# Wire dtypes of the array fields (little-endian, fixed whatever the host).
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")


class RecordError(ValueError):
    """A record that cannot be decoded or is not valid; the message is the dead-letter reason."""


# Bounds on what a record may hold beyond its types (nothing read from a topic is trusted beyond the schema):
MAX_ID_CHARS = 1024  # run, task, group, explorer, request ids and prompt keys
MAX_CLOCK_SKEW_S = 300.0  # serve records' times: at most this far ahead of the reader's clock
MAX_COMPONENTS = 64  # feedback components per record
MAX_COMPONENT_NAME = 128  # characters of a component's name


def components_problem(components: Any) -> str | None:
    """None when `components` is a map of at most MAX_COMPONENTS names (strings of 1..MAX_COMPONENT_NAME characters)
    to finite numbers, else what is wrong (feedback's `components`: `rft serve` and the joiner check the same)."""
    if not isinstance(components, dict):
        return "an object of finite numbers"
    if len(components) > MAX_COMPONENTS:
        return f"{len(components)} components, over {MAX_COMPONENTS}"
    for name, value in components.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_COMPONENT_NAME:
            return f"component names are strings of 1..{MAX_COMPONENT_NAME} characters, got {str(name)[:40]!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"component {name!r} must be a finite number"
    return None


# Images a task's prompt shows (`TaskRecord.images`, `Sample.images`; docs/schema.md, "Images"). The limits here are
# the schema's ceiling, which every reader enforces; a run's own (`data.max_images`, ...) may only be lower.
IMAGE_MAGIC = {"image/png": (b"\x89PNG\r\n\x1a\n",), "image/jpeg": (b"\xff\xd8\xff",), "image/webp": (b"RIFF", b"WEBP")}
MAX_IMAGES = 64  # per task or sample
MAX_PROMPT_TEXT_CHARS = 1 << 20  # a sample's `prompt_text`
MAX_IMAGE_BYTES = 16 << 20  # encoded bytes of one image
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height one image may decode to (a decompression bomb declares more)


@dataclass(frozen=True)
class Image:
    """One encoded image: `data` the file's bytes (PNG, JPEG or WebP), `media_type` its type (a key of IMAGE_MAGIC),
    `sha256` the hex SHA-256 of `data`. Build one with `Image.of(data)`; `image_problem` says whether one is valid."""
    data: bytes
    media_type: str
    sha256: str

    @classmethod
    def of(cls, data: bytes, media_type: str | None = None) -> Image:
        """The image of `data`, its media type read from its magic bytes when not given (ValueError: not one of
        IMAGE_MAGIC's types)."""
        data = bytes(data)
        media_type = media_type or sniff_media_type(data)
        if media_type is None:
            raise ValueError(f"image: the bytes {data[:12]!r} are not PNG, JPEG or WebP")
        return cls(data=data, media_type=media_type, sha256=hashlib.sha256(data).hexdigest())

    def __repr__(self) -> str:
        return f"Image({self.media_type}, {len(self.data)} bytes, sha256={self.sha256[:12]})"


def sniff_media_type(data: bytes) -> str | None:
    """The media type whose magic bytes `data` starts with (WebP: `RIFF....WEBP`), or None."""
    for media_type, magic in IMAGE_MAGIC.items():
        if data.startswith(magic[0]) and (len(magic) == 1 or data[8:12] == magic[1]):
            return media_type
    return None


def image_dimensions(data: bytes, media_type: str) -> tuple[int, int] | None:
    """(width, height) as the image's header declares it, read without decoding a pixel (PNG's IHDR, JPEG's first
    SOF segment, WebP's VP8 / VP8L / VP8X chunk), or None when the header cannot be read."""
    try:
        if media_type == "image/png":
            if data[12:16] != b"IHDR":
                return None
            width, height = struct.unpack(">II", data[16:24])
            return width, height
        if media_type == "image/jpeg":
            return _jpeg_dimensions(data)
        if media_type == "image/webp":
            chunk = data[12:16]
            if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
                width, height = struct.unpack("<HH", data[26:30])
                return width & 0x3FFF, height & 0x3FFF
            if chunk == b"VP8L" and data[20:21] == b"\x2f":
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8X":
                return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    except struct.error:
        return None
    return None


def _jpeg_dimensions(data: bytes) -> tuple[int, int] | None:
    position = 2  # after SOI
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers carry no length
            position += 2
            continue
        length = int.from_bytes(data[position + 2:position + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            if position + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[position + 5:position + 9])
            return width, height
        if length < 2 or marker in (0xD9, 0xDA):  # end of image, or the scan before any frame header
            return None
        position += 2 + length
    return None


@dataclass(frozen=True)
class ImageLimits:
    """How many images a task or sample may carry and how large each may be. The defaults are the schema's ceiling
    (what every reader enforces); a run's are its `data.max_images`, `data.max_image_bytes` and
    `data.max_image_pixels` (`of`), which `origin` ("data") names in the reasons."""
    max_images: int = MAX_IMAGES
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    origin: str = ""

    @classmethod
    def of(cls, data: Any) -> ImageLimits:
        """The limits a `DataConfig` configures."""
        return cls(int(data.max_images), int(data.max_image_bytes), int(data.max_image_pixels), origin="data")

    def _name(self, key: str) -> str:
        return f"{self.origin}.{key}" if self.origin else f"rft.schema.{key.upper()}"

    def count_problem(self, count: int) -> str | None:
        """None when `count` images are allowed, else why not."""
        if count > self.max_images:
            return f"{count} images, over {self._name('max_images')} = {self.max_images}"
        return None

    def problem(self, images: list[Image]) -> str | None:
        """None when `images` are all valid (`image_problem`) and within these limits, else what is wrong, naming
        the image (`images[i]`) and the limit."""
        if problem := self.count_problem(len(images)):
            return problem
        for i, image in enumerate(images):
            if problem := image_problem(image, self):
                return f"images[{i}]: {problem}"
        return None


def image_problem(image: Image, limits: ImageLimits | None = None) -> str | None:
    """None when `image` is valid within `limits` (default: the schema's ceiling): a known media type that its magic
    bytes agree with, `sha256` the SHA-256 of `data`, at most `max_image_bytes` bytes, and a header declaring at most
    `max_image_pixels` pixels (checked before anything decodes it); else what is wrong."""
    limits = limits or ImageLimits()
    if image.media_type not in IMAGE_MAGIC:
        return f"media type {image.media_type[:64]!r} is not one of {sorted(IMAGE_MAGIC)}"
    if len(image.data) > limits.max_image_bytes:
        return (f"{len(image.data)} bytes, over {limits._name('max_image_bytes')} = {limits.max_image_bytes} "
                "(an image is refused whole, never cut)")
    if sniff_media_type(image.data) != image.media_type:
        return f"the bytes {image.data[:12]!r} are not {image.media_type} (its magic bytes do not agree)"
    if hashlib.sha256(image.data).hexdigest() != image.sha256:
        return f"sha256 {image.sha256[:64]!r} is not the SHA-256 of its {len(image.data)} bytes"
    size = image_dimensions(image.data, image.media_type)
    if size is None:
        return f"the {image.media_type} header declares no readable width and height"
    if size[0] < 1 or size[1] < 1 or size[0] * size[1] > limits.max_image_pixels:
        return (f"{size[0]} x {size[1]} pixels, outside 1 .. {limits._name('max_image_pixels')} = "
                f"{limits.max_image_pixels} (a decompression bomb is refused before it decodes)")
    return None


@dataclass(frozen=True)
class RewardRange:
    """The rewards a run accepts wherever one enters it (`run.reward_min` .. `run.reward_max`, inclusive):
    finite and within [low, high]. A reward outside would poison the advantages (two rewards of 1e308 make GRPO's
    mean overflow and its advantages NaN)."""
    low: float = -1e6
    high: float = 1e6

    @classmethod
    def of(cls, run: Any) -> RewardRange:
        """The range a `RunConfig` configures."""
        return cls(float(run.reward_min), float(run.reward_max))

    def problem(self, reward: Any) -> str | None:
        """None when `reward` is a finite number in range, else why not (names the config keys)."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return f"reward {reward!r} is not a finite number"
        if not self.low <= reward <= self.high:
            return (f"reward {reward!r} is outside run.reward_min..run.reward_max "
                    f"[{self.low:g}, {self.high:g}]")
        return None

    def group_problem(self, group: ExperienceGroup) -> str | None:
        """`problem` of the first sample of `group` whose reward is not accepted, naming the sample; then of the
        group's `greedy_reward`, when it has one."""
        for position, sample in enumerate(group.samples):
            problem = None if sample.failure else self.problem(sample.reward)
            if problem:
                return f"samples[{position}]: {problem}"
        if group.greedy_reward is not None and (problem := self.problem(group.greedy_reward)):
            return f"greedy_reward: {problem}"
        return None


@dataclass
class TaskRecord:
    """One task (prompt) to explore. `task_id` is stable across epochs; `(task_id, epoch)` names a group.
    `images`: the images the prompt shows, in order (none for a text task)."""
    run_id: str
    task_id: str
    epoch: int
    prompt: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    images: list[Image] = field(default_factory=list)

    @property
    def group_id(self) -> str:
        return group_id_for(self.run_id, self.task_id, self.epoch)


def group_id_for(run_id: str, task_id: str, epoch: int) -> str:
    """Deterministic group id: re-exploring the same task in the same epoch gives the same id."""
    return f"{run_id}/{task_id}/e{epoch}"


# Routed-expert ids: the narrowest of these that holds num_experts - 1, named in the record (`dtype`).
ROUTED_EXPERT_DTYPES: dict[str, np.dtype] = {"u1": np.dtype("u1"), "u2": np.dtype("<u2")}


@dataclass
class RoutedExperts:
    """The experts an MoE inference engine routed each token to, per MoE layer (`docs/schema.md`).

    `ids[j, l, :]` are the `top_k` expert ids (in [0, num_experts), the engine's top-k order) that MoE layer
    `layers[l]` (0-based decoder layer index, ascending) chose for input position `first_position + j` of the
    sample's sequence prompt + response. The engine runs P + R - 1 input positions (every token but the last
    response token), and position P - 1 + t is the forward pass that produced response token t, so `ids` has
    P + R - 1 - first_position rows: `first_position` 0 records the prompt's prefill too, P - 1 only the forward
    passes of the generated tokens. uint8 when num_experts <= 256, else uint16."""
    ids: np.ndarray  # [positions, len(layers), top_k], uint8 or uint16
    num_experts: int
    layers: list[int]
    first_position: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return (self.num_experts == other.num_experts and list(self.layers) == list(other.layers)
                and self.first_position == other.first_position and self.ids.dtype == other.ids.dtype
                and np.array_equal(self.ids, other.ids))

    @staticmethod
    def dtype_for(num_experts: int) -> np.dtype:
        """The wire dtype of ids below `num_experts` (ValueError above 65536)."""
        for dtype in ROUTED_EXPERT_DTYPES.values():
            if num_experts <= np.iinfo(dtype).max + 1:
                return dtype
        raise ValueError(f"routed experts: {num_experts} experts do not fit uint16 ids")

    @staticmethod
    def start(prompt_len: int, prefill: bool) -> int:
        """The `first_position` rft's engines record from (`run.routing_prefill`): 0 with the prefill, else
        P - 1, the forward pass that produced the first response token."""
        return 0 if prefill else max(prompt_len - 1, 0)


def routed_experts_problem(routed: RoutedExperts, prompt_len: int, response_len: int) -> str | None:
    """None when `routed` fits a sample of `prompt_len` + `response_len` tokens (shapes, id range, layers), else
    what is wrong."""
    ids, n_inputs = routed.ids, prompt_len + response_len - 1
    if ids.ndim != 3:
        return f"ids must be [positions, layers, top_k], got {ids.ndim} dimensions"
    if not 0 <= routed.first_position <= max(n_inputs, 0):
        return f"first_position {routed.first_position} is outside 0..{n_inputs} (prompt + response - 1)"
    if ids.shape[0] != n_inputs - routed.first_position:
        return (f"{ids.shape[0]} positions, but a sample of {prompt_len} prompt and {response_len} response tokens "
                f"from first_position {routed.first_position} has {n_inputs - routed.first_position}")
    if ids.shape[1] != len(routed.layers) or not routed.layers:
        return f"{ids.shape[1]} layers of ids for {len(routed.layers)} layer indices {routed.layers}"
    if any(b <= a for a, b in itertools.pairwise(routed.layers)) or routed.layers[0] < 0:
        return f"layers {routed.layers} must be ascending decoder layer indices >= 0"
    if not 1 <= ids.shape[2] <= routed.num_experts:
        return f"top_k {ids.shape[2]} is outside 1..num_experts ({routed.num_experts})"
    if ids.dtype != RoutedExperts.dtype_for(routed.num_experts):
        return f"ids are {ids.dtype}, {routed.num_experts} experts take {RoutedExperts.dtype_for(routed.num_experts)}"
    if ids.size and int(ids.max()) >= routed.num_experts:
        return f"expert id {int(ids.max())} is not below num_experts {routed.num_experts}"
    return None


@dataclass(frozen=True)
class Turn:
    """One step of a multi-turn episode within its sample: response tokens [start, end) (the model's turn and the
    environment's reply after it), `state` the key of the environment state the model acted from (equal keys in a
    group = the same state: GiGPO's anchor states), `reward` the environment's reward for the step."""
    start: int
    end: int
    state: str
    reward: float = 0.0


def turns_problem(turns: list[Turn], response_len: int) -> str | None:
    """None when `turns` fit a response of `response_len` tokens (spans ascending, not overlapping, within the
    response; state keys at most MAX_STATE_KEY_CHARS; rewards finite), else what is wrong."""
    if len(turns) > max(response_len, 1):
        return f"{len(turns)} turns for {response_len} response tokens"
    previous_end = 0
    for i, turn in enumerate(turns):
        if not previous_end <= turn.start < turn.end <= response_len:
            return (f"turns[{i}]: tokens [{turn.start}, {turn.end}) must be non-empty, after the previous turn's end "
                    f"{previous_end} and within the {response_len} response tokens")
        if len(turn.state) > MAX_STATE_KEY_CHARS:
            return f"turns[{i}]: state key of {len(turn.state)} characters (at most {MAX_STATE_KEY_CHARS})"
        if not math.isfinite(turn.reward):
            return f"turns[{i}]: reward {turn.reward!r} is not finite"
        previous_end = turn.end
    return None


@dataclass
class Sample:
    """One response to a task's prompt. Arrays: prompt/response tokens int32, logprobs float32, mask uint8.
    `routed_experts`: an MoE engine's routing of the sample's tokens (`RoutedExperts`), None when not recorded.
    `token_versions`: the weights version that generated each response token (int64, one per token), None when not
    recorded: then every token is the group's `policy_version` (`versions_of`). On the wire: `version_spans`.
    `failure`: "" for a scored rollout, else one of FAILURE_CLASSES: the rollout failed outside the policy (or its
    reward is None: `unscored`); `reward` is then meaningless (nil on the wire), and the sample is left out of its
    group's baseline and not trained. `turns`: the steps of a multi-turn episode (`Turn`), None when not recorded.
    `images`: the images of the sample's prompt as the engine saw them, in order (none for a text prompt).
    `prompt_text`: with images, the prompt exactly as the engine's processor took it (chat template rendered, one
    image placeholder per image, unexpanded), so a trainer can re-run the processor and check that it expands to
    `prompt_tokens`; "" without images (a text sample's prompt is its tokens)."""
    sample_index: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    logprobs: np.ndarray  # behaviour log-prob of each response token under the generating policy
    loss_mask: np.ndarray  # 1 where the token is the model's own and enters the loss
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    token_versions: np.ndarray | None = None
    failure: str = ""
    turns: list[Turn] | None = None
    images: list[Image] = field(default_factory=list)
    prompt_text: str = ""

    @property
    def scored(self) -> bool:
        """True when the sample has a reward (its rollout did not fail): only scored samples enter a baseline."""
        return not self.failure

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        mine, theirs = self.token_versions, other.token_versions
        versions = (mine is None and theirs is None) or (
            mine is not None and theirs is not None and np.array_equal(mine, theirs))
        return (self.sample_index == other.sample_index and self.reward == other.reward
                and self.reward_components == other.reward_components
                and self.finish_reason == other.finish_reason and self.metadata == other.metadata
                and self.routed_experts == other.routed_experts and versions
                and self.failure == other.failure and self.turns == other.turns and self.images == other.images
                and self.prompt_text == other.prompt_text
                and all(np.array_equal(getattr(self, k), getattr(other, k), equal_nan=True)
                        for k in ("prompt_tokens", "response_tokens", "logprobs", "loss_mask")))

    def versions_of(self, policy_version: int) -> np.ndarray:
        """The version of each response token (int64): `token_versions`, or `policy_version` (its group's) for every
        token of a sample that recorded none."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, dtype=np.int64)
        return np.full(len(self.response_tokens), policy_version, dtype=np.int64)


def version_spans(versions: Any) -> list[list[int]]:
    """Per-token versions as `[[version, first token], ...]`: one span per run of equal versions, starts ascending
    from 0 (the wire form of `Sample.token_versions`, docs/schema.md)."""
    versions = np.asarray(versions, dtype=np.int64)
    if versions.ndim != 1:
        raise ValueError(f"token_versions must be one version per response token, got shape {versions.shape}")
    starts = [0] + [int(i) for i in np.flatnonzero(versions[1:] != versions[:-1]) + 1] if len(versions) else []
    return [[int(versions[i]), i] for i in starts]


def versions_from_spans(spans: Any, n_tokens: int) -> np.ndarray:
    """The inverse of `version_spans` for a sample of `n_tokens` response tokens; RecordError naming what does not
    fit (a span that is not a pair of integers >= 0, starts not ascending from 0 or past the last token)."""
    if not isinstance(spans, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                        for x in p) for p in spans):
        raise RecordError("version_spans: must be an array of [version, start] pairs of integers >= 0")
    starts = [start for _, start in spans]
    if not spans and n_tokens or spans and (starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts))
                                            or starts[-1] >= n_tokens):
        raise RecordError(f"version_spans: starts {starts[:8]} must ascend from 0 and stay below the {n_tokens} "
                          f"response tokens")
    versions = np.empty(n_tokens, dtype=np.int64)
    for (version, start), end in zip(spans, starts[1:] + [n_tokens], strict=False):  # no spans: no tokens
        versions[start:end] = version
    return versions


@dataclass
class ExperienceGroup:
    """All samples of one task from one explorer attempt: one Kafka message, so a group arrives whole.
    `greedy_reward`: the reward of one greedy (temperature 0) response to the task, generated beside the samples and
    not one of them (the baseline of algorithm remax); None when the explorer generated none."""
    run_id: str
    task_id: str
    group_id: str
    attempt: int
    explorer_id: str
    policy_version: int  # oldest weights version used to generate any sample of the group
    samples: list[Sample]
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    greedy_reward: float | None = None

    def sample_id(self, sample: Sample) -> str:
        return f"{self.group_id}/s{sample.sample_index}"

    @property
    def rewards(self) -> np.ndarray:
        """Every sample's reward, failed samples' (meaningless) included: see `scored_samples`."""
        return np.array([s.reward for s in self.samples], dtype=np.float64)

    @property
    def scored_samples(self) -> list[Sample]:
        """The samples whose rollout did not fail (`Sample.scored`), in order: the ones a baseline is taken over."""
        return [s for s in self.samples if s.scored]


@dataclass
class ControlMessage:
    """Run lifecycle, versions, heartbeats and fleet membership. `kind` says which; `body` is free-form."""
    kind: str
    sender: str
    body: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)


@dataclass
class ServedChoice:
    """One completion of a served request (choice `index` of the OpenAI response): tokens int32, log-probs float32."""
    index: int
    response_tokens: np.ndarray
    logprobs: np.ndarray  # behaviour log-prob of each response token (the sampling distribution, as explorers')
    finish_reason: str = ""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ServedChoice):
            return NotImplemented
        return (self.index == other.index and self.finish_reason == other.finish_reason
                and np.array_equal(self.response_tokens, other.response_tokens)
                and np.array_equal(self.logprobs, other.logprobs, equal_nan=True))


@dataclass
class ServedCompletion:
    """One request answered by `rft serve` (on `<prefix>.served`, key = request id): the prompt as the model saw
    it, its `n` choices, the weights version that generated them. `prompt_key` names the prompt (a hash of its
    tokens): completions of one prompt form a group. Times are epoch seconds: request received, answer done."""
    run_id: str
    request_id: str
    prompt_key: str
    prompt_tokens: np.ndarray
    choices: list[ServedChoice]
    policy_version: int
    model: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # the sampling settings asked for
    created_at: float = field(default_factory=time.time)
    finished_at: float = field(default_factory=time.time)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ServedCompletion):
            return NotImplemented
        return (all(getattr(self, k) == getattr(other, k) for k in (
            "run_id", "request_id", "prompt_key", "choices", "policy_version", "model", "metadata", "created_at",
            "finished_at")) and np.array_equal(self.prompt_tokens, other.prompt_tokens))


@dataclass
class Feedback:
    """A reward for choice `index` of served request `request_id` (on `<prefix>.feedback`, key = request id)."""
    run_id: str
    request_id: str
    reward: float
    index: int = 0
    components: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)


# --------------------------------------------------------------------------------------------------
# Encoding


def headers_for(record_type: str) -> list[tuple[str, bytes]]:
    return [(HEADER_SCHEMA, str(SCHEMA_VERSION).encode()), (HEADER_TYPE, record_type.encode())]


def encode(record: TaskRecord | ExperienceGroup | ControlMessage | ServedCompletion | Feedback
           ) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Return (value, headers) for one record."""
    if isinstance(record, TaskRecord):
        body, kind = {
            "run_id": record.run_id, "task_id": record.task_id, "epoch": record.epoch,
            "prompt": record.prompt, "answer": record.answer, "metadata": record.metadata,
            "created_at": record.created_at,
        }, TYPE_TASK
        if record.images:
            body["images"] = _encode_images(record.images)
    elif isinstance(record, ExperienceGroup):
        if problem := oldest_version_problem(record):
            raise ValueError(problem)
        body, kind = {
            "run_id": record.run_id, "task_id": record.task_id, "group_id": record.group_id,
            "attempt": record.attempt, "explorer_id": record.explorer_id,
            "policy_version": record.policy_version, "answer": record.answer,
            "metadata": record.metadata, "created_at": record.created_at,
            "samples": [_encode_sample(s) for s in record.samples],
        }, TYPE_EXPERIENCE
        if record.greedy_reward is not None:
            body["greedy_reward"] = float(record.greedy_reward)
    elif isinstance(record, ControlMessage):
        body, kind = {"kind": record.kind, "sender": record.sender, "body": record.body,
                      "created_at": record.created_at}, TYPE_CONTROL
    elif isinstance(record, ServedCompletion):
        body, kind = {
            "run_id": record.run_id, "request_id": record.request_id, "prompt_key": record.prompt_key,
            "prompt_tokens": _array_bytes(record.prompt_tokens, TOKEN_DTYPE), "policy_version": record.policy_version,
            "model": record.model, "metadata": record.metadata, "created_at": record.created_at,
            "finished_at": record.finished_at,
            "choices": [{"index": c.index, "response_tokens": _array_bytes(c.response_tokens, TOKEN_DTYPE),
                         "logprobs": _array_bytes(c.logprobs, LOGPROB_DTYPE), "finish_reason": c.finish_reason}
                        for c in record.choices],
        }, TYPE_SERVED
    elif isinstance(record, Feedback):
        body, kind = {"run_id": record.run_id, "request_id": record.request_id, "index": record.index,
                      "reward": float(record.reward),
                      "components": {k: float(v) for k, v in record.components.items()},
                      "created_at": record.created_at}, TYPE_FEEDBACK
    else:
        raise TypeError(f"not an rft record: {type(record).__name__}")
    body["schema"] = SCHEMA_VERSION
    body["type"] = kind
    return msgpack.packb(body, use_bin_type=True), headers_for(kind)


def _encode_sample(s: Sample) -> dict[str, Any]:
    body = {
        "sample_index": s.sample_index,
        "prompt_tokens": _array_bytes(s.prompt_tokens, TOKEN_DTYPE),
        "response_tokens": _array_bytes(s.response_tokens, TOKEN_DTYPE),
        "logprobs": _array_bytes(s.logprobs, LOGPROB_DTYPE),
        "loss_mask": _array_bytes(s.loss_mask, MASK_DTYPE),
        "reward": None if s.failure else float(s.reward),
        "reward_components": {k: float(v) for k, v in s.reward_components.items()},
        "finish_reason": s.finish_reason, "metadata": s.metadata,
    }
    if s.failure:
        if s.failure not in FAILURE_CLASSES:
            raise ValueError(f"failure {s.failure!r} is not one of {FAILURE_CLASSES}")
        body["failure"] = s.failure
    if s.turns is not None:
        if problem := turns_problem(s.turns, len(s.response_tokens)):
            raise ValueError(f"turns: {problem}")
        body["turns"] = [[t.start, t.end, t.state, float(t.reward)] for t in s.turns]
    if s.routed_experts is not None:
        body["routed_experts"] = _encode_routed(s.routed_experts, len(s.prompt_tokens), len(s.response_tokens))
    if s.token_versions is not None:
        if len(s.token_versions) != len(s.response_tokens):
            raise ValueError(f"token_versions: {len(s.token_versions)} versions for {len(s.response_tokens)} response "
                             "tokens")
        body["version_spans"] = version_spans(s.token_versions)
    if problem := prompt_text_problem(s.prompt_text, s.images):
        raise ValueError(problem)
    if s.images:
        body["images"] = _encode_images(s.images)
        body["prompt_text"] = s.prompt_text
    return body


def prompt_text_problem(prompt_text: str, images: list[Image]) -> str | None:
    """None when a sample's `prompt_text` fits its images (non-empty, at most MAX_PROMPT_TEXT_CHARS, with images;
    empty without), else what is wrong."""
    if images and not prompt_text:
        return "a sample with images needs its prompt_text (the prompt its engine's processor expanded)"
    if not images and prompt_text:
        return "prompt_text is only carried by a sample with images"
    if len(prompt_text) > MAX_PROMPT_TEXT_CHARS:
        return f"prompt_text is {len(prompt_text)} characters, over {MAX_PROMPT_TEXT_CHARS}"
    return None


def _encode_images(images: list[Image]) -> list[dict[str, Any]]:
    """The `images` array; ValueError naming the image that is not valid (`ImageLimits.problem`, the ceiling)."""
    if problem := ImageLimits().problem(images):
        raise ValueError(problem)
    return [{"data": image.data, "media_type": image.media_type, "sha256": image.sha256} for image in images]


def _encode_routed(routed: RoutedExperts, prompt_len: int, response_len: int) -> dict[str, Any]:
    """The `routed_experts` map; ValueError (naming the problem) for routing that does not fit its sample."""
    problem = routed_experts_problem(routed, prompt_len, response_len)
    if problem:
        raise ValueError(f"routed_experts: {problem}")
    name = next(k for k, v in ROUTED_EXPERT_DTYPES.items() if v == routed.ids.dtype.newbyteorder("<"))
    return {"ids": _array_bytes(routed.ids, ROUTED_EXPERT_DTYPES[name]), "dtype": name,
            "shape": [int(n) for n in routed.ids.shape], "num_experts": routed.num_experts,
            "layers": [int(i) for i in routed.layers], "first_position": routed.first_position}


def _array_bytes(values: Any, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(np.asarray(values), dtype=dtype).tobytes()


# --------------------------------------------------------------------------------------------------
# Decoding (strict: every failure is a RecordError with a reason)


def record_type(value: bytes, headers: list[tuple[str, bytes]] | None) -> str:
    """The record type from the headers, checking the schema version; RecordError if foreign."""
    hdr = {k: v or b"" for k, v in (headers or [])}  # a null header value (other clients) reads as empty
    if HEADER_SCHEMA not in hdr:
        raise RecordError(f"missing header {HEADER_SCHEMA!r}: not an rft record")
    version = hdr[HEADER_SCHEMA].decode(errors="replace")
    if version != str(SCHEMA_VERSION):
        raise RecordError(f"schema version {version!r} is not supported (this build reads {SCHEMA_VERSION})")
    return hdr.get(HEADER_TYPE, b"").decode(errors="replace")


def decode(value: bytes, headers: list[tuple[str, bytes]] | None = None, *, images: ImageLimits | None = None
           ) -> TaskRecord | ExperienceGroup | ControlMessage | ServedCompletion | Feedback:
    """Decode any rft record. Headers are checked when given; the body is always checked; a task's or sample's
    images within `images` (default: the schema's ceiling, `ImageLimits()`)."""
    limits = images or ImageLimits()
    expected = record_type(value, headers) if headers is not None else None
    body = _unpack(value)
    kind = body.get("type")
    if expected is not None and kind != expected:
        raise RecordError(f"header type {expected!r} does not match body type {kind!r}")
    if kind == TYPE_TASK:
        return _decode_task(body, limits)
    if kind == TYPE_EXPERIENCE:
        return _decode_group(body, limits)
    if kind == TYPE_CONTROL:
        return ControlMessage(kind=_get(body, "kind", str), sender=_get(body, "sender", str),
                              body=_get(body, "body", dict), created_at=_get(body, "created_at", float))
    if kind == TYPE_SERVED:
        return _decode_served(body)
    if kind == TYPE_FEEDBACK:
        return _decode_feedback(body)
    raise RecordError(f"unknown record type {kind!r}")


def decode_group(value: bytes, headers: list[tuple[str, bytes]] | None = None, *,
                 images: ImageLimits | None = None) -> ExperienceGroup:
    record = decode(value, headers, images=images)
    if not isinstance(record, ExperienceGroup):
        raise RecordError(f"expected an experience group, got a {type(record).__name__}")
    return record


def decode_task(value: bytes, headers: list[tuple[str, bytes]] | None = None, *,
                images: ImageLimits | None = None) -> TaskRecord:
    record = decode(value, headers, images=images)
    if not isinstance(record, TaskRecord):
        raise RecordError(f"expected a task, got a {type(record).__name__}")
    return record


def decode_served(value: bytes, headers: list[tuple[str, bytes]] | None = None) -> ServedCompletion:
    record = decode(value, headers)
    if not isinstance(record, ServedCompletion):
        raise RecordError(f"expected a served completion, got a {type(record).__name__}")
    return record


def decode_feedback(value: bytes, headers: list[tuple[str, bytes]] | None = None) -> Feedback:
    record = decode(value, headers)
    if not isinstance(record, Feedback):
        raise RecordError(f"expected feedback, got a {type(record).__name__}")
    return record


def _unpack(value: bytes) -> dict[str, Any]:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise RecordError("record value is empty")
    try:
        body = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise RecordError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise RecordError(f"record body must be a map, got {type(body).__name__}")
    if body.get("schema") != SCHEMA_VERSION:
        raise RecordError(f"schema version {body.get('schema')!r} is not supported (this build reads {SCHEMA_VERSION})")
    return body


def _get(body: dict[str, Any], key: str, tp: type, optional: bool = False) -> Any:
    if key not in body:
        if optional:
            return None
        raise RecordError(f"missing field {key!r}")
    value = body[key]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise RecordError(f"field {key!r}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _id(body: dict[str, Any], key: str) -> str:
    """A string id field of at most MAX_ID_CHARS characters (consumers keep ids: a longer one is refused)."""
    value = _get(body, key, str)
    if len(value) > MAX_ID_CHARS:
        raise RecordError(f"field {key!r}: {len(value)} characters, over {MAX_ID_CHARS}")
    return value


def _time(body: dict[str, Any], key: str) -> float:
    """A time field (epoch seconds) that a consumer waits on: finite, >= 0 and at most MAX_CLOCK_SKEW_S ahead of this
    host's clock (a NaN or far-future time would never expire, holding the joiner's offsets for good)."""
    value = _get(body, key, float)
    if not (math.isfinite(value) and 0 <= value <= time.time() + MAX_CLOCK_SKEW_S):
        raise RecordError(f"field {key!r}: {value!r} is not a time (finite, >= 0, at most {MAX_CLOCK_SKEW_S:.0f} s "
                          "ahead of this host's clock)")
    return value


def _decode_task(body: dict[str, Any], limits: ImageLimits) -> TaskRecord:
    return TaskRecord(run_id=_id(body, "run_id"), task_id=_id(body, "task_id"),
                      epoch=_get(body, "epoch", int), prompt=_get(body, "prompt", str),
                      answer=body.get("answer"), metadata=_get(body, "metadata", dict),
                      created_at=_get(body, "created_at", float), images=_decode_images(body, limits))


def _decode_group(body: dict[str, Any], limits: ImageLimits) -> ExperienceGroup:
    samples_raw = _get(body, "samples", list)
    if not samples_raw:
        raise RecordError("experience group has no samples")
    group = ExperienceGroup(
        run_id=_id(body, "run_id"), task_id=_id(body, "task_id"),
        group_id=_id(body, "group_id"), attempt=_get(body, "attempt", int),
        explorer_id=_id(body, "explorer_id"), policy_version=_get(body, "policy_version", int),
        answer=body.get("answer"), metadata=_get(body, "metadata", dict),
        created_at=_get(body, "created_at", float), greedy_reward=_greedy_reward(body),
        samples=[_decode_sample(s, i, limits) for i, s in enumerate(samples_raw)])
    problem = oldest_version_problem(group)
    if problem:
        raise RecordError(problem)
    return group


def _greedy_reward(body: dict[str, Any]) -> float | None:
    """The optional `greedy_reward` (absent or nil: None); RecordError when it is not a finite number."""
    if body.get("greedy_reward") is None:
        return None
    reward = _get(body, "greedy_reward", float)
    if not math.isfinite(reward):
        raise RecordError("greedy_reward is NaN or infinite")
    return reward


def oldest_version_problem(group: ExperienceGroup) -> str | None:
    """None when `policy_version` is the oldest version of the group's tokens, as the schema says (a sample without
    `token_versions` counts as `policy_version`), else what is wrong: staleness bounds and the trainer's drops are
    taken on `policy_version`, so a token older than it would escape them."""
    recorded = [s.token_versions for s in group.samples if s.token_versions is not None and len(s.token_versions)]
    if not recorded:
        return None
    oldest = min(int(np.min(v)) for v in recorded)
    if oldest < group.policy_version or (len(recorded) == len(group.samples) and oldest != group.policy_version):
        return (f"policy_version {group.policy_version} is not the oldest token version ({oldest}) of the group's "
                "version_spans")
    return None


def _decode_sample(raw: Any, position: int, limits: ImageLimits) -> Sample:
    if not isinstance(raw, dict):
        raise RecordError(f"samples[{position}]: expected a map")
    where = f"samples[{position}]"
    try:
        arrays = {k: _array(raw, k, dt) for k, dt in (("prompt_tokens", TOKEN_DTYPE), ("response_tokens", TOKEN_DTYPE),
                                                       ("logprobs", LOGPROB_DTYPE), ("loss_mask", MASK_DTYPE))}
        n = len(arrays["response_tokens"])
        for k in ("logprobs", "loss_mask"):
            if len(arrays[k]) != n:
                raise RecordError(f"{k} has {len(arrays[k])} entries for {n} response tokens")
        if not np.all(np.isfinite(arrays["logprobs"])):
            raise RecordError("logprobs contain NaN or infinity")
        failure = _get(raw, "failure", str, optional=True) or ""
        if failure and failure not in FAILURE_CLASSES:
            raise RecordError(f"failure {failure[:64]!r} is not one of {FAILURE_CLASSES}")
        if failure and raw.get("reward") is not None:
            raise RecordError(f"a failed sample ({failure}) has a reward: it must be nil")
        reward = 0.0 if failure else _get(raw, "reward", float)
        components = {str(k): float(v) for k, v in _get(raw, "reward_components", dict).items()}
        if not math.isfinite(reward) or not all(math.isfinite(v) for v in components.values()):
            raise RecordError("reward is NaN or infinite")
        turns = None if raw.get("turns") is None else _decode_turns(raw["turns"], n)
        routed = None
        if raw.get("routed_experts") is not None:
            routed = _decode_routed(_get(raw, "routed_experts", dict), len(arrays["prompt_tokens"]), n)
        versions = None if raw.get("version_spans") is None else versions_from_spans(raw["version_spans"], n)
        images = _decode_images(raw, limits)
        prompt_text = "" if raw.get("prompt_text") is None else _get(raw, "prompt_text", str)
        if problem := prompt_text_problem(prompt_text, images):
            raise RecordError(problem)
        return Sample(sample_index=_get(raw, "sample_index", int), reward=reward, reward_components=components,
                      finish_reason=_get(raw, "finish_reason", str), metadata=_get(raw, "metadata", dict),
                      routed_experts=routed, token_versions=versions, failure=failure, turns=turns,
                      images=images, prompt_text=prompt_text, **arrays)
    except RecordError as e:
        raise RecordError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise RecordError(f"{where}: {e}") from None


def _decode_images(body: dict[str, Any], limits: ImageLimits) -> list[Image]:
    """The optional `images` array (absent or nil: none) of `{data, media_type, sha256}` maps, each valid within
    `limits` (`ImageLimits.problem`); RecordError naming the image and what is wrong."""
    raw = body.get("images")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RecordError(f"images: expected an array, got {type(raw).__name__}")
    if problem := limits.count_problem(len(raw)):  # before touching any image's bytes
        raise RecordError(f"images: {problem}")
    images = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RecordError(f"images[{i}]: expected a map")
        try:
            images.append(Image(data=_get(item, "data", bytes), media_type=_get(item, "media_type", str),
                                sha256=_get(item, "sha256", str)))
        except RecordError as e:
            raise RecordError(f"images[{i}]: {e}") from None
    if problem := limits.problem(images):
        raise RecordError(problem)
    return images


def _decode_turns(raw: Any, response_len: int) -> list[Turn]:
    """`turns` as `[start, end, state, reward]` arrays; RecordError naming what does not fit."""
    if not isinstance(raw, list) or not all(
            isinstance(t, list) and len(t) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in t[:2])
            and isinstance(t[2], str) and isinstance(t[3], (int, float)) and not isinstance(t[3], bool) for t in raw):
        raise RecordError("turns: must be an array of [start, end, state, reward] (int, int, str, float)")
    turns = [Turn(start=t[0], end=t[1], state=t[2], reward=float(t[3])) for t in raw]
    if problem := turns_problem(turns, response_len):
        raise RecordError(f"turns: {problem}")
    return turns


def _decode_routed(raw: dict[str, Any], prompt_len: int, response_len: int) -> RoutedExperts:
    try:
        name = _get(raw, "dtype", str)
        if name not in ROUTED_EXPERT_DTYPES:
            raise RecordError(f"dtype {name!r} is not one of {sorted(ROUTED_EXPERT_DTYPES)}")
        shape, layers = _get(raw, "shape", list), _get(raw, "layers", list)
        if len(shape) != 3 or not all(isinstance(n, int) and n >= 0 for n in shape + layers):
            raise RecordError(f"shape {shape} and layers {layers} must be non-negative integers, shape of 3")
        ids = _array(raw, "ids", ROUTED_EXPERT_DTYPES[name])
        if ids.size != shape[0] * shape[1] * shape[2]:
            raise RecordError(f"ids hold {ids.size} values, shape {shape} needs {shape[0] * shape[1] * shape[2]}")
        routed = RoutedExperts(ids=ids.reshape(shape), num_experts=_get(raw, "num_experts", int), layers=layers,
                               first_position=_get(raw, "first_position", int))
        problem = routed_experts_problem(routed, prompt_len, response_len)
        if problem:
            raise RecordError(problem)
        return routed
    except RecordError as e:
        raise RecordError(f"routed_experts: {e}") from None


def _array(raw: dict[str, Any], key: str, dtype: np.dtype) -> np.ndarray:
    buf = _get(raw, key, bytes)
    if len(buf) % dtype.itemsize:
        raise RecordError(f"{key}: {len(buf)} bytes is not a whole number of {dtype.name} values (truncated?)")
    return np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("="))


def _decode_served(body: dict[str, Any]) -> ServedCompletion:
    raw_choices = _get(body, "choices", list)
    if not raw_choices:
        raise RecordError("served completion has no choices")
    choices = []
    for position, raw in enumerate(raw_choices):
        if not isinstance(raw, dict):
            raise RecordError(f"choices[{position}]: expected a map")
        try:
            tokens, logprobs = _array(raw, "response_tokens", TOKEN_DTYPE), _array(raw, "logprobs", LOGPROB_DTYPE)
            if len(tokens) != len(logprobs):
                raise RecordError(f"logprobs has {len(logprobs)} entries for {len(tokens)} response tokens")
            if not np.all(np.isfinite(logprobs)):
                raise RecordError("logprobs contain NaN or infinity")
            choices.append(ServedChoice(index=_get(raw, "index", int), response_tokens=tokens, logprobs=logprobs,
                                        finish_reason=_get(raw, "finish_reason", str)))
        except RecordError as e:
            raise RecordError(f"choices[{position}]: {e}") from None
    if sorted(c.index for c in choices) != list(range(len(choices))):
        raise RecordError(f"choices: indices {[c.index for c in choices]} are not 0..{len(choices) - 1}")
    return ServedCompletion(run_id=_id(body, "run_id"), request_id=_id(body, "request_id"),
                            prompt_key=_id(body, "prompt_key"),
                            prompt_tokens=_array(body, "prompt_tokens", TOKEN_DTYPE), choices=choices,
                            policy_version=_get(body, "policy_version", int), model=_get(body, "model", str),
                            metadata=_get(body, "metadata", dict), created_at=_time(body, "created_at"),
                            finished_at=_time(body, "finished_at"))


def _decode_feedback(body: dict[str, Any]) -> Feedback:
    reward = _get(body, "reward", float)
    if problem := components_problem(_get(body, "components", dict)):
        raise RecordError(f"components: {problem}")
    components = {str(k): float(v) for k, v in body["components"].items()}
    if not math.isfinite(reward):
        raise RecordError("reward is NaN or infinite")
    index = _get(body, "index", int)
    if index < 0:
        raise RecordError(f"index must be >= 0, got {index}")
    return Feedback(run_id=_id(body, "run_id"), request_id=_id(body, "request_id"), reward=reward,
                    index=index, components=components, created_at=_time(body, "created_at"))
