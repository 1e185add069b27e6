"""`rft model import-gguf` end to end, through the CLI in a subprocess, on GGUF files the test writes itself
(tests/gguf_files.py, the way llama.cpp writes them, weights quantized): the imported directory gives the same
logits as transformers loading the GGUF, the same token ids and chat template, and every bad input is one line on
stderr with exit status 2 and nothing written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gguf_files import CHAT_TEMPLATE, tiny_gguf

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["What is 17 + 25? The answer is 42.", "  Hello world!\n\tunseen words: zebra 🤖", "<|im_end|>a dog"]


def rft_model(*args: str, preamble: str = "") -> subprocess.CompletedProcess:
    """`python -m rft.cli model ARGS` in a fresh interpreter (`preamble` runs first, e.g. to hide a package)."""
    code = f"{preamble}\nimport sys\nfrom rft.cli import main\nsys.exit(main(['model', *sys.argv[1:]]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


# counts the `gguf.GGUFReader`s built in the process (each parses all of the file's metadata), said on stderr at exit
COUNT_READERS = """
import atexit, sys, gguf
built = []
build = gguf.GGUFReader.__init__
def counted(self, *args, **kwargs):
    built.append(1)
    build(self, *args, **kwargs)
gguf.GGUFReader.__init__ = counted
atexit.register(lambda: print(f"gguf readers built: {len(built)}", file=sys.stderr))
"""


# llama in float32: the import must reproduce the HF model the GGUF was written from (q/k permutation undone);
# qwen2 in Q8_0: transformers' dequantization on the way, so the original is reproduced up to quantization only
@pytest.mark.parametrize("arch, quantize, from_original", [("llama", None, 1e-5), ("qwen2", "Q8_0", 0.02)])
def test_import_matches_transformers_on_the_same_gguf(tmp_path, arch, quantize, from_original):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tiny_gguf(tmp_path, arch=arch, quantize=quantize)
    out = tmp_path / "imported"
    out.mkdir()
    (out / "stale.txt").write_text("replaced by --force")
    done = rft_model("import-gguf", str(gguf), str(out), "--force", preamble=COUNT_READERS)
    assert done.returncode == 0, done.stderr
    assert "gguf readers built: 1\n" in done.stderr, done.stderr  # rft.models.gguf.one_metadata_parse
    assert "[4/4] wrote" in done.stdout and done.stdout.strip().endswith(str(out))
    assert not (tmp_path / "imported.partial").exists() and not (out / "stale.txt").exists()

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "rft_gguf_import.json").read_text())["architecture"] == arch

    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    assert imported.lm_head.weight.data_ptr() == imported.model.embed_tokens.weight.data_ptr(), "untied"
    ids = torch.randint(0, imported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (imported(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-5, f"imported logits differ from transformers' on the GGUF by {diff}"

    # the GGUF is a faithful copy of the HF model it came from: a wrong q/k permutation or tensor name in the
    # writer (tests/gguf_files.py) would show here, not in the comparison above
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{arch}", dtype=torch.float32).eval()
    with torch.no_grad():
        drift = (original(ids).logits - imported(ids).logits).abs().max().item()
    assert drift <= from_original, f"the import differs from the model the GGUF was written from by {drift}"

    tokenizer = AutoTokenizer.from_pretrained(out)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chat = [{"role": "user", "content": "What is 17 + 25?"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert prompt == "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    for text in [*TEXTS, prompt]:
        assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids, text
    assert tokenizer.decode(tokenizer(TEXTS[1]).input_ids) == TEXTS[1]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id == 2


def write_metadata_only_gguf(path: Path, architecture: str) -> Path:
    """A GGUF with a header and no tensors: enough to be refused on its architecture."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("not-a-causal-lm")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_refused(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rft model import-gguf: "), done.stderr
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_bad_inputs_are_one_line_errors_with_exit_2(tmp_path):
    out = tmp_path / "out"
    assert_refused(rft_model("import-gguf", str(tmp_path / "absent.gguf"), str(out)), "absent.gguf: no such file")

    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n")
    assert_refused(rft_model("import-gguf", str(text), str(out)), "not a GGUF file", "b'this'")

    mamba = write_metadata_only_gguf(tmp_path / "mamba.gguf", "mamba")
    assert_refused(rft_model("import-gguf", str(mamba), str(out)), "architecture 'mamba' is not supported",
                   "supported: llama, qwen2")

    assert_refused(rft_model("import-gguf", str(mamba), str(out), preamble="import sys; sys.modules['gguf'] = None"),
                   "the `gguf` package is not installed", "pip install gguf==")

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    llama = write_metadata_only_gguf(tmp_path / "llama.gguf", "llama")
    assert_refused(rft_model("import-gguf", str(llama), str(out)), "exists and is not empty", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf", "mamba.gguf", "model.gguf", "out"]
