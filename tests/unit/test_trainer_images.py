"""Images on the trainer's side, in one process with the tiny Idefics3's processor (in memory): the trainer's check
re-runs the processor on each sample with images and refuses a prompt the engine expanded otherwise (once per
prompt, not per sample), or images on a text model; rows carry their pixels and micro-batches the family's collated
tensors (Idefics3: [b, images, 3, H, W], all-zero padding images, masks False); and the trainer's loop (stand-in
policy, in-memory transport) dead-letters a mismatching group with its reason and trains the matching one on its
pixels; trainer.pack_sequences is refused by name for a vision-language model. (Log-probs through the bridge
against transformers: tests/distributed/test_megatron_policy.py.)"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import Idefics3Config

from megatron_bridge.models import bridge_for
from rft.models.tiny_vlm import tiny_idefics3_processor
from rft.models.vision import process_prompt
from rft.schema import HEADER_ERROR, ExperienceGroup, Image, ImageLimits, RewardRange, Sample, group_id_for
from rft.trainer.batch import TrainableLimits, plan_micro_batches, rows_from_groups
from rft.trainer.images import ImagePrompts
from rft.transport.memory import MemoryTransport
from tests.records import make_group, read_topic
from tests.unit.test_trainer_loop import StandInPolicy, build, fill, make_config
from tests.vision_prompts import encoded_image

SPLIT = "User:<image>what colour?<end_of_utterance>\nAssistant:"  # 64x48: 2x2 tiles and a global view: 5 images
TWO = "User:<image>and<image>?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def processor():
    return tiny_idefics3_processor(longest_edge=64)


@pytest.fixture(scope="module")
def bridge(processor):
    """The Idefics3 family of a model the tiny processor fits (no weights: collation needs the config only)."""
    return bridge_for(idefics3_config(processor))


def idefics3_config(processor) -> Idefics3Config:
    return Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(processor.tokenizer), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        scale_factor=2, image_token_id=processor.image_token_id, architectures=["Idefics3ForConditionalGeneration"])


def images_of(*sizes: tuple[int, int], seed: int = 0) -> list[Image]:
    return [Image.of(*encoded_image(w, h, seed=seed + j)) for j, (w, h) in enumerate(sizes)]


def image_group(processor, task: int, text: str, images: list[Image], *, n_samples: int = 3,
                engine_ids: list[int] | None = None) -> ExperienceGroup:
    """A group whose samples were generated from `text` and `images`; their prompt ids are the processor's (the
    engine's expansion), or `engine_ids`."""
    prompt = np.asarray(engine_ids if engine_ids is not None else
                        process_prompt(processor, text, [(i.data, i.media_type) for i in images]).token_ids)
    rng = np.random.default_rng(task)
    samples = [Sample(sample_index=j, prompt_tokens=prompt, response_tokens=rng.integers(3, 60, 4),
                      logprobs=-rng.random(4).astype(np.float32), loss_mask=np.ones(4, dtype=np.uint8),
                      reward=float(j % 2), images=list(images), prompt_text=text) for j in range(n_samples)]
    task_id = f"task-{task}"
    return ExperienceGroup(run_id="run", task_id=task_id, group_id=group_id_for("run", task_id, 0), attempt=0,
                           explorer_id="explorer-test", policy_version=0, samples=samples)


def limits(images: ImagePrompts | None, vocab_size: int) -> TrainableLimits:
    return TrainableLimits(vocab_size=vocab_size, max_prompt_len=256, max_response_len=16,
                           rewards=RewardRange(0, 1), images=images)


# ---------------------------------------------------------------------------------------------- the family's collate


