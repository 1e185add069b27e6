"""`rft model import-gguf FILE OUT_DIR`: a GGUF file (llama.cpp's format) into a plain Hugging Face directory.

The output is what every other part of rft reads: float32 `model.safetensors`, `config.json`, the tokenizer
(`tokenizer.json`, `tokenizer_config.json` with the file's chat template) and `generation_config.json`.
transformers reads the GGUF (dequantizing every tensor to float32) and rebuilds the tokenizer from its metadata;
this module copies the weights into a plain model class built from the same config without its
`quantization_config` (transformers refuses to save a GGUF-loaded model), so tied embeddings stay tied.

Invariants: OUT_DIR is either absent, or a complete model: everything is written to `OUT_DIR.partial` and renamed
at the end. A bad input (missing file, not a GGUF, an architecture outside `SUPPORTED_ARCHITECTURES`, the `gguf`
package missing, OUT_DIR not empty without --force) is one line on stderr and exit status 2, before any weight is
read.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft.models import smolvlm

# general.architecture values this command converts and is tested on (transformers' GGUF loader reads more, but
# only these are checked here against transformers' own logits).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
GGUF_MAGIC = b"GGUF"
# config keys a GGUF-loaded model carries that describe the file, not the model (provenance goes to PROVENANCE)
GGUF_ONLY_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
PROVENANCE = "rft_gguf_import.json"
GGUF_INSTALL_HINT = "pip install gguf==0.19.0 (or `make venv`, which installs it)"


class GGUFImportError(ValueError):
    """A bad input to the import, with a one-line message that names it (exit status 2)."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the file's metadata says, read without loading a tensor."""
    path: Path
    architecture: str
    name: str
    tensors: int


def check_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFImportError(f"the `gguf` package is not installed; transformers needs it to read GGUF files: "
                           f"{GGUF_INSTALL_HINT}")


@contextlib.contextmanager
def one_metadata_parse():
    """Inside this block, `gguf.GGUFReader(path)` (read-only) returns one reader per file instead of a new one.

    transformers builds a new `gguf.GGUFReader` for the config, another for the model and a third for the tokenizer
    (`load_gguf_checkpoint`, which imports the class from `gguf` at each call), and `read_gguf_info` a fourth; each
    parses every metadata field in Python, a vocabulary and its merges among them (docs/benchmarks.md). The reader
    only memory-maps the file read-only and its users only read it, so one serves them all. Other modes ('r+', 'c')
    get their own reader, as before. Without the `gguf` package it changes nothing (`read_gguf_info` says what is
    missing)."""
    if importlib.util.find_spec("gguf") is None:
        yield
        return
    import gguf

    original = gguf.GGUFReader
    readers: dict[str, object] = {}

    def shared(path, mode="r"):
        if mode != "r":
            return original(path, mode)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def read_gguf_info(path: Path) -> GGUFInfo:
    """The file's architecture and name; GGUFImportError if it is missing, not a GGUF, or of an unsupported
    architecture."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF starts with {GGUF_MAGIC!r})")
    check_gguf_package()
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        fields = reader.fields
        architecture = fields["general.architecture"].contents()
        name = fields["general.name"].contents() if "general.name" in fields else path.stem
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise GGUFImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"{path}: architecture {architecture!r} is not supported by `rft model import-gguf`; "
                           f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return GGUFInfo(path=path, architecture=architecture, name=str(name), tensors=len(reader.tensors))


def prepare_output(out_dir: Path, *, force: bool) -> Path:
    """The staging directory `OUT_DIR.partial` (emptied); GGUFImportError if OUT_DIR holds anything and not `force`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise GGUFImportError(f"{out_dir}: exists and is not empty (pass --force to replace it)")
    staging = out_dir.with_name(out_dir.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)  # left by an interrupted import: ours by its name
    staging.mkdir(parents=True)
    return staging


