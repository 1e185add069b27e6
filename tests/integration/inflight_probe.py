"""Run in a subprocess by test_inflight_updates.py (vLLM's LLM must be built under __main__): part 1 of `rft bench
inflight` (benchmarks/inflight.py) without the scoring: one VLLMEngine on MODEL_DIR (prefix cache off, as
`explorer.inflight_kv: keep` runs it), requests stepped `steps_before` engine steps, the next version loaded in flight
keeping the KV cache (0 -> 1), then recomputing it (1 -> 2), the requests finished. Version v is MODEL_DIR's weights
plus v x `scale` x seeded normal noise. Prints one `PROBE-RESULT {json}` line: both scenarios (per completion its
prompt, tokens, log-probs and token versions; the reload's seconds and the sequences in flight then).

argv: MODEL_DIR WORK_DIR SCALE MAX_TOKENS STEPS_BEFORE PROMPTS
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, work_dir: str, scale: float, max_tokens: int, steps_before: int, prompts: int) -> dict:
    from benchmarks.inflight import PROMPTS, in_flight_scenario, publish_versions
    from rft.engine import VLLMEngine

    engine = VLLMEngine(model_dir, max_model_len=256, cpu_kvcache_gb=0.25, seed=0, prefix_cache=False)
    try:
        paths = publish_versions(model_dir, Path(work_dir) / "store", scale, kind="noise")
        settings = dict(prompts=PROMPTS[:prompts], max_tokens=max_tokens, steps_before=steps_before)
        return {"scenarios": [in_flight_scenario(engine, 1, paths[1], recompute=False, **settings),
                              in_flight_scenario(engine, 2, paths[2], recompute=True, **settings)]}
    finally:
        engine.close()


if __name__ == "__main__":
    model_dir, work_dir, scale, max_tokens, steps_before, prompts = sys.argv[1:]
    result = main(model_dir, work_dir, float(scale), int(max_tokens), int(steps_before), int(prompts))
    print("PROBE-RESULT " + json.dumps(result), flush=True)