def test_idefics3_collates_each_rows_images_then_all_zero_padding_images(processor, bridge):
    split = process_prompt(processor, SPLIT, [encoded_image(64, 48, seed=0)]).pixels  # 2x2 tiles and a global view
    two = process_prompt(processor, TWO, [encoded_image(32, 32, seed=1), encoded_image(20, 20, seed=2)]).pixels
    assert split["pixel_values"].shape[1] == 5 and two["pixel_values"].shape[1] == 10
    # a text row between them, a padding row last
    out = bridge.collate_images([split, {}, two, {}])
    assert sorted(out) == ["pixel_attention_mask", "pixel_values"]
    values, mask = out["pixel_values"], out["pixel_attention_mask"]
    assert tuple(values.shape) == (4, 10, 3, 32, 32) and tuple(mask.shape) == (4, 10, 32, 32)
    assert values.dtype == split["pixel_values"].dtype and mask.dtype == split["pixel_attention_mask"].dtype
    assert torch.equal(values[0, :5], split["pixel_values"][0])
    assert torch.equal(mask[0, :5], split["pixel_attention_mask"][0])
    assert torch.equal(values[2], two["pixel_values"][0]) and torch.equal(mask[2], two["pixel_attention_mask"][0])
    for row, first in ((0, 5), (1, 0), (3, 0)):  # padding images: all zero (the model drops them), mask all False
        assert not values[row, first:].any() and not mask[row, first:].any()
    assert values[0, :5].flatten(1).any(-1).all() and mask[0, :5].all()  # real images are not all zero
    assert bridge.collate_images([{}, {}]) == {}  # no image in the micro-batch: no image tensors


def test_idefics3_collate_refuses_what_it_cannot_batch(processor, bridge):
    pixels = process_prompt(processor, TWO, [encoded_image(32, 32, seed=1), encoded_image(20, 20, seed=2)]).pixels
    smaller = {"pixel_values": torch.zeros(1, 2, 3, 16, 16)}
    with pytest.raises(ValueError, match=r"row 1: images of \(3, 16, 16\), another row's are \(3, 32, 32\)"):
        bridge.collate_images([pixels, smaller])
    with pytest.raises(ValueError, match=r"row 0: image tensors \['image_grid_thw'\] are not Idefics3's"):
        bridge.collate_images([{**pixels, "image_grid_thw": torch.ones(2, 3)}])
    with pytest.raises(ValueError, match=r"row 0: pixel_values of shape \(2, 3, 32\)"):
        bridge.collate_images([{"pixel_values": torch.zeros(2, 3, 32)}])
    text = bridge_for(idefics3_config(processor).text_config.__class__(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        architectures=["LlamaForCausalLM"]))
    assert text.image_keys == ()
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no images"):
        text.collate_images([pixels])


# ------------------------------------------------------------------------------------------------ the trainer's check


