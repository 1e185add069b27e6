"""A SmolVLM-shaped vision-language model built from a real Llama language model (SmolLM2-135M-Instruct): `rft model
build-vlm --language DIR --out DIR`.

No pretrained vision weights exist here, so the VLM is the language model's weights, copied exactly, under transformers'
`Idefics3ForConditionalGeneration` (SmolVLM's architecture), with a NEW vision tower (SigLIP) and pixel-shuffle
connector, randomly initialised from `seed` (the connector drawn so image tokens have a text token's norm), sized for
small images (easy-vqa's 64 x 64: `image_size` 64, patch 8, scale factor 2 gives 16 image tokens per image; a
2-layer tower of width 128). Training (an SFT warm start on the visual task) teaches the tower.
- tokenizer: the language model's, plus Idefics3's image tokens (rft.models.tiny_vlm.IMAGE_TOKENS) as special tokens
  at the end of the vocabulary; their embedding rows (tied to the output head when the model ties them) are the mean
  of the existing rows, so the text path's logits over the old vocabulary are the language model's exactly;
- chat template: the language model's, rendering image parts as `<image>` (`with_image_parts`);
- processor: transformers' `Idefics3Processor` with its PIL image processor, no image splitting (`idefics3_processor`).
The directory is float32 safetensors with `rft_vlm.json` recording how it was built.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rft.models.tiny_vlm import IMAGE_TOKENS, idefics3_processor, image_seq_len, vision_config, with_image_parts


class BuildError(ValueError):
    """The language model cannot become the VLM (not a Llama, no chat template) or the sizes do not fit."""


@dataclass(frozen=True)
class Tower:
    """The new vision tower and connector: images resized to `image_size` square, `patch_size` patches, a SigLIP of
    `layers` x `hidden_size` (`heads` heads), the connector's pixel shuffle by `scale_factor`."""
    image_size: int = 64
    patch_size: int = 8
    scale_factor: int = 2
    hidden_size: int = 128
    layers: int = 2
    heads: int = 2
    seed: int = 0

    def check(self) -> None:
        grid, rest = divmod(self.image_size, self.patch_size)
        if rest or grid % self.scale_factor:
            raise BuildError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}, and "
                             f"the patch grid ({grid}) a multiple of scale_factor {self.scale_factor}")
        if self.hidden_size % self.heads:
            raise BuildError(f"the tower's hidden_size {self.hidden_size} is not a multiple of its heads {self.heads}")

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image."""
        return image_seq_len(self.image_size, self.patch_size, self.scale_factor)


def build_vlm(language: str | Path, out: str | Path, tower: Tower = Tower(), *, force: bool = False) -> Path:
    """Write the VLM (module docstring) built from the HF Llama directory `language` into `out` (written as
    `out.partial`, then renamed) and return its path. BuildError naming what is wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration

    tower.check()
    source, out = Path(language), Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise BuildError(f"{out} exists and is not empty (--force replaces it)")
    text_config = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else None
    if not text_config or text_config.get("model_type") != "llama":
        raise BuildError(f"{source}: not a Hugging Face Llama directory (the VLM's language model is a Llama, "
                         f"got model_type {text_config and text_config.get('model_type')!r})")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if not getattr(tokenizer, "chat_template", None):
        raise BuildError(f"{source}: the tokenizer has no chat template (use an instruct model's)")
    old_vocab = text_config["vocab_size"]
    if len(tokenizer) != old_vocab:
        raise BuildError(f"{source}: the tokenizer has {len(tokenizer)} tokens and the model's vocabulary "
                         f"{old_vocab} rows; the image tokens go right after both, so they must be equal")
    tokenizer.add_tokens(IMAGE_TOKENS, special_tokens=True)
    template = with_image_parts(tokenizer.chat_template)
    tokenizer.chat_template = template
    processor = idefics3_processor(tokenizer, template, image_size=tower.image_size, patch_size=tower.patch_size,
                                   scale_factor=tower.scale_factor)
    language_model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    tied = bool(text_config.get("tie_word_embeddings", False))
    text_config = {k: v for k, v in text_config.items()
                   if k not in ("architectures", "dtype", "torch_dtype", "transformers_version")}
    text_config["vocab_size"] = len(tokenizer)
    config = Idefics3Config(
        vision_config=vision_config(hidden_size=tower.hidden_size, layers=tower.layers, heads=tower.heads,
                                    image_size=tower.image_size, patch_size=tower.patch_size),
        text_config=text_config, scale_factor=tower.scale_factor,
        image_token_id=int(processor.image_token_id), pad_token_id=text_config.get("pad_token_id"),
        tie_word_embeddings=tied, architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(tower.seed)
    model = Idefics3ForConditionalGeneration(config).eval()  # the tower and connector keep this random init
    _copy_language(language_model, model, old_vocab=old_vocab, tied=tied)
    _scale_connector(model, old_vocab=old_vocab)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    processor.save_pretrained(partial)
    (partial / "rft_vlm.json").write_text(json.dumps({"language": str(source), "tower": asdict(tower),
                                                      "image_tokens": tower.image_tokens}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _copy_language(language_model: Any, model: Any, *, old_vocab: int, tied: bool) -> None:
    """The language model's weights into the VLM's text model and head; the image tokens' rows are the mean of the
    old rows."""
    import torch

    state = language_model.model.state_dict()
    embed = state.pop("embed_tokens.weight")
    with torch.no_grad():
        missing, unexpected = model.model.text_model.load_state_dict(state, strict=False)
        if missing != ["embed_tokens.weight"] or unexpected:
            raise BuildError(f"the language model's weights do not fit the VLM's text model (missing {missing}, "
                             f"unexpected {unexpected})")
        rows = model.model.text_model.embed_tokens.weight
        rows[:old_vocab] = embed
        rows[old_vocab:] = embed.mean(dim=0)
        if not tied:
            head = language_model.lm_head.weight
            model.lm_head.weight[:old_vocab] = head
            model.lm_head.weight[old_vocab:] = head.mean(dim=0)


def _scale_connector(model: Any, *, old_vocab: int) -> None:
    """Draw the connector's projection again so an image token's embedding has about a text token's norm: its input
    (the tower's layer-normed features, pixel-shuffled) has unit variance per feature, so a weight std of
    norm / sqrt(in x out) gives outputs of that norm. transformers' default (std 0.02) makes them ~4x the text
    embeddings' (SmolLM2: 13 against 3.2), and a warm start then learns the questions' text priors, not the images."""
    import torch

    weight = model.model.connector.modality_projection.proj.weight  # [text hidden, vision hidden x scale^2]
    norm = model.model.text_model.embed_tokens.weight[:old_vocab].norm(dim=1).mean()
    with torch.no_grad():
        weight.normal_(0.0, float(norm) / (weight.shape[0] * weight.shape[1]) ** 0.5)


def add_command(commands: Any) -> None:
    """`build-vlm` under `rft model`."""
    build = commands.add_parser("build-vlm", help="a SmolVLM-shaped VLM from a Llama language model and a new "
                                "vision tower", description=__doc__.split("\n\n")[0])
    build.add_argument("--language", required=True, help="the HF Llama directory (e.g. assets/smollm2-135m-instruct)")
    build.add_argument("--out", required=True, help="the VLM directory to write")
    defaults = Tower()
    for name in ("image_size", "patch_size", "scale_factor", "hidden_size", "layers", "heads", "seed"):
        build.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                           help=f"the vision tower's {name} (default {getattr(defaults, name)})")
    build.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    build.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    tower = Tower(image_size=args.image_size, patch_size=args.patch_size, scale_factor=args.scale_factor,
                  hidden_size=args.hidden_size, layers=args.layers, heads=args.heads, seed=args.seed)
    try:
        out = build_vlm(args.language, args.out, tower, force=args.force)
    except (BuildError, OSError) as e:
        print(f"rft model build-vlm: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
