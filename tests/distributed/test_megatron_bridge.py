"""megatron_bridge conversion under torchrun with gloo: logits against transformers, exact round trips,
bucketed export with its memory bound, and the `python -m megatron_bridge.check` command.

One 2-process launch runs every conversion case (_worker_bridge.py) and writes its results; the
tests below compare them with transformers in this process.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model
from rft.models.tiny_vlm import make_tiny_idefics3, make_tiny_qwen2_5_vl
from rft.models.vision import is_vision_model, load_processor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import HERE, REPO, assert_succeeded, torchrun  # noqa: E402

pytestmark = pytest.mark.distributed

BUCKET_BYTES = 1 << 20
CASES = [  # (case name, model name, tp, pp); world size 2 throughout, so tp=pp=1 means dp=2
    ("big_tp2", "big", 2, 1),
    ("big_pp2", "big", 1, 2),
    ("qwen_tp2", "qwen", 2, 1),
    ("qwen_pp2", "qwen", 1, 2),
    ("qwen_tp1", "qwen", 1, 1),
    ("llama_tp2", "llama", 2, 1),
    ("llama_pp2", "llama", 1, 2),
    ("llama3_rope_tp2", "llama3", 2, 1),
    ("qwen3_tp2", "qwen3", 2, 1),
    ("qwen3_pp2_uneven", "qwen3", 1, 2),
    ("qwen3moe_ep2", "qwen3moe", 1, 1),
    ("qwen3moe_tp2", "qwen3moe", 2, 1),
    ("qwen3moe_pp2_uneven", "qwen3moe", 1, 2),
    ("qwen2moe_ep2", "qwen2moe", 1, 1),
    ("qwen2moe_tp2", "qwen2moe", 2, 1),
    ("idefics3_tp2", "idefics3", 2, 1),
    ("idefics3_pp2", "idefics3", 1, 2),
    ("idefics3_tp1", "idefics3", 1, 1),
    ("qwen2_5_vl_tp2", "qwen2_5_vl", 2, 1),
    ("qwen2_5_vl_pp2", "qwen2_5_vl", 1, 2),
    ("qwen2_5_vl_tp1", "qwen2_5_vl", 1, 1),
]
# more of a case's layout: expert parallel size, layers per pipeline stage (uneven split)
LAYOUT = {"qwen3_pp2_uneven": {"pp_layers": [1, 3]}, "qwen3moe_ep2": {"ep": 2},
          "qwen3moe_pp2_uneven": {"pp_layers": [3, 1]}, "qwen2moe_ep2": {"ep": 2},
          **{name: {"images": model} for name, model, _, _ in CASES if model in ("idefics3", "qwen2_5_vl")}}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Qwen2: 4 layers, GQA, tied embeddings, vocab 101 (padded to 102 at TP=2). Llama: untied, vocab 99. Llama 3: rope
    scaling (rope_type llama3). Qwen3: head_dim 48 (not hidden / heads = 32). Qwen3-MoE: 8 experts, top 2, renormalised,
    layer 1 dense. Qwen2-MoE: 4 experts, top 2 not renormalised, gated shared expert. Idefics3: a SigLIP tower of 2
    layers on 32 px images (patch 8, pixel shuffle 2: 4 features per image) and a 4-layer untied Llama. Qwen2.5-VL: a
    vision tower of 2 blocks (one windowed, one full), patch 8, merge 2, and a 4-layer untied Qwen2 with MRoPE
    sections 4, 6, 6. "big": a 19 MB Qwen2 for the export memory bound."""
    root = tmp_path_factory.mktemp("bridge-models")
    return {"big": make_tiny_model(root / "big", arch="qwen2", hidden_size=256, heads=8, kv_heads=2, layers=8,
                                   intermediate_size=512, vocab_size=101, seed=3),
            "qwen": make_tiny_model(root / "qwen", arch="qwen2", layers=4, vocab_size=101, seed=1),
            "llama": make_tiny_model(root / "llama", arch="llama", tie_word_embeddings=False, seed=2),
            "llama3": make_tiny_model(root / "llama3", arch="llama", llama3_rope_factor=8.0, seed=3),
            "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", layers=4, head_dim=48, seed=4),
            "qwen3moe": make_tiny_model(root / "qwen3moe", arch="qwen3_moe", layers=4, experts=8, mlp_only_layers=(1,),
                                        tie_word_embeddings=False, seed=5),
            "qwen2moe": make_tiny_model(root / "qwen2moe", arch="qwen2_moe", layers=2, norm_topk_prob=False, seed=6),
            "idefics3": make_tiny_idefics3(root / "idefics3", layers=4, seed=9),
            "qwen2_5_vl": make_tiny_qwen2_5_vl(root / "qwen2_5_vl", layers=4, seed=10)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bridge-results")
    spec = {"out_dir": str(out), "bucket_bytes": BUCKET_BYTES,
            "cases": [{"name": name, "hf_dir": str(models[model]), "tp": tp, "pp": pp, **LAYOUT.get(name, {})}
                      for name, model, tp, pp in CASES]}
    (out / "spec.json").write_text(json.dumps(spec))
    assert_succeeded(torchrun([str(HERE / "_worker_bridge.py"), str(out / "spec.json")]))
    return out


