"""Run in a subprocess by test_inflight_updates.py (vLLM's LLM must be built under __main__), and by hand to measure
(docs/architecture.md, "In-flight weight updates"): one VLLMEngine on MODEL_DIR (prefix cache off, as
`explorer.inflight_kv: keep` runs it), then two scenarios, one after the other: requests submitted and stepped
`steps_before` engine steps with the version the engine holds, the next version loaded in flight
(`load_weights_in_flight`) keeping the KV cache (version 1), then recomputing it (version 2), and the requests stepped
to their end. Version v is MODEL_DIR's weights plus v x `scale` x a seeded perturbation. Prints one
`PROBE-RESULT {json}` line: per scenario, per completion its prompt, tokens, log-probs and token versions; the
reload's seconds, the sequences in flight then, and the seconds of the engine steps after it.

argv: MODEL_DIR WORK_DIR [SCALE [PERTURBATION(noise|sign)] [MAX_TOKENS [STEPS_BEFORE [PROMPTS]]]]
  noise: + SCALE x N(0, 1) per weight; sign: + SCALE x sign(N(0, 1)): the size of one Adam step at learning rate SCALE
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROMPTS = [":3", ":8", "+1", ":5", "What is 2 + 3?", "Say hi.", "Count: 1 2 3", "Name a color."]


def publish_versions(model_dir: str, work_dir: str, scale: float, kind: str) -> dict[int, str]:
    """Versions 1 and 2 of the model in a weight store: every tensor moved by v x `scale` x the same seeded noise."""
    import torch

    from rft.weights.store import WeightStore, iter_safetensors

    generator = torch.Generator().manual_seed(1)
    base = dict(iter_safetensors(model_dir))
    noise = {name: torch.randn(t.shape, generator=generator) for name, t in base.items()}
    store = WeightStore(Path(work_dir) / "store")
    return {v: str(store.publish(v, [{name: t + v * scale * (torch.sign(noise[name]) if kind == "sign" else
                                                             noise[name]).to(t.dtype) for name, t in base.items()}],
                                  model_dir)) for v in (1, 2)}


def scenario(engine, version: int, path: str, *, recompute: bool, prompts: int, max_tokens: int,
             steps_before: int) -> dict:
    """Submit, step, load `version` in flight, step to the end (see the module docstring)."""
    from rft.engine import SamplingSettings

    sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=max_tokens)
    requests = {}
    for i, text in enumerate(PROMPTS[:prompts]):
        requests[f"v{version}-r{i}"] = engine.encode(text)
        engine.submit(f"v{version}-r{i}", requests[f"v{version}-r{i}"], sampling)
    done = []
    for _ in range(steps_before):
        done += engine.step()
    in_flight = engine.unfinished()
    started = time.monotonic()
    engine.load_weights_in_flight(path, version, recompute=recompute)
    reload_s = time.monotonic() - started
    started = time.monotonic()
    while engine.unfinished():
        done += engine.step()
    out = {"version": version, "recompute": recompute, "path": path, "reload_s": reload_s,
           "in_flight_at_reload": in_flight, "steps_after_s": time.monotonic() - started,
           "weights_version": engine.weights_version, "completions": []}
    for request_id, generation in done:
        assert generation.prompt_token_ids == requests[request_id]
        for c in generation.completions:
            out["completions"].append({"request": request_id, "prompt": generation.prompt_token_ids,
                                       "tokens": c.token_ids, "logprobs": c.logprobs, "versions": c.token_versions,
                                       "version": c.weights_version})
    return out


def main(model_dir: str, work_dir: str, scale: float = 0.3, kind: str = "noise", max_tokens: int = 24,
         steps_before: int = 6, prompts: int = 4) -> dict:
    from rft.engine import VLLMEngine

    engine = VLLMEngine(model_dir, max_model_len=256, cpu_kvcache_gb=0.25, seed=0, prefix_cache=False)
    try:
        paths = publish_versions(model_dir, work_dir, scale, kind)
        settings = dict(prompts=prompts, max_tokens=max_tokens, steps_before=steps_before)
        return {"scenarios": [scenario(engine, 1, paths[1], recompute=False, **settings),
                              scenario(engine, 2, paths[2], recompute=True, **settings)]}
    finally:
        engine.close()


if __name__ == "__main__":
    casts = [str, str, float, str, int, int, int]
    result = main(*(cast(a) for cast, a in zip(casts, sys.argv[1:])))
    print("PROBE-RESULT " + json.dumps(result), flush=True)