def test_the_check_reruns_the_processor_once_per_prompt_and_refuses_a_mismatch(processor):
    images = ImagePrompts(processor)
    vocab = len(processor.tokenizer)
    good = image_group(processor, 0, SPLIT, images_of((64, 48)), n_samples=4)
    assert limits(images, vocab).problem(good) is None
    assert images.runs == 1  # the group's 4 samples share their prompt: one processor run
    # the engine expanded the image into fewer tokens than this processor does (e.g. another image size)
    expected = good.samples[0].prompt_tokens.tolist()
    short = expected[:8] + expected[12:]
    bad = image_group(processor, 1, SPLIT, images_of((64, 48)), engine_ids=short)
    problem = limits(images, vocab).problem(bad)
    assert problem is not None and problem.startswith(
        f"samples[0]: images: the engine's prompt is {len(short)} tokens, the processor's {len(expected)} (image "
        f"tokens: engine ")
    assert "first difference at position 8" in problem
    # the same images with another prompt text than the engine's: the expansion differs
    other = dataclasses.replace(good, samples=[dataclasses.replace(good.samples[0], prompt_text=TWO)])
    assert "the processor refuses the sample's prompt: the prompt has 2 image placeholders" in \
        limits(images, vocab).problem(other)
    # the run's image limits apply (data.max_images)
    one = ImagePrompts(processor, limits=ImageLimits(max_images=1, origin="data"))
    assert limits(one, vocab).problem(image_group(processor, 2, TWO, images_of((32, 32), (20, 20)))) == \
        "samples[0]: images: 2 images, over data.max_images = 1"
    # an image placeholder sampled into a response is an ordinary token (the engine's, and the model's: it reads
    # placeholders only inside prompts), after an image prompt or a text prompt alike
    image_id = processor.image_token_id
    sampled = dataclasses.replace(good, samples=[dataclasses.replace(
        good.samples[0], response_tokens=np.array([5, image_id, 6, image_id]))])
    assert limits(images, vocab).problem(sampled) is None
    text = make_group("run", 3, n_samples=1, responses=[[image_id, 5, image_id]])
    assert limits(images, vocab).problem(text) is None
    # ... but one in a text prompt, where no image is, is refused
    text.samples[0].prompt_tokens[2] = image_id
    assert limits(images, vocab).problem(text) == (
        f"samples[0]: images: the prompt holds the placeholder '<image>' (id {image_id}) with no image")
    # a video placeholder (Qwen2.5-VL's processor has one; the model takes no video): in a response an ordinary
    # token, in a prompt refused, with images or without
    from rft.models.qwen_vl import QwenVLImageProcessor
    from rft.models.tiny_vlm import tiny_qwen2_5_vl_parts

    fast, image_processor = tiny_qwen2_5_vl_parts()
    qwen = ImagePrompts(QwenVLImageProcessor(image_processor=image_processor, tokenizer=fast))
    video_id, pad_id = fast.convert_tokens_to_ids("<|video_pad|>"), fast.convert_tokens_to_ids("<|image_pad|>")
    video = make_group("run", 4, n_samples=1, responses=[[5, pad_id, video_id]])
    assert limits(qwen, len(fast)).problem(video) is None
    video.samples[0].prompt_tokens[0] = video_id
    assert limits(qwen, len(fast)).problem(video) == (
        f"samples[0]: images: the prompt holds the placeholder '<|video_pad|>' (id {video_id}) with no video: "
        "videos are not taken")
    # images on a text model
    assert limits(None, vocab).problem(good) == (
        "samples[0]: 1 images, and the model (model.path) is not a vision-language model (its config.json has no "
        "vision_config)")


# ------------------------------------------------------------------------------------------ rows and micro-batches


def test_rows_carry_pixels_and_micro_batches_the_collated_images(processor, bridge):
    images = ImagePrompts(processor)
    groups = [image_group(processor, 0, TWO, images_of((32, 32), (20, 20), seed=5), n_samples=2),
              make_group("run", 1, n_samples=1),  # a text group in the same step
              image_group(processor, 2, SPLIT, images_of((64, 48), seed=7), n_samples=2)]
    rows = rows_from_groups(groups, [np.zeros(len(g.samples)) for g in groups], images=images)
    assert [r.pixels is None for r in rows] == [False, False, True, False, False]
    assert images.runs == 0  # run when a micro-batch is packed: by the data-parallel rank that trains the row
    over_three = plan_micro_batches(rows, dp_size=3, micro_batch_size=3)  # rows dealt round-robin
    assert "pixel_values" not in over_three.for_rank(2, collate_images=bridge.collate_images)[0]  # the text row
    assert images.runs == 0
    over_three.for_rank(1, collate_images=bridge.collate_images)  # rows 1 and 4: one of each prompt
    assert images.runs == 2
    plan = plan_micro_batches(rows, dp_size=1, micro_batch_size=3)
    first, second = plan.for_rank(0, collate_images=bridge.collate_images)
    assert images.runs == 2  # once per prompt
    assert tuple(first["pixel_values"].shape) == (3, 10, 3, 32, 32)  # rows 0, 1 (2 x 5 tiles) and the text row
    assert tuple(second["pixel_values"].shape) == (3, 5, 3, 32, 32)  # rows 3, 4 (5 tiles) and a padding row
    expected = [r.pixels() if r.pixels is not None else None for r in rows] + [None]
    for i, pixels in enumerate(expected):
        got = (first if i < 3 else second)["pixel_values"][i % 3]
        if pixels is None:
            assert not got.any()
        else:
            assert torch.equal(got, pixels["pixel_values"][0])
    # each row's image placeholders are its own images' tokens (4 per image or tile)
    image_id = processor.image_token_id
    for mb in (first, second):
        real = mb["pixel_values"].flatten(2).any(-1).sum(-1)
        assert torch.equal((mb["input_ids"] == image_id).sum(-1), 4 * real)
    with pytest.raises(ValueError, match="rows with images: a micro-batch needs the model's collate_images"):
        plan.for_rank(0)
    with pytest.raises(ValueError, match="samples with images, and the model has no image processor"):
        rows_from_groups(groups[:1], [np.zeros(2)])


