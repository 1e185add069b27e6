"""The architecture registry and the shared translation of a dense decoder's HF config to megatron.

An architecture file (qwen2.py, llama.py, qwen3.py; the mixtures of experts build on `moe.MoEBridge`) subclasses
`DecoderBridge`, registers it under the HF class name found in `config.json`'s `architectures`, and declares its
parameter mapping table. This module turns the HF config into megatron's `TransformerConfig` plus the `GPTModel`
arguments, and refuses options megatron (or this bridge) cannot reproduce exactly, naming each one.

Parameter names in the tables are those of megatron's local layer spec; `megatron_bridge.model`
renames the two fused-norm parameters when the Transformer Engine spec is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from megatron_bridge.layout import stage_layer_counts
from megatron_bridge.mapping import ModelDims, ParamMapping
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch, F = lazy("torch"), lazy("torch.nn.functional")  # the registry is read by config checks, without torch

OUTPUT_LAYER = "output_layer.weight"
_REGISTRY: dict[str, type[DecoderBridge]] = {}

# megatron's RotaryEmbedding hard-codes these Llama 3 scaling constants; other values are refused.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """The HF model uses an architecture or option this bridge cannot convert exactly."""


def register(hf_class_name: str):
    """Class decorator: make `bridge_for` pick this bridge for configs naming `hf_class_name`."""
    def decorate(cls: type[DecoderBridge]) -> type[DecoderBridge]:
        if hf_class_name in _REGISTRY:
            raise ValueError(f"a bridge for {hf_class_name} is already registered ({_REGISTRY[hf_class_name]})")
        cls.hf_class = hf_class_name
        _REGISTRY[hf_class_name] = cls
        return cls
    return decorate


def registered_architectures() -> list[str]:
    return sorted(_REGISTRY)


def bridge_for(hf_config) -> DecoderBridge:
    """The bridge for an HF config object (`transformers.PretrainedConfig`); raises UnsupportedModelError."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name](hf_config)
    raise UnsupportedModelError(f"unsupported architecture {names or '(config has no architectures)'}; "
                                f"supported: {', '.join(registered_architectures())}")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Round the vocabulary up so every TP rank gets an equal, aligned slice.

    The alignment unit is the largest power of two up to 128 that already divides `vocab_size`
    (as NVIDIA Megatron-Bridge does), times tp; a vocabulary that needs no padding gets none.
    """
    unit = 128
    while vocab_size % unit:
        unit //= 2
    multiple = unit * tp
    return -(-vocab_size // multiple) * multiple


def _dtype(name: str | torch.dtype) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if isinstance(name, torch.dtype):
        return name
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


class DecoderBridge:
    """A dense decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    Subclasses set `mapping_table` (with the `output_layer.weight` entry; it is dropped for tied
    embeddings), `qkv_bias` and `qk_layernorm`, and may add refusals in `unsupported_options`. Mixtures of
    experts (`moe.MoEBridge`) also override `num_experts`, `layer_mappings` and `moe_settings`.
    """

    hf_class: ClassVar[str] = ""
    # megatron parameter name prefixes of modules beside the decoder that live on the first pipeline stage (a
    # vision tower and its connector); they are replicated over TP: every mapping of theirs is `Replicated`
    first_stage_prefixes: ClassVar[tuple[str, ...]] = ()
    qkv_bias: ClassVar[bool] = False
    qk_layernorm: ClassVar[bool] = False  # RMSNorm over each head's query and key (Qwen3)
    mapping_table: ClassVar[tuple[ParamMapping, ...]] = ()
    # a vision-language model's image tensors: the micro-batch keys its first stage's forward takes as keyword
    # arguments (megatron_bridge.schedule passes those a micro-batch has, and then `prompt_lens` too: placeholders
    # are read only inside each row's prompt, megatron_bridge.vision); () for a text model
    image_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config):
        self.hf = hf_config
        problems = self.unsupported_options()
        if problems:
            raise UnsupportedModelError(f"{self.hf_class}: unsupported option(s): " + "; ".join(problems))

    # ---- what the HF config says

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.hf, "tie_word_embeddings", False))

    @property
    def head_dim(self) -> int:
        return getattr(self.hf, "head_dim", None) or self.hf.hidden_size // self.hf.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf, "num_key_value_heads", None) or self.hf.num_attention_heads

    def rope(self) -> dict[str, Any]:
        """HF rope settings as one dict with `rope_type` and `rope_theta` (transformers 4 and 5 layouts)."""
        params = dict(getattr(self.hf, "rope_parameters", None) or {})
        if not params:
            params = dict(getattr(self.hf, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(self.hf, "rope_theta", 10000.0))
        params.setdefault("rope_type", params.pop("type", "default"))
        return params

    def unsupported_options(self) -> list[str]:
        """Human-readable reasons this config cannot be converted exactly (empty: supported)."""
        hf, problems = self.hf, []
        if getattr(hf, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf.hidden_act!r} (only 'silu', i.e. SwiGLU)")
        if hf.num_attention_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads={hf.num_attention_heads} not a multiple of "
                            f"num_key_value_heads={self.num_kv_heads}")
        rope = self.rope()
        if rope["rope_type"] == "llama3":
            wrong = {k: rope.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(rope.get(k, -1)) != v}
            if wrong:
                problems.append(f"llama3 rope scaling with {wrong} (megatron-core fixes {_MEGATRON_LLAMA3_ROPE})")
        elif rope["rope_type"] != "default":
            problems.append(f"rope_type={rope['rope_type']!r} (supported: default, llama3)")
        return problems

    # ---- what megatron gets

    def dims(self, tp: int) -> ModelDims:
        hf = self.hf
        return ModelDims(hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
                         num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=hf.vocab_size,
                         padded_vocab_size=padded_vocab_size(hf.vocab_size, tp))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer; 0 for a dense model."""
        return 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has routed experts instead of a dense MLP."""
        return False

    def tp_divided_sizes(self) -> list[tuple[str, int]]:
        """(what, size) of every dimension tensor parallelism splits."""
        return [("attention heads", self.hf.num_attention_heads), ("key/value heads", self.num_kv_heads),
                ("intermediate_size", self.hf.intermediate_size)]

    def check_parallel_sizes(self, tp: int, pp: int, ep: int = 1, pp_layers: tuple[int, ...] | None = None) -> None:
        """Raise ValueError naming the size that does not divide the model."""
        for what, count in self.tp_divided_sizes():
            if count % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide the model's {count} {what}")
        stage_layer_counts(self.hf.num_hidden_layers, pp, pp_layers)
        # a dense model under EP > 1 (a dense teacher or critic beside a MoE policy) just has no experts to split
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"expert parallel size {ep} does not divide the model's {self.num_experts} experts")

    def moe_settings(self, *, ep: int, aux_loss_coeff: float, z_loss_coeff: float) -> dict[str, Any]:
        """megatron TransformerConfig fields of the experts (none for a dense model)."""
        return {}

    def transformer_config(self, *, tp: int, pp: int, dtype: str | torch.dtype, on_cpu: bool, ep: int = 1,
                           pp_layers: tuple[int, ...] | None = None, aux_loss_coeff: float = 0.0,
                           z_loss_coeff: float = 0.0):
        """megatron's TransformerConfig for a TP x PP (x EP) layout. `pp_layers`: decoder layers per pipeline
        stage for an uneven split (see `stage_layer_counts`); `aux_loss_coeff` / `z_loss_coeff`: the MoE
        load-balancing and router z-loss coefficients (ignored by dense models)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.check_parallel_sizes(tp, pp, ep, pp_layers)
        hf, torch_dtype = self.hf, _dtype(dtype)
        uneven = {} if pp_layers is None else dict(num_layers_in_first_pipeline_stage=pp_layers[0],
                                                   num_layers_in_last_pipeline_stage=pp_layers[-1])
        return TransformerConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads, num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim, normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=self.qkv_bias,
            hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
            init_method_std=getattr(hf, "initializer_range", 0.02), attention_softmax_in_fp32=True,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            # megatron refuses to train a mixture of experts at TP > 1 without it (megatron_bridge.schedule pads)
            sequence_parallel=bool(self.num_experts) and tp > 1,
            params_dtype=torch_dtype, pipeline_dtype=torch_dtype, bf16=torch_dtype == torch.bfloat16,
            fp16=torch_dtype == torch.float16, variable_seq_lengths=True, qk_layernorm=self.qk_layernorm,
            moe_token_dispatcher_type="alltoall",  # the default ("allgather") forbids variable lengths
            # perform_initialization=False would skip tagging weights as tensor-parallel, and megatron's
            # grad norm and checkpoints would then treat TP shards as duplicates; we overwrite the values.
            use_cpu_initialization=on_cpu, perform_initialization=True,
            # loss_fn contributions are already global (batch contract): megatron must neither divide
            # them by the number of micro-batches nor average gradients over data-parallel ranks.
            calculate_per_token_loss=True, **uneven,
            **self.moe_settings(ep=ep, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff))

    def gpt_model_kwargs(self, tp: int) -> dict[str, Any]:
        """Arguments of megatron's GPTModel other than config, spec and pipeline position."""
        rope = self.rope()
        llama3 = rope["rope_type"] == "llama3"
        return dict(vocab_size=padded_vocab_size(self.hf.vocab_size, tp),
                    max_sequence_length=self.hf.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=rope["rope_theta"], rope_scaling=llama3,
                    rope_scaling_factor=float(rope.get("factor", 8.0)) if llama3 else 8.0,
                    share_embeddings_and_output_weights=self.tied_embeddings, parallel_output=True)

    def build_model(self, *, config, spec, pre_process: bool, post_process: bool, tp: int):
        """This pipeline stage's megatron module: a GPTModel here; a vision-language bridge returns a GPTModel
        subclass with its vision tower on the first stage (megatron_bridge.vision)."""
        from megatron.core.models.gpt import GPTModel

        return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process,
                        post_process=post_process, **self.gpt_model_kwargs(tp))

    def collate_images(self, per_row: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One micro-batch's image tensors (keys among `image_keys`) from each row's processor output
        (`rft.models.vision.ProcessedPrompt.pixels` of row i; {} for a text row or a padding row), in row order:
        how several prompts' images batch is the family's business. ValueError here: a text model takes no
        images."""
        raise ValueError(f"{self.hf_class} takes no images (a text model: no image_keys)")

    def on_first_stage(self, megatron_name: str) -> bool:
        """Whether a global megatron parameter beside the decoder lives on the first pipeline stage (the
        embedding is `megatron_bridge.info`'s business)."""
        return megatron_name.startswith(self.first_stage_prefixes) if self.first_stage_prefixes else False

    def mappings(self) -> list[ParamMapping]:
        """The mapping table for this config (no output layer entry when embeddings are tied)."""
        return [m for m in self.mapping_table if not (self.tied_embeddings and m.megatron == OUTPUT_LAYER)]

    def layer_mappings(self, layer: int) -> list[ParamMapping]:
        """The per-layer mappings (`*` unresolved) of decoder layer `layer` (0-based): all of them here; a
        mixture of experts picks the dense MLP's or the experts' by layer."""
        return [m for m in self.mappings() if m.per_layer]


class VisionLanguageBridge(DecoderBridge):
    """A vision-language family: `self.vlm` is the whole HF config, `self.hf` its text model's (what the decoder's
    table reads); embeddings tie as the outer config says; the image placeholder's id is the outer config's."""

    def __init__(self, hf_config):
        self.vlm = hf_config
        super().__init__(hf_config.text_config)

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.vlm, "tie_word_embeddings", False))  # transformers ties by the outer config's

    @property
    def image_token_id(self) -> int:
        return int(self.vlm.image_token_id)