def hf_model(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("case,model", [(c[0], c[1]) for c in CASES])
def test_logits_match_transformers(results, models, case, model):
    saved = load_file(results / f"{case}.logits.safetensors")
    inputs = {k: v for k, v in saved.items() if k != "logits"}  # input_ids (and a VLM's pixel tensors)
    with torch.no_grad():
        expected = hf_model(models[model])(**inputs).logits
    assert saved["logits"].shape == expected.shape
    assert (saved["logits"] - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["idefics3_tp2", "idefics3_tp1"])
def test_image_placeholders_that_do_not_match_the_images_are_refused(results, case):
    """image_batch's 3 real images give 12 features; with one placeholder replaced there are 11 (transformers'
    masked_scatter would silently drop the last feature)."""
    message = (results / f"{case}.mismatch.txt").read_text()
    assert "11 image placeholder tokens (id 100) and its images give 12 features (3 images x 4)" in message


@pytest.mark.parametrize("case", ["qwen2_5_vl_tp2", "qwen2_5_vl_tp1"])
def test_qwen_image_placeholders_that_do_not_match_the_grids_are_refused(results, case):
    """qwen_image_batch's 3 images (grids 1x4x4, 1x8x6, 1x4x4, merged 2x2) give 20 features; with one placeholder
    replaced there are 19, refused before the vision tower runs."""
    message = (results / f"{case}.mismatch.txt").read_text()
    assert ("19 image placeholder tokens (id 103) and its images give 20 features (3 images of grids "
            "[[1, 4, 4], [1, 8, 6], [1, 4, 4]], merged 2x2)") in message


def test_a_bfloat16_qwen_vision_tower_keeps_transformers_float32_rotary_frequencies(results, models):
    """transformers keeps the tower's rotary frequencies in float32 at any dtype; a bfloat16 copy would rotate a
    real tower's queries and keys (head_dim 80, positions past 100) by up to ~0.2 in cos."""
    from transformers import AutoModelForImageTextToText

    saved = load_file(results / "qwen2_5_vl_tp1.bf16_tower_rope.safetensors")
    hf = AutoModelForImageTextToText.from_pretrained(models["qwen2_5_vl"], dtype=torch.bfloat16).model.visual
    for name, tensor in saved.items():
        expected = getattr(hf.rotary_pos_emb, name)
        assert tensor.dtype == expected.dtype == torch.float32 and torch.equal(tensor, expected), name


@pytest.mark.parametrize("case,model", [(c[0], c[1]) for c in CASES])
def test_round_trip_reproduces_every_tensor_exactly(results, models, case, model):
    original = load_file(models[model] / "model.safetensors")
    exported_dir = results / f"{case}.hf"
    index = json.loads((exported_dir / "model.safetensors.index.json").read_text())
    exported = {}
    for shard in sorted(set(index["weight_map"].values())):
        exported.update(load_file(exported_dir / shard))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("case,model", [(c[0], c[1]) for c in CASES])
def test_exported_directory_loads_in_transformers_with_the_same_weights(results, models, case, model):
    reference = hf_model(models[model]).state_dict()
    loaded = hf_model(results / f"{case}.hf").state_dict()
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    if is_vision_model(models[model]):  # the processor travels with the export (a next stage starts from it)
        theirs, ours = load_processor(models[model]), load_processor(results / f"{case}.hf")
        assert type(ours) is type(theirs) and ours.image_processor.to_dict() == theirs.image_processor.to_dict()


@pytest.mark.parametrize("case", ["big_tp2", "big_pp2"])
def test_bucketed_export_holds_at_most_one_bucket_plus_one_tensor(results, models, case):
    """Peak resident memory of the publishing rank during export (see _worker_bridge.py for how it is
    measured) stays within one bucket plus one parameter in flight, far below the model's size."""
    report = json.loads((results / f"{case}.export.json").read_text())
    config = json.loads((models["big"] / "config.json").read_text())
    sizes = [sum(bucket.values()) for bucket in report["buckets"]]
    largest_tensor = max(size for bucket in report["buckets"] for size in bucket.values())
    assert all(size <= BUCKET_BYTES or len(bucket) == 1 for size, bucket in zip(sizes, report["buckets"], strict=True))
    assert len(sizes) > 3
    # In flight besides the bucket: one megatron parameter, at most the fused gate+up, held at most
    # twice while converted (gathered shards and gloo's receive buffer, or shards and HF tensors);
    # 1 MiB for everything else the process allocates meanwhile.
    fused_fc1 = 2 * config["intermediate_size"] * config["hidden_size"] * 4
    bound = BUCKET_BYTES + 2 * fused_fc1 + (1 << 20)
    total = sum(sizes)
    assert total > 2 * bound, "the model must be large enough for the bound to mean something"
    assert largest_tensor <= fused_fc1
    print(f"{case}: peak {report['peak_bytes']} bytes, bound {bound}, model {total}")
    assert 0 < report["peak_bytes"] <= bound, (report["peak_bytes"], bound, total)


def test_check_command_on_a_differently_sized_model(tmp_path):
    model = make_tiny_model(tmp_path / "other", arch="qwen2", hidden_size=192, heads=6, kv_heads=2, layers=4,
                            intermediate_size=320, vocab_size=123, tie_word_embeddings=False, seed=7)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    passing = subprocess.run([sys.executable, "-m", "megatron_bridge.check", str(model), "--tp", "2"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_succeeded(passing)
    assert "vocab 123 padded to 124" in passing.stdout
    reported = re.search(r"max \|megatron - transformers\| = (\S+) \(tolerance 1.0e-05 x logit scale (\S+)\)  OK",
                         passing.stdout)
    assert reported and 0 < float(reported.group(1)) < 1e-5 * float(reported.group(2)), passing.stdout
    assert "every tensor identical  OK" in passing.stdout
    # a single process (no relaunch) keeps this cheap; the differences are ~1e-7, never exactly 0
    failing = subprocess.run([sys.executable, "-m", "megatron_bridge.check", str(model), "--tolerance", "0"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert failing.returncode == 1, failing.stdout + failing.stderr[-4000:]
    assert "FAIL" in failing.stdout


def test_check_command_on_a_mixture_of_experts_at_tp2_ep2(tmp_path):
    """4 processes: TP 2 (sequence parallel; each TP rank sends an uneven number of tokens to the experts, which
    gloo gathers through the shim) x EP 2 (two of the four experts per rank), a Qwen2-MoE with its shared expert,
    and an odd sequence length (padded to a multiple of TP)."""
    model = make_tiny_model(tmp_path / "moe", arch="qwen2_moe", layers=2, seed=8)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "megatron_bridge.check", str(model), "--tp", "2", "--ep", "2",
                           "--seq-len", "31"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert_succeeded(done)
    assert "tp=2 pp=1 (layers 2) ep=2 dp=2" in done.stdout
    assert re.search(r"max \|megatron - transformers\| = \S+ \(tolerance 1.0e-05 x logit scale \S+\)  OK", done.stdout)
    assert "every tensor identical  OK" in done.stdout
