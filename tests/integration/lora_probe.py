"""Run in a subprocess by test_lora_engines.py (vLLM's LLM must be built under __main__): one VLLMEngine with LoRA
on the given model samples with the base weights (version 0), then after loading each adapter version of the given
weight store, and prints one JSON object with the samples and the reload times.

argv: MODEL_DIR STORE_DIR
"""
from __future__ import annotations

import json
import sys
import time


def main(model_dir: str, store_dir: str) -> dict:
    from rft.engine import SamplingSettings, VLLMEngine
    from rft.weights.store import WeightStore

    engine = VLLMEngine(model_dir, max_model_len=128, cpu_kvcache_gb=0.25, seed=0, lora_rank=4)
    prompts = [engine.encode(p) for p in (":3", "+1")]
    sampling = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=8)
    out: dict = {"prompts": prompts, "phases": [], "reload_s": []}

    def sample() -> None:
        groups = engine.generate(prompts, sampling)
        out["phases"].append([[{"tokens": c.token_ids, "logprobs": c.logprobs, "version": c.weights_version}
                               for c in g.completions] for g in groups])

    sample()
    store = WeightStore(store_dir)
    for version in store.versions():
        started = time.monotonic()
        engine.load_weights(store.path(version), version)
        out["reload_s"].append(time.monotonic() - started)
        sample()
    engine.close()
    return out


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
