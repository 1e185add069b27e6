"""Parameter mappings between Hugging Face tensors and tensor-parallel megatron shards.

Each architecture (megatron_bridge/models/*.py) declares a table of these; the sharding arithmetic lives here once.
A mapping knows one megatron parameter name (`*` for the layer index, `#` for a routed expert's index) and the HF
tensor name(s) it comes from, and converts both ways: `load_shard(source, tp_rank, tp_size, dims)` reads only this TP
rank's rows/columns from a `TensorSource`; `merge_shards(shards, dims)` joins all TP ranks' shards into HF tensors.

Megatron layouts (TP splits along the stated dimension):
- column-parallel linear weight/bias: [out, in], split on out (dim 0);
- row-parallel linear weight: [out, in], split on in (dim 1);
- vocabulary-parallel embedding / output layer: [padded_vocab, hidden], split on dim 0; rows past the real
  vocabulary are zero on load and dropped on export;
- fused QKV: per query group, `heads_per_group` query heads, one key head, one value head, each `head_dim` rows;
  TP splits whole groups;
- fused gated MLP (SwiGLU fc1): [gate; up] per TP shard, each half split on dim 0 (dense, routed and shared experts).
Expert parallelism does not split tensors: an expert-parallel rank holds whole experts (`for_expert` resolves `#`);
which rank holds which is `megatron_bridge.model`'s business.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from rft.lazy import lazy

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only

    import torch
else:
    torch = lazy("torch")  # the architecture tables are read by config checks, without torch (rft/lazy.py)


class TensorSource(Protocol):
    """Random access to named HF tensors, reading only the requested slice."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The whole tensor (dim=None) or rows/columns [start, stop) along dim 0 or 1."""


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The sizes every mapping needs; built from the HF config by the architecture bridge."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _even_split(total: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if total % tp_size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor parallel size {tp_size}")
    size = total // tp_size
    return tp_rank * size, (tp_rank + 1) * size


