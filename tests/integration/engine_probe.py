"""Run in a subprocess by test_engine.py (vLLM's LLM must be built under __main__): starts one VLLMEngine on
the given model, exercises it, and prints one JSON object with everything the test checks.

argv: MODEL_DIR WORK_DIR [--elastic-threads]
With --elastic-threads the engine is built with `elastic_threads=True` (its linear layers on torch's GEMM) and the
probe stops after the greedy decoding before any reload.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.waiting import wait_until


def main(model_dir: str, work_dir: str, *, elastic_threads: bool = False) -> dict:
    import torch

    from rft.engine import SamplingSettings, VLLMEngine
    from rft.weights.store import WeightStore, iter_safetensors

    started = time.monotonic()
    engine = VLLMEngine(model_dir, max_model_len=128, cpu_kvcache_gb=0.25, seed=0, elastic_threads=elastic_threads)
    out: dict = {"start_s": time.monotonic() - started, "linear_layers": linear_layers(engine)}
    prompts = [engine.encode(p) for p in (":3", ":8", "+1")]
    out["prompts"] = prompts
    if elastic_threads:
        out["greedy_before"] = [g.completions[0].token_ids
                                for g in engine.generate(prompts, SamplingSettings(n=1, temperature=0.0, max_tokens=12))]
        engine.close()
        return out
    out["prefix_cached"] = prefix_cached(engine, engine.encode(":3+1") * 20)
    sampled = engine.generate(prompts, SamplingSettings(n=4, temperature=0.8, top_p=1.0, max_tokens=12))
    out["sampled"] = [[{"tokens": c.token_ids, "logprobs": c.logprobs, "text": c.text, "finish": c.finish_reason,
                        "version": c.weights_version} for c in g.completions] for g in sampled]
    out["sampled_prompt_ids"] = [g.prompt_token_ids for g in sampled]
    nucleus = engine.generate(prompts, SamplingSettings(n=4, temperature=1.3, top_p=0.6, max_tokens=12))
    out["nucleus"] = [[{"tokens": c.token_ids, "logprobs": c.logprobs} for c in g.completions] for g in nucleus]
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=12)
    out["greedy_before"] = [g.completions[0].token_ids for g in engine.generate(prompts, greedy)]
    out["judge_candidates"] = engine.encode("10", add_special_tokens=False)
    out["judge_probs"] = engine.next_token_probs(prompts, out["judge_candidates"])

    store = WeightStore(Path(work_dir) / "store")
    generator = torch.Generator().manual_seed(1)
    perturbed = {name: t + 0.3 * torch.randn(t.shape, generator=generator)
                 for name, t in iter_safetensors(model_dir)}
    path = store.publish(7, [perturbed], model_dir)
    started = time.monotonic()
    engine.load_weights(path, 7)
    out["reload_s"] = time.monotonic() - started
    out["weights_version"] = engine.weights_version
    after = engine.generate(prompts, greedy)
    out["greedy_after"] = [g.completions[0].token_ids for g in after]
    out["version_after"] = [g.completions[0].weights_version for g in after]
    out["store_path"] = str(path)
    out.update(push_version(engine, model_dir, store, prompts, greedy))
    engine.close()
    return out


def linear_layers(engine) -> dict:
    """How the engine's model computes its linear layers: {"all": n, "onednn": those holding a vLLM oneDNN handler}
    (vllm/model_executor/layers/utils.py `dispatch_cpu_unquantized_gemm` binds `cpu_linear` to one or to torch)."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    def count(model) -> dict:
        layers = [m.cpu_linear for m in model.modules() if callable(getattr(m, "cpu_linear", None))]
        onednn = [f for f in layers if any(isinstance(c.cell_contents, CPUDNNLGEMMHandler) for c in f.__closure__ or ())]
        return {"all": len(layers), "onednn": len(onednn)}

    return engine.llm.apply_model(count)[0]


def prefix_cached(engine, prompt: list[int]) -> list[int]:
    """The same prompt (over two KV blocks of `explorer.cpu_kv_block_size`'s default 32, under vLLM's CPU default
    of 128) twice, one sample each: the prompt tokens each request found in vLLM's prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return [engine.llm.generate([TokensPrompt(prompt_token_ids=prompt[:70])], SamplingParams(max_tokens=2),
                                use_tqdm=False)[0].num_cached_tokens for _ in range(2)]


def push_version(engine, model_dir: str, store, prompts, greedy) -> dict:
    """Version 8 (another perturbation) through the push path: a PushSender in a thread of this process, the
    engine's worker as the one member of the group. Version 8 is also written to the store for the HF check."""
    import threading

    import torch

    from rft.weights.push import PushSender
    from rft.weights.store import iter_safetensors

    generator = torch.Generator().manual_seed(2)
    weights = {name: t + 0.3 * torch.randn(t.shape, generator=generator) for name, t in iter_safetensors(model_dir)}
    path = store.publish(8, [weights], model_dir)
    sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="probe", timeout_s=60)
    names = sorted(weights)
    buckets = [{n: weights[n] for n in names[: len(names) // 2]}, {n: weights[n] for n in names[len(names) // 2:]}]
    result: dict = {}

    def send():
        wait_until(lambda: sender.members_joined() >= 1, timeout=300, interval=0.05,
                   what="the engine to join the push group")
        sender.connect()
        result["push_bytes"] = sender.send(8, buckets)

    thread = threading.Thread(target=send)
    thread.start()
    started = time.monotonic()
    engine.join_push_group(sender.spec.to_json())
    version = engine.receive_pushed_weights()
    thread.join()
    result["push_s"] = time.monotonic() - started
    after = engine.generate(prompts, greedy)
    return {**result, "pushed_version": version, "greedy_pushed": [g.completions[0].token_ids for g in after],
            "version_pushed": [g.completions[0].weights_version for g in after], "pushed_path": str(path)}


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], elastic_threads="--elastic-threads" in sys.argv)),
          flush=True)
