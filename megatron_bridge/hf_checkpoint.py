"""Reading and writing Hugging Face model directories (safetensors), tensor by tensor.

`HFCheckpoint` is the `TensorSource` the loader shards from: it opens `model.safetensors` or the
shards listed in `model.safetensors.index.json` with `safe_open` and reads only the requested slice
of a tensor, so a TP rank never materialises rows it does not own.

`HFDirectoryWriter` writes an exported model: safetensors shards fed bucket by bucket, an index
file, the config, and the tokenizer / generation files copied from the source directory.
"""
from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "preprocessor_config.json", "processor_config.json",  # a vision-language model's processor
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                "added_tokens.json", "chat_template.jinja")


class HFCheckpoint:
    """Sliced read access to the safetensors of an HF model directory. Use as a context manager."""

    def __init__(self, model_dir: str | Path, *, single_file: str = SINGLE_FILE):
        """`single_file`: the one safetensors file read when there is no index (a PEFT adapter directory has
        `adapter_model.safetensors`)."""
        self.dir = Path(model_dir)
        self.single_file = single_file
        self._file_of = self._index()
        self._stack = ExitStack()
        self._open: dict[str, safe_open] = {}  # file -> its open handle

    def _index(self) -> dict[str, str]:
        if (self.dir / INDEX_FILE).is_file():
            return dict(json.loads((self.dir / INDEX_FILE).read_text())["weight_map"])
        if (self.dir / self.single_file).is_file():
            with safe_open(self.dir / self.single_file, framework="pt") as f:
                return {name: self.single_file for name in f.keys()}
        raise FileNotFoundError(f"{self.dir}: no {self.single_file} or {INDEX_FILE} (only safetensors checkpoints "
                                "are supported)")

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(self.dir / file, framework="pt"))
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._slice(name).get_dtype()]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        piece = self._slice(name)
        if dim is None:
            return piece[:]
        if dim == 0:
            return piece[start:stop]
        if dim == 1:
            return piece[:, start:stop]
        raise ValueError(f"can only slice dim 0 or 1, got {dim}")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class HFDirectoryWriter:
    """Writes one safetensors shard per `add_bucket` call, then the index and metadata on `finish`.
    The directory must not already hold safetensors files (stale shards would mix with new ones)."""

    def __init__(self, out_dir: str | Path, source_dir: str | Path):
        self.out = Path(out_dir)
        self.source = Path(source_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        stale = sorted(p.name for p in self.out.glob("*.safetensors*"))
        if stale:
            raise FileExistsError(f"{self.out} already holds {stale[:3]}{'...' if len(stale) > 3 else ''}; "
                                  "export into a new or empty directory")
        self._weight_map: dict[str, str] = {}
        self._shards: list[str] = []
        self._total_bytes = 0

    def add_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        name = f"model-part-{len(self._shards) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, self.out / name, metadata={"format": "pt"})
        self._shards.append(name)
        self._total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self._weight_map.update({k: name for k in tensors})

    def finish(self) -> Path:
        """Rename shards to HF's `-0000i-of-0000n` pattern, write the index, copy config and tokenizer."""
        n = len(self._shards)
        final = {old: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(self._shards)}
        for old, new in final.items():
            (self.out / old).rename(self.out / new)
        index = {"metadata": {"total_size": self._total_bytes},
                 "weight_map": {k: final[v] for k, v in sorted(self._weight_map.items())}}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for file in COPIED_FILES:
            if (self.source / file).is_file() and self.source.resolve() != self.out.resolve():
                shutil.copyfile(self.source / file, self.out / file)
        return self.out