@dataclass(frozen=True, kw_only=True)
class ParamMapping(ABC):
    """One megatron parameter <-> one or more HF tensors. `megatron` may contain `*` (layer index)."""

    megatron: str

    @property
    @abstractmethod
    def hf_names(self) -> tuple[str, ...]:
        """HF tensor names, in the order `merge_shards` returns them."""

    @abstractmethod
    def load_shard(self, source: TensorSource, tp_rank: int, tp_size: int, dims: ModelDims) -> torch.Tensor:
        """This TP rank's megatron shard."""

    @abstractmethod
    def merge_shards(self, shards: list[torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
        """Full HF tensors from the shards of TP ranks 0..tp_size-1."""

    @property
    def tp_sharded(self) -> bool:
        """False when every TP rank holds the whole tensor (no gather needed)."""
        return True

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    @property
    def per_expert(self) -> bool:
        """A routed expert's weight: `#` in the names stands for the expert index."""
        return "#" in self.megatron

    def for_layer(self, layer: int) -> Self:
        """This mapping with `*` replaced by the global layer index in every name."""
        return self._substitute("*", layer)

    def for_expert(self, expert: int) -> Self:
        """This mapping with `#` replaced by the global expert index in every name."""
        return self._substitute("#", expert)

    def _substitute(self, placeholder: str, index: int) -> Self:
        names = {f: getattr(self, f) for f in self.__dataclass_fields__ if isinstance(getattr(self, f), str)}
        return replace(self, **{f: name.replace(placeholder, str(index)) for f, name in names.items()})


@dataclass(frozen=True, kw_only=True)
class Replicated(ParamMapping):
    """Same tensor on every TP rank (norm weights)."""

    hf: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    @property
    def tp_sharded(self) -> bool:
        return False

    def load_shard(self, source, tp_rank, tp_size, dims):
        return source.read(self.hf)

    def merge_shards(self, shards, dims):
        return {self.hf: shards[0]}


@dataclass(frozen=True, kw_only=True)
class ColumnParallel(ParamMapping):
    """Output features split across TP (dim 0): column-parallel linear weights and biases."""

    hf: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def load_shard(self, source, tp_rank, tp_size, dims):
        start, stop = _even_split(source.shape(self.hf)[0], tp_rank, tp_size, f"rows of {self.hf}")
        return source.read(self.hf, 0, start, stop)

    def merge_shards(self, shards, dims):
        return {self.hf: torch.cat(shards, dim=0)}


@dataclass(frozen=True, kw_only=True)
class RowParallel(ParamMapping):
    """Input features split across TP (dim 1): row-parallel linear weights."""

    hf: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def load_shard(self, source, tp_rank, tp_size, dims):
        start, stop = _even_split(source.shape(self.hf)[1], tp_rank, tp_size, f"columns of {self.hf}")
        return source.read(self.hf, 1, start, stop)

    def merge_shards(self, shards, dims):
        return {self.hf: torch.cat(shards, dim=1)}


@dataclass(frozen=True, kw_only=True)
class VocabParallel(ParamMapping):
    """Vocabulary rows split across TP after padding to `padded_vocab_size` with zero rows."""

    hf: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def load_shard(self, source, tp_rank, tp_size, dims):
        start, stop = _even_split(dims.padded_vocab_size, tp_rank, tp_size, "padded vocabulary size")
        real_stop = min(stop, dims.vocab_size)
        shard = torch.zeros(stop - start, dims.hidden_size, dtype=source.dtype(self.hf))
        if real_stop > start:
            shard[: real_stop - start] = source.read(self.hf, 0, start, real_stop)
        return shard

    def merge_shards(self, shards, dims):
        return {self.hf: torch.cat(shards, dim=0)[: dims.vocab_size].contiguous()}


@dataclass(frozen=True, kw_only=True)
class QKV(ParamMapping):
    """Separate HF q/k/v projections (weights or biases) <-> megatron's fused, group-interleaved QKV."""

    q: str
    k: str
    v: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def load_shard(self, source, tp_rank, tp_size, dims):
        g0, g1 = _even_split(dims.num_kv_heads, tp_rank, tp_size, "key/value heads")
        hd, hpg = dims.head_dim, dims.heads_per_group
        q = source.read(self.q, 0, g0 * hpg * hd, g1 * hpg * hd)
        k = source.read(self.k, 0, g0 * hd, g1 * hd)
        v = source.read(self.v, 0, g0 * hd, g1 * hd)
        groups = g1 - g0
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(groups, hpg * hd, *rest), k.reshape(groups, hd, *rest),
                           v.reshape(groups, hd, *rest)], dim=1)
        return fused.reshape(groups * (hpg + 2) * hd, *rest)

    def merge_shards(self, shards, dims):
        hd, hpg = dims.head_dim, dims.heads_per_group
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        grouped = full.reshape(dims.num_kv_heads, (hpg + 2) * hd, *rest)
        q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
        return {self.q: q.reshape(-1, *rest).contiguous(), self.k: k.reshape(-1, *rest).contiguous(),
                self.v: v.reshape(-1, *rest).contiguous()}


@dataclass(frozen=True, kw_only=True)
class GatedMLP(ParamMapping):
    """HF gate_proj and up_proj <-> megatron's fused SwiGLU fc1, [gate shard; up shard] per TP rank."""

    gate: str
    up: str

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def load_shard(self, source, tp_rank, tp_size, dims):
        start, stop = _even_split(source.shape(self.gate)[0], tp_rank, tp_size, f"intermediate size of {self.gate}")
        return torch.cat([source.read(self.gate, 0, start, stop), source.read(self.up, 0, start, stop)], dim=0)

    def merge_shards(self, shards, dims):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return {self.gate: torch.cat([h[0] for h in halves], dim=0),
                self.up: torch.cat([h[1] for h in halves], dim=0)}

