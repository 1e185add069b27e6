"""MegatronPolicy under torchrun with gloo: one optimizer step at TP=2, PP=2 and DP=2 equals the unsharded
step (transformers + torch AdamW, computed here), including the entropy metric, with the LM head run only from each
micro-batch's first loss position (its input lengths recorded); dist checkpoints reload across layouts; the reference
model stays the initial model after an optimizer step; a vision-language model's (Idefics3, Qwen2.5-VL) vision tower
gets the same gradients on every TP rank, those of transformers, and its checkpoint saved at TP=2 loads at PP=2; samples
with images through the trainer's path (processor re-run, rows with pixels, collated micro-batches; responses holding
placeholders) get the log-probs transformers decodes them with, at TP=2 and PP=2, and train.

One 2-process launch (_worker_policy.py) runs every case and writes exported weights and metrics.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge import schedule
from rft.models.tiny import make_tiny_model
from rft.models.tiny_vlm import make_tiny_idefics3, make_tiny_qwen2_5_vl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _worker_policy as cases  # noqa: E402  (the worker's data and loss function)
from _launch import HERE, assert_succeeded, torchrun  # noqa: E402
from _weights import RELATIVE, exported  # noqa: E402
from _weights import assert_weights_close as close  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("policy-models")
    return {"qwen": make_tiny_model(root / "qwen", arch="qwen2", vocab_size=101, seed=4),
            "llama": make_tiny_model(root / "llama", arch="llama", tie_word_embeddings=False, seed=5),
            "idefics3": make_tiny_idefics3(root / "idefics3", seed=6),
            "qwen2_5_vl": make_tiny_qwen2_5_vl(root / "qwen2_5_vl", seed=7)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy-results")
    (out / "spec.json").write_text(json.dumps({"out_dir": str(out), **{k: str(v) for k, v in models.items()}}))
    assert_succeeded(torchrun([str(HERE / "_worker_policy.py"), str(out / "spec.json")]))
    return out


class Reference:
    """The unsharded step: transformers forward, the same loss, clip_grad_norm_, torch AdamW (weight decay
    on matrices only, as megatron's default param groups)."""

    def __init__(self, hf_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        params = dict(self.model.named_parameters())
        hp = cases.HYPERPARAMETERS
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": hp["weight_decay"]},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=hp["lr"], betas=hp["betas"], eps=1e-8)

    def log_softmax(self, mb: dict) -> torch.Tensor:
        logits = self.model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits.float()
        return torch.log_softmax(logits, dim=-1)

    def token_logprobs(self, mb: dict) -> torch.Tensor:
        return self.log_softmax(mb).gather(-1, mb["target_ids"][..., None])[..., 0]

    def step(self, batches: list[dict]) -> dict[str, float]:
        """Metrics as train_step reports them; `entropy`: -sum_v p log p over the full vocabulary, summed over
        loss tokens / global_tokens."""
        self.optimizer.zero_grad()
        total, fraction, entropy = 0.0, 0.0, 0.0
        for mb in batches:
            log_probs = self.log_softmax(mb)
            token_logprobs = log_probs.gather(-1, mb["target_ids"][..., None])[..., 0]
            loss, metrics = cases.token_mean_nll(token_logprobs, mb)
            loss.backward()
            total += loss.item()
            fraction += metrics["token_fraction"].item()
            per_position = -(log_probs.exp() * log_probs).sum(-1).detach()
            entropy += (per_position[mb["loss_mask"] > 0].sum() / mb["global_tokens"]).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cases.HYPERPARAMETERS["grad_clip"])
        self.optimizer.step()
        return {"loss": total, "token_fraction": fraction, "grad_norm": grad_norm.item(), "entropy": entropy}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(models) -> dict:
    """Metrics and weights after each reference step: {"qwen": [(metrics, state) per step], "llama": [...]}."""
    runs = {}
    for name, steps in (("qwen", (1, 2)), ("llama", (1,))):
        ref = Reference(models[name])
        vocab = ref.model.config.vocab_size
        runs[name] = [(ref.step(cases.micro_batches(step, vocab)), ref.state()) for step in steps]
    return runs


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, steps: int) -> None:
    close(actual, expected, lr=cases.HYPERPARAMETERS["lr"], steps=steps)


