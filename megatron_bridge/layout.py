"""Whether a model's shape can be split TP x PP x EP, and whether two models share a vocabulary, from their
config.json alone: standard library only, so a config check (rft/run/loading.py) answers before any process starts
and without importing torch or megatron-core."""
from __future__ import annotations

import json
import os


def stage_layer_counts(num_layers: int, pp: int, pp_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, first to last: `pp_layers` when given (megatron-core allows the first
    and last stage to differ; the middle stages must be equal), else an even split. ValueError names what is
    wrong."""
    if pp_layers is None:
        if num_layers % pp:
            raise ValueError(f"pipeline parallel size {pp} does not divide the model's {num_layers} layers "
                             "(give the layers per stage for an uneven split)")
        return (num_layers // pp,) * pp
    counts = tuple(int(n) for n in pp_layers)
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layers per pipeline stage {list(counts)} must be {pp} positive numbers summing to the "
                         f"model's {num_layers} layers")
    if len(set(counts[1:-1])) > 1:
        raise ValueError(f"layers per pipeline stage {list(counts)}: megatron-core lets only the first and last "
                         "stage differ; the middle stages must hold equal numbers")
    return counts


def layout_problem(hf_dir: str, *, tp: int, pp: int, ep: int = 1, pp_layers: tuple[int, ...] | None = None,
                   options: tuple[str, str, str] = ("--tp", "--pp", "--ep")) -> str | None:
    """Why the model's shape cannot be split TP x PP x EP (None if it can), from its config.json: before any
    process starts, so the answer is one line and not a failed worker's traceback. `options` name TP, PP and EP
    in the answer (this command's flags; rft's config names its keys). `pp_layers`: layers per stage of an
    uneven split."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path}: cannot read the model's config ({e})"
    hf = hf.get("text_config") or hf  # a vision-language model's language model is what TP and PP split
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    tp_option, pp_option, ep_option = options
    for what, count, size, option in (("attention heads", heads, tp, tp_option),
                                      ("key/value heads", kv_heads, tp, tp_option),
                                      ("layers", layers, 1 if pp_layers else pp, pp_option),
                                      ("experts", experts, ep, ep_option)):
        if count and count % size:
            return f"{option} {size} does not divide the model's {count} {what} ({path})"
    if ep > 1 and not experts:
        return f"{ep_option} {ep} for a model without experts ({path})"
    if pp_layers and layers:
        try:
            stage_layer_counts(layers, pp, pp_layers)
        except ValueError as e:
            return f"{e} ({path})"
    return None


def vocabulary_problem(student_dir: str, teacher_dir: str, *, role: str = "teacher") -> str | None:
    """Why a teacher model (or another model reading the student's tokens: `role`, e.g. "critic") cannot score the
    student's tokens (None if it can): their config.json vocabulary sizes differ (a token id would mean different
    tokens, or none), or one of them is unreadable. Names both paths."""
    sizes = []
    for hf_dir in (student_dir, teacher_dir):
        path = os.path.join(hf_dir, "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
            sizes.append((config.get("text_config") or config).get("vocab_size"))
        except (OSError, ValueError) as e:
            return f"{path}: cannot read the model's config ({e})"
    if sizes[0] is None or sizes[0] != sizes[1]:
        return (f"the {role} {teacher_dir} has vocab_size {sizes[1]} and the student {student_dir} has "
                f"{sizes[0]}: a {role} must share the student's tokenizer and vocabulary")
    return None