def publish_output(staging: Path, out_dir: Path) -> None:
    """Replace OUT_DIR by the complete staging directory."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def load_gguf_model(path: Path):
    """The GGUF as transformers loads it (float32, dequantized), with transformers' progress bar."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def plain_copy(gguf_model):
    """The same weights in a model without the GGUF quantizer attached, so that `save_pretrained` accepts it."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config.__class__.from_dict(
        {k: v for k, v in gguf_model.config.to_dict().items() if k not in GGUF_ONLY_CONFIG_KEYS})
    config.architectures = [type(gguf_model).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the GGUF's tensors do not fill {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()


def save_tokenizer(path: Path, out_dir: Path) -> None:
    """The tokenizer transformers rebuilds from the file's metadata, with its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(out_dir)


def save_generation_config(model, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)


def write_provenance(info: GGUFInfo, out_dir: Path) -> None:
    """Which file the directory came from (its SHA-256), so that a cached asset can be traced to its source."""
    import transformers

    digest = hashlib.sha256()
    with info.path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    record = {"source": info.path.name, "sha256": digest.hexdigest(), "bytes": info.path.stat().st_size,
              "architecture": info.architecture, "name": info.name, "transformers": transformers.__version__}
    (out_dir / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, force: bool = False, say=print) -> Path:
    """Convert `gguf_path` into the HF directory `out_dir` and return its path. GGUFImportError on a bad input
    (raised before anything is written); `say` receives one line per step."""
    with one_metadata_parse():
        return _import_gguf(Path(gguf_path), Path(out_dir), force=force, say=say)


def _import_gguf(path: Path, out: Path, *, force: bool, say) -> Path:
    info = read_gguf_info(path)
    staging = prepare_output(out, force=force)
    steps = 4
    try:
        start = time.monotonic()
        say(f"[1/{steps}] reading {path} ({info.architecture}, {info.tensors} tensors, {info.name!r}); "
            f"dequantizing to float32")
        gguf_model = load_gguf_model(path)
        model = plain_copy(gguf_model)
        del gguf_model
        params = sum(p.numel() for p in model.parameters())
        say(f"[2/{steps}] saving {params / 1e6:.1f} M parameters ({type(model).__name__}, tied embeddings: "
            f"{model.config.tie_word_embeddings}) to {staging}")
        model.save_pretrained(staging, safe_serialization=True)
        save_generation_config(model, staging)
        say(f"[3/{steps}] rebuilding the tokenizer and chat template from the GGUF metadata")
        save_tokenizer(path, staging)
        write_provenance(info, staging)
        publish_output(staging, out)
        size = sum(f.stat().st_size for f in out.iterdir())
        say(f"[4/{steps}] wrote {out} ({size / 1e6:.0f} MB) in {time.monotonic() - start:.1f} s")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def add_command(commands: Any) -> None:
    """`import-gguf` under `rft model`."""
    gguf = commands.add_parser("import-gguf", help="a GGUF file (llama, qwen2) into a safetensors HF directory",
                               description=__doc__.split("\n\n")[0])
    gguf.add_argument("file", help="the .gguf file")
    gguf.add_argument("out_dir", help="the HF directory to write (written as OUT_DIR.partial, then renamed)")
    gguf.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    gguf.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        out = import_gguf(args.file, args.out_dir, force=args.force, say=lambda line: print(line, flush=True))
    except GGUFImportError as e:
        print(f"rft model import-gguf: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str]) -> int:
    """`rft model COMMAND`: import-gguf FILE OUT_DIR [--force] (this module), build-vlm --language DIR --out DIR
    (rft.models.smolvlm); exit 0 with the directory written, 2 on a bad input."""
    parser = argparse.ArgumentParser(prog="rft model", description="Model files: import a GGUF as an HF directory; "
                                     "build a VLM from a language model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_command(commands)
    smolvlm.add_command(commands)
    args = parser.parse_args(argv)
    return int(args.run(args))