def metrics(results: Path, case: str) -> dict:
    return json.loads((results / f"{case}.metrics.json").read_text())["rank0"]


def test_forward_logprobs_match_transformers(results, models):
    ref = Reference(models["qwen"])
    batches = cases.micro_batches(1, ref.model.config.vocab_size)
    saved = load_file(results / "qwen_tp2.logprobs.safetensors")
    with torch.no_grad():
        for i, mb in enumerate(batches):
            assert (saved[f"mb{i}"] - ref.token_logprobs(mb)).abs().max().item() < 1e-5


def test_reference_logprobs_stay_the_initial_models_after_a_step(results, models):
    """qwen_pp2 was built with reference=True and took an optimizer step (checked to change the weights in
    test_one_step_matches_the_unsharded_step) before computing reference log-probs."""
    ref = Reference(models["qwen"])
    batches = cases.micro_batches(1, ref.model.config.vocab_size)
    saved = load_file(results / "qwen_pp2.reference.safetensors")
    assert sorted(saved) == [f"mb{i}" for i in range(len(batches))]
    with torch.no_grad():
        initial = [ref.token_logprobs(mb) for mb in batches]
    ref.step(batches)
    with torch.no_grad():
        stepped = [ref.token_logprobs(mb) for mb in batches]
    for i in range(len(batches)):
        assert (saved[f"mb{i}"] - initial[i]).abs().max().item() < 1e-5
        assert (saved[f"mb{i}"] - stepped[i]).abs().max().item() > 1e-3  # the step is visible in log-probs


@pytest.mark.parametrize("case", ["qwen_tp2", "qwen_pp2", "qwen_dp2"])
def test_one_step_matches_the_unsharded_step(results, reference, case):
    expected_metrics, expected_weights = reference["qwen"][0]
    got = metrics(results, case)["step1"]
    for key in ("loss", "grad_norm", "token_fraction", "entropy"):
        assert got[key] == pytest.approx(expected_metrics[key], rel=RELATIVE), key
    assert got["step_skipped"] == 0.0
    # the LM head ran only from each micro-batch's first loss position (megatron_bridge.schedule, head_from_loss)
    batches = cases.shard_for_data_parallel(cases.micro_batches(1, 101), 0, 2 if case == "qwen_dp2" else 1)
    heads = [cases.SEQ_LEN - schedule.first_loss_position(mb) for mb in batches]
    assert got["head_positions"] == ([] if case == "qwen_pp2" else heads) and all(h < cases.SEQ_LEN for h in heads)
    initial = load_file(Path(json.loads((results / "spec.json").read_text())["qwen"]) / "model.safetensors")
    weights = exported(results, f"{case}.step1.hf")
    assert any(not torch.equal(weights[k], initial[k]) for k in initial), "the step changed nothing"
    assert_weights_close(weights, expected_weights, steps=1)


