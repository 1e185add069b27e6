"""The SmolVLM-shaped VLM built from a Llama language model (rft/models/smolvlm.py, `rft model build-vlm`) and the SFT
demonstrations of image tasks (rft/data/demonstrations.py): the built model's text path is the language model's
exactly, its processor expands a 64x64 image into the tower's tokens, and an image task's demonstration carries the
images, the prompt text and the processor's prompt ids (the trainer's check passes on it)."""
from __future__ import annotations

import dataclasses
import zipfile

import pytest

from rft.data.config import DataConfig
from rft.data.demonstrations import demonstration_groups
from rft.data.easy_vqa import WHEEL
from rft.data.tasks import DatasetError, build_picker
from rft.models.config import ModelConfig
from rft.models.smolvlm import BuildError, Tower, build_vlm
from rft.models.tiny import make_tiny_model
from rft.models.tiny_vlm import make_tiny_idefics3, with_image_parts
from rft.models.vision import engine_prompt_problem, load_processor, process_prompt, render_chat
from rft.schema import decode_group, encode
from rft.text.chat import ChatPrompt, end_of_turn_id
from tests.vision_prompts import encoded_image

# SmolLM2's template shape (ChatML with a default system turn): the stand-in language model gets it
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nDefault.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
needs_wheel = pytest.mark.skipif(not zipfile.is_zipfile(WHEEL),
                                 reason=f"`make` downloads the easy-vqa wheel to {WHEEL}")


@pytest.fixture(scope="module")
def language(tmp_path_factory):
    """A tiny Llama with a ChatML template, standing in for SmolLM2-135M-Instruct (same architecture, tied)."""
    from transformers import AutoTokenizer

    from rft.models.tiny import build_tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("lm") / "llama", arch="llama", tie_word_embeddings=True,
                           vocab_size=build_tokenizer().get_vocab_size() + 2)  # rows for the ChatML tokens
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path


def test_the_vlms_text_path_is_the_language_model_and_an_image_is_16_tokens(language, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, Idefics3ForConditionalGeneration

    out = build_vlm(language, tmp_path / "vlm", Tower(hidden_size=32, layers=1, heads=2))
    lm = AutoModelForCausalLM.from_pretrained(language, dtype=torch.float32).eval()
    vlm = Idefics3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    processor = load_processor(out)
    vocab = lm.config.vocab_size
    messages = [{"role": "user", "content": "3+4="}]
    ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert int(ids.max()) < vocab
    with torch.no_grad():
        expected, got = lm(ids).logits, vlm(input_ids=ids).logits
    assert got.shape[-1] == len(processor.tokenizer) > vocab
    assert torch.equal(got[..., :vocab], expected)  # copied exactly, the image tokens appended
    new_rows = vlm.get_input_embeddings().weight[vocab:]
    assert torch.allclose(new_rows, lm.get_input_embeddings().weight.mean(dim=0).expand_as(new_rows))
    # the new connector is drawn so an image token's embedding has about a text token's norm
    projection = vlm.model.connector.modality_projection.proj.weight
    text_norm = lm.get_input_embeddings().weight.norm(dim=1).mean()
    assert abs(projection.std() * projection.numel() ** 0.5 / text_norm - 1) < 0.05
    # the template renders text as the language model's does, and an image part as <image>
    assert render_chat(processor, messages) == lm_template(language, messages)
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = render_chat(processor, parts)
    assert text == lm_template(language, [{"role": "user", "content": "<image>what?"}])
    processed = process_prompt(processor, text, [encoded_image(64, 64, seed=0)])
    image_id = processor.image_token_id
    assert processed.token_ids.count(image_id) == Tower().image_tokens == 16  # (64 / 8)^2 / 2^2
    assert processed.image_tokens == 16 + 3  # <fake_token_around_image><global-img> ... <fake_token_around_image>
    assert tuple(processed.pixels["pixel_values"].shape) == (1, 1, 3, 64, 64)  # no splitting: one 64x64 view
    with torch.no_grad():  # the image path runs: the tower's tokens go in at the placeholders
        vlm(input_ids=torch.tensor([processed.token_ids]), **processed.pixels)


def lm_template(path, messages):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)


def test_build_refuses_what_it_cannot_build(tmp_path, language):
    qwen = make_tiny_model(tmp_path / "qwen", arch="qwen2")
    with pytest.raises(BuildError, match="not a Hugging Face Llama directory"):
        build_vlm(qwen, tmp_path / "out")
    with pytest.raises(BuildError, match="multiple of patch_size"):
        build_vlm(language, tmp_path / "out", Tower(image_size=60))
    with pytest.raises(ValueError, match="writes no message"):
        with_image_parts("{{ messages[0].text }}")


@needs_wheel
def test_image_demonstrations_carry_images_prompt_text_and_the_processors_ids(tmp_path):
    vlm = make_tiny_idefics3(tmp_path / "vlm", image_size=64)
    processor = load_processor(vlm)
    model = ModelConfig(path=str(vlm), chat_template=True, system_prompt="S.", max_prompt_len=256)
    data = DataConfig(format="easy_vqa", path=f"{WHEEL}:train", generated_tasks=3, selector="sequential")
    groups = list(demonstration_groups(data, model, processor.tokenizer, run_id="r", processor=processor))
    tasks = list(build_picker(data, run_id="r").drain())
    assert len(groups) == len(tasks) == 3
    end = end_of_turn_id(processor.tokenizer)
    for group, task in zip(groups, tasks, strict=True):
        [sample] = group.samples
        assert sample.images == task.images and len(sample.images) == 1
        assert sample.prompt_text == render_chat(processor, ChatPrompt.of(model).image_messages(task.prompt, 1))
        assert sample.prompt_text.startswith("System:S.<end_of_utterance>\nUser:<image>")
        images = [(i.data, i.media_type) for i in sample.images]
        assert engine_prompt_problem(processor, sample.prompt_text, images, sample.prompt_tokens.tolist()) is None
        assert sample.response_tokens.tolist() == processor.tokenizer(task.answer, add_special_tokens=False)[
            "input_ids"] + [end]
        assert decode_group(*encode(group)) == group  # a valid record: images and prompt_text survive the wire
    plain = ModelConfig(path=str(vlm), max_prompt_len=256)  # no chat template: the placeholder, then the prompt
    one = dataclasses.replace(data, generated_tasks=1)
    [group] = list(demonstration_groups(one, plain, processor.tokenizer, run_id="r", processor=processor))
    [task] = list(build_picker(one, run_id="r").drain())
    assert group.samples[0].prompt_text == "<image>" + task.prompt
    # a text model cannot take an image task; a prompt over max_prompt_len is refused whole
    with pytest.raises(DatasetError, match="not a vision-language model"):
        list(demonstration_groups(data, model, processor.tokenizer, run_id="r"))
    short = ModelConfig(path=str(vlm), chat_template=True, max_prompt_len=20)
    with pytest.raises(DatasetError, match="never cut inside an image"):
        list(demonstration_groups(data, short, processor.tokenizer, run_id="r", processor=processor))

