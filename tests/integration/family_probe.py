"""Run in a subprocess by test_engine_families.py (vLLM's LLM must be built under __main__): for each model
directory in turn, starts a VLLMEngine, decodes the chat prompts greedily and closes it; prints one JSON object
(`PROBE-RESULT {...}`): per model directory, the prompts' token ids and the completions' token ids, or the
error that stopped the engine.

argv: MAX_TOKENS MODEL_DIR...
"""
from __future__ import annotations

import json
import sys

MESSAGES = [[{"role": "user", "content": "What is 2 + 3?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]]


def probe(model_dir: str, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from rft.engine import SamplingSettings, VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for messages in MESSAGES:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    engine = VLLMEngine(model_dir, max_model_len=128, cpu_kvcache_gb=0.25, seed=0)
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=max_tokens)
    out = {"prompts": prompts, "greedy": [g.completions[0].token_ids for g in engine.generate(prompts, greedy)]}
    engine.close()
    return out


def main(max_tokens: int, model_dirs: list[str]) -> dict:
    results = {}
    for model_dir in model_dirs:
        try:
            results[model_dir] = probe(model_dir, max_tokens)
        except Exception as e:  # noqa: BLE001  (reported to the test, which names the family)
            results[model_dir] = {"error": f"{type(e).__name__}: {e}"}
    return results


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(int(sys.argv[1]), sys.argv[2:])), flush=True)