def test_llama_untied_step_at_pp2_matches_the_unsharded_step(results, reference):
    expected_metrics, expected_weights = reference["llama"][0]
    got = metrics(results, "llama_pp2")["step1"]
    assert got["loss"] == pytest.approx(expected_metrics["loss"], rel=RELATIVE)
    assert got["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=RELATIVE)
    assert got["entropy"] == pytest.approx(expected_metrics["entropy"], rel=RELATIVE)
    assert_weights_close(exported(results, "llama_pp2.step1.hf"), expected_weights, steps=1)


def test_checkpoint_saved_at_tp2_loads_at_tp1_with_identical_weights(results):
    saved = exported(results, "qwen_tp2.step1.hf")
    loaded = exported(results, "qwen_dp2_resumed.loaded.hf")
    assert sorted(saved) == sorted(loaded)
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def test_checkpoint_saved_at_pp2_loads_at_tp2_with_identical_weights(results):
    saved = exported(results, "llama_pp2.step1.hf")
    loaded = exported(results, "llama_tp2.loaded.hf")
    assert sorted(saved) == sorted(loaded)
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def test_resumed_optimizer_state_gives_the_same_second_step(results, reference):
    """Adam moments and step count survive TP=2 -> TP=1: the second step after reloading matches the
    uninterrupted TP=2 run and the unsharded reference."""
    expected_metrics, expected_weights = reference["qwen"][1]
    resumed = metrics(results, "qwen_dp2_resumed")["step2"]
    # torch's fused AdamW on the CPU (the same update as the reference's loop), after a checkpoint's groups too
    assert resumed["fused_adam"] and all(resumed["fused_adam"])
    fused = metrics(results, "qwen_tp2")["step2"]["fused_adam"]
    assert fused and all(fused)
    assert resumed["loss"] == pytest.approx(expected_metrics["loss"], rel=RELATIVE)
    assert metrics(results, "qwen_tp2")["step2"]["loss"] == pytest.approx(expected_metrics["loss"], rel=RELATIVE)
    assert_weights_close(exported(results, "qwen_dp2_resumed.step2.hf"), expected_weights, steps=2)
    assert_weights_close(exported(results, "qwen_tp2.step2.hf"), expected_weights, steps=2)


# (case prefix, model, HF names of its vision tower's parameters, of its encoder layers' in the checkpoint, why
# prompts are not shared)
VLM_CASES = [("vlm", "idefics3", ("model.vision_model.", "model.connector."), "model.vision_model.encoder",
              "a vision-language model"),
             ("qvlm", "qwen2_5_vl", ("model.visual.",), "visual.blocks", "a position embedding other than rotary")]


@pytest.mark.parametrize("case,model,tower,unshared", [(c[0], c[1], c[2], c[4]) for c in VLM_CASES])
def test_vision_tower_gradients_are_the_same_on_every_tp_rank_and_those_of_transformers(results, models, case, model,
                                                                                       tower, unshared):
    """<case>_tp2 (no clipping): the replicated vision tower (and connector)'s gradients after the step's backward
    are bit-identical on both TP ranks (computed identically: megatron_bridge.vision), and equal transformers' for
    the same loss up to float32 rounding, relative to the largest gradient (a key bias's true gradient is 0: softmax
    ignores it, so its ~1e-11 noise is compared on that scale too)."""
    from transformers import AutoModelForImageTextToText

    ranks = [load_file(results / f"{case}_tp2.grads.rank{r}.safetensors") for r in (0, 1)]
    hf = AutoModelForImageTextToText.from_pretrained(models[model], dtype=torch.float32)
    total = 0.0
    for mb in cases.vlm_micro_batches(str(models[model]), model):
        logits = hf(**{k: mb[k] for k in cases.VLM_HF_KEYS[model]}).logits
        logprobs = torch.log_softmax(logits, -1).gather(-1, mb["target_ids"][..., None])[..., 0]
        loss, _ = cases.token_mean_nll(logprobs, mb)
        loss.backward()
        total += loss.item()
    metrics = json.loads((results / f"{case}_tp2.metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(total, rel=1e-6)
    assert metrics["describe"].endswith(f"prompts not shared ({unshared})")
    expected = {n: p.grad for n, p in hf.named_parameters() if n.startswith(tower)}
    assert sorted(ranks[0]) == sorted(ranks[1]) == sorted(expected)
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-3, "the images must reach the loss"
    for name, grad in expected.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert (ranks[0][name] - grad).abs().max().item() <= 1e-5 * scale, name


def engine_logprobs(hf, sample, pixels: dict, image_id: int | None) -> torch.Tensor:
    """[prompt + response - 1] float32 log-probs of `sample`'s tokens as an engine computes them: transformers
    prefills the prompt with its pixels (`image_id`: Qwen2.5-VL's placeholder, whose positions give
    `mm_token_type_ids`; None for Idefics3), then decodes the response one token at a time on the cache, without
    pixels: a placeholder the response holds is an ordinary token at the next text position (generate's
    prepare_inputs_for_generation drops pixels after the prefill; Qwen2.5-VL continues with its `rope_deltas`)."""
    prompt = torch.from_numpy(sample.prompt_tokens)[None]
    tokens = torch.cat([prompt, torch.from_numpy(sample.response_tokens)[None]], dim=1)
    extra = dict(pixels)
    if image_id is not None:
        hf.model.rope_deltas = None  # the previous sample's
        extra["mm_token_type_ids"] = (prompt == image_id).int()
    out = hf(input_ids=prompt, use_cache=True, **extra)
    logits = [out.logits[0]]
    for j in range(prompt.shape[1], tokens.shape[1] - 1):
        out = hf(input_ids=tokens[:, j:j + 1], past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0])
    return torch.log_softmax(torch.cat(logits).float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]


@pytest.mark.parametrize("case,model", [("vlm_tp2", "idefics3"), ("vlm_pp2", "idefics3"),
                                        ("qvlm_tp2", "qwen2_5_vl"), ("qvlm_pp2", "qwen2_5_vl")])
def test_trainer_path_log_probs_of_samples_with_images_are_transformers(results, models, case, model):
    """Samples with images through the trainer's path (the processor re-run per prompt, rows with pixels, the family's
    collate: Idefics3's padding images, Qwen2.5-VL's concatenated patches; a text row among image rows; responses
    that sampled the image (and video) placeholder, after a text prompt and after an image prompt) into the bridge
    at TP=2 and at PP=2 give, on every real row, the float32 log-probs transformers computes for that sample alone as
    an engine does (`engine_logprobs`: the prompt with its own images' pixels, the response decoded on the cache, a
    placeholder there an ordinary token); and a step on them ran (TP=2)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from megatron_bridge.models import bridge_for
    from rft.models.vision import image_token, load_processor, process_prompt

    hf_dir = models[model]
    batches = cases.trainer_micro_batches(str(hf_dir), bridge_for(AutoConfig.from_pretrained(hf_dir)).collate_images)
    if model == "idefics3":  # [rows, most images of a row]
        assert [tuple(mb["pixel_values"].shape[:2]) for mb in batches] == [(3, 2), (3, 2)]
    else:  # every image of the micro-batch
        assert [len(mb["image_grid_thw"]) for mb in batches] == [3, 3]
    processor = load_processor(hf_dir)
    token = processor.tokenizer.convert_tokens_to_ids(image_token(processor))
    samples = [s for g in cases.trainer_groups(processor) for s in g.samples]
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    saved = load_file(results / f"{case}.trainer_logprobs.safetensors")
    assert sorted(saved) == [f"mb{i}" for i in range(len(batches))]
    # the responses of SAMPLED_PLACEHOLDERS hold the image placeholder
    assert [int((s.response_tokens == token).sum()) for s in samples] == [0, 1, 0, 2, 0]
    with torch.no_grad():
        for k, sample in enumerate(samples):  # micro-batches of 3 rows, in order
            pixels = (process_prompt(processor, sample.prompt_text, [(i.data, i.media_type) for i in sample.images])
                      .pixels if sample.images else {})
            expected = engine_logprobs(hf, sample, pixels, token if model == "qwen2_5_vl" else None)
            got = saved[f"mb{k // 3}"][k % 3, :len(expected)]
            assert (got - expected).abs().max().item() < 1e-5, f"sample {k}"
    if case.endswith("tp2"):
        step = json.loads((results / f"{case}.metrics.json").read_text())["trainer_step"]
        assert step["step_skipped"] == 0.0 and step["grad_norm"] > 0 and math.isfinite(step["loss"])


@pytest.mark.parametrize("case,model,layers", [(c[0], c[1], c[3]) for c in VLM_CASES])
def test_vision_language_checkpoint_saved_at_tp2_loads_at_pp2_with_identical_weights(results, models, case, model,
                                                                                     layers):
    saved = exported(results, f"{case}_tp2.step1.hf")
    loaded = exported(results, f"{case}_pp2.loaded.hf")
    initial = load_file(models[model] / "model.safetensors")
    assert sorted(saved) == sorted(loaded) == sorted(initial)
    assert all(not torch.equal(saved[k], initial[k]) for k in initial if k.startswith(layers))
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