# ----------------------------------------------------------------------------------------------- the trainer's loop


class ImagePolicy(StandInPolicy):
    """StandInPolicy with the Idefics3 family's collate; it keeps each step's pixel_values shapes."""

    def __init__(self, trained, bridge):
        super().__init__(trained)
        self.collate_images = bridge.collate_images
        self.image_id = bridge.image_token_id
        self.pixels: list[list[tuple[int, ...]]] = []
        self.placeholders: list[tuple[int, int, int]] = []

    def train_step(self, micro_batches, loss_fn):
        self.pixels.append([tuple(mb["pixel_values"].shape) for mb in micro_batches if "pixel_values" in mb])
        # where each micro-batch's image placeholders stand: (row, position, the row's prompt length)
        self.placeholders = [(int(i), int(t), int(mb["prompt_lens"][i])) for mb in micro_batches
                             for i, t in (mb["input_ids"] == self.image_id).nonzero().tolist()]
        return super().train_step(micro_batches, loss_fn)


def test_the_trainer_dead_letters_a_mismatching_group_and_trains_the_matching_one(tmp_path, processor, bridge):
    """The matching group has a response that sampled the placeholder: trained, the micro-batch's `prompt_lens`
    (which the model reads placeholders within) ending before it."""
    cfg = make_config(tmp_path, groups_per_step=1).with_values({"run.max_steps": 1})
    processor.save_pretrained(cfg.model.path)  # the model directory of a vision-language model (no weights needed)
    idefics3_config(processor).save_pretrained(cfg.model.path)
    good = image_group(processor, 0, SPLIT, images_of((64, 48)))
    good.samples[1].response_tokens[2] = processor.image_token_id
    ids = good.samples[0].prompt_tokens.tolist()
    bad = image_group(processor, 1, SPLIT, images_of((64, 48), seed=3), engine_ids=ids[:8] + ids[12:])
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, [bad, good])
    policy = ImagePolicy([], bridge)
    trainer = build(cfg, transport, [], policy)
    try:
        trainer.run()
        assert trainer.images is not None and trainer.images.runs == 2  # one per group: the rows reused the check's
    finally:
        trainer.close()
    assert policy.pixels == [[(4, 5, 3, 32, 32)]]  # the good group's 3 rows and a padding row, 5 tiles each
    prompt = len(good.samples[0].prompt_tokens)
    past = [(row, t) for row, t, n in policy.placeholders if t >= n]
    assert past == [(1, prompt + 2)] and len(policy.placeholders) == 3 * 20 + 1  # 20 in each prompt (5 x 4)
    assert {n for _, _, n in policy.placeholders} == {prompt}
    [dead] = read_topic(transport, cfg.topic("dead_letter"))
    assert dict(dead.headers)[HEADER_ERROR].decode().startswith(
        "cannot be trained: samples[0]: images: the engine's prompt is ")
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in metrics if m.get("step") == 1] == [{"untrainable": 1}]


def test_a_vision_language_model_refuses_packed_sequences_by_name(tmp_path, processor):
    from rft.algorithms import Needs
    from rft.config import ConfigError
    from rft.trainer.main import build_policy

    cfg = make_config(tmp_path).with_values({"trainer.pack_sequences": True})
    idefics3_config(processor).save_pretrained(cfg.model.path)
    with pytest.raises(ConfigError, match="trainer.pack_sequences: .* is a vision-language model, and packed "
                                          "sequences do not take images; set it to false"):
        build_policy(cfg.trainer, run=cfg.run, model=cfg.model, needs=Needs(), temperature=1.0)
