"""Image prompts through the transformers engine on a tiny random Qwen2.5-VL, without torchvision: greedy output
equals a plain transformers `generate` on the processor's tensors (`pixel_values`, `image_grid_thw`), the prompt ids
are the processor contract's expansion, and an in-place reload of other weights (checkpoint names, `visual.*` and
`model.layers.*`) answers as an engine started on them."""
from __future__ import annotations

import pytest

from rft.engine import ImagePrompt, SamplingSettings, TransformersEngine
from rft.models.vision import as_pil, load_processor, placeholder, process_prompt
from tests.vision_prompts import encoded_image

GREEDY = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
USER, ASSISTANT = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# one image, two images of different grids, one past the pixel maximum (resized down)
PROMPTS = [ImagePrompt(f"{USER}{MARK}what colour?{ASSISTANT}", (encoded_image(40, 24, seed=1),)),
           ImagePrompt(f"{USER}{MARK}and{MARK}?{ASSISTANT}", (encoded_image(64, 64, seed=2),
                                                              encoded_image(48, 20, seed=3))),
           ImagePrompt(f"{USER}{MARK}3+4={ASSISTANT}", (encoded_image(300, 200, seed=4),))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Qwen2.5-VL (seed 0) and other weights of its shape (seed 1)."""
    from rft.models.tiny_vlm import make_tiny_qwen2_5_vl

    root = tmp_path_factory.mktemp("qwen-vl")
    return make_tiny_qwen2_5_vl(root / "v0", seed=0), make_tiny_qwen2_5_vl(root / "v1", seed=1)


@pytest.fixture(scope="module")
def engine(models):
    engine = TransformersEngine(models[0])
    yield engine
    engine.close()


def plain_generate(model_dir, prompt: ImagePrompt, logprobs: list[float] | None = None) -> list[int]:
    """transformers alone: the model from its directory, the processor's tensors (its `mm_token_type_ids` included:
    transformers builds the MRoPE positions from them), greedy `generate`; the new tokens up to the first end of
    turn, and their log-probs appended to `logprobs`."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = load_processor(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    inputs = processor(text=[prompt.text], images=[[as_pil(i) for i in prompt.images]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    new = new[:new.index(end) + 1] if end in new else new
    if logprobs is not None:
        logprobs.extend(float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=False))
    return new


def test_greedy_equals_plain_transformers(models, engine):
    assert placeholder(engine.processor) == MARK
    generations = engine.generate_images(PROMPTS, GREEDY)
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert generation.prompt_token_ids == process_prompt(engine.processor, prompt.text, prompt.images).token_ids
        expected: list[float] = []
        assert generation.completions[0].token_ids == plain_generate(models[0], prompt, expected)
        # the same positions (MRoPE) as transformers, so the same log-probs, not only the same argmax
        assert generation.completions[0].logprobs == pytest.approx(expected, abs=1e-5)
        assert generation.completions[0].weights_version == 0
    # the image reaches the model: the same text with another image is answered otherwise
    other = ImagePrompt(PROMPTS[0].text, (encoded_image(40, 24, seed=101),))
    answer = engine.generate_images([other], GREEDY)[0].completions[0].token_ids
    assert answer == plain_generate(models[0], other) != generations[0].completions[0].token_ids
    sampled = engine.generate_images(PROMPTS[1:2], SamplingSettings(n=2, temperature=1.0, max_tokens=4))
    assert len(sampled[0].completions) == 2 and all(1 <= len(c.token_ids) <= 4 for c in sampled[0].completions)


def test_reload_in_place_answers_as_the_new_weights(models, engine):
    before = [g.completions[0].token_ids for g in engine.generate_images(PROMPTS, GREEDY)]
    fresh = TransformersEngine(models[1])
    expected = [g.completions[0].token_ids for g in fresh.generate_images(PROMPTS, GREEDY)]
    fresh.close()
    engine.load_weights(models[1], 3)  # the checkpoint's names (visual.*, model.layers.*), not the modules'
    after = engine.generate_images(PROMPTS, GREEDY)
    assert [g.completions[0].token_ids for g in after] == expected != before
    assert [g.completions[0].weights_version for g in after] == [3, 3, 3]
    engine.load_weights(models[0], 4)
    assert [g.completions[0].token_ids for g in engine.generate_images(PROMPTS, GREEDY)] == before
