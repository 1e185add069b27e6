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
        greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=12)
        out["greedy_before"] = [g.completions[0].token_ids for g in engine.generate(prompts, greedy)]
        engine.close()
        return out
    out["prefix_cached"] = prefix_cached(engine, engine.encode(":3+1") * 20)
    out.update(prefill_once(engine))
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
    out["forked_in_flight"] = fork_across_versions(engine, path)
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
        onednn = [f for f in layers
                  if any(isinstance(c.cell_contents, CPUDNNLGEMMHandler) for c in f.__closure__ or ())]
        return {"all": len(layers), "onednn": len(onednn)}

    return engine.llm.apply_model(count)[0]


def prefix_cached(engine, prompt: list[int]) -> list[int]:
    """The same prompt (over two KV blocks of `explorer.cpu_kv_block_size`'s default 32, under vLLM's CPU default
    of 128) twice, one sample each: the prompt tokens each request found in vLLM's prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return [engine.llm.generate([TokensPrompt(prompt_token_ids=prompt[:70])], SamplingParams(max_tokens=2),
                                use_tqdm=False)[0].num_cached_tokens for _ in range(2)]


WHOLE_BLOCKS = 64  # tokens: two of the engine's 32-token KV blocks, so its groups are prefilled once
FORKED = dict(n=8, temperature=0.8, top_p=1.0, max_tokens=12)  # the tiny model's first tokens mostly in the tail


def whole_blocks_prompt(engine) -> list[int]:
    return (engine.encode(":3+1") * 40)[:WHOLE_BLOCKS]


def completions(generation) -> list[dict]:
    return [{"tokens": c.token_ids, "logprobs": c.logprobs, "text": c.text, "finish": c.finish_reason,
             "version": c.weights_version, "token_versions": c.token_versions} for c in generation.completions]


def prefill_once(engine) -> dict:
    """A group whose prompt fills whole KV blocks (`VLLMEngine.forks`, rft/engine/prefill_once.py), through `generate`
    and through continuous submission, with the tokens vLLM's scheduler computed for it; the same group with
    prefill-once off; 400 first tokens at a low temperature (a peaked distribution to compare with transformers')."""
    from rft.engine import SamplingSettings

    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine
    counted = {"tokens": 0}
    schedule = scheduler.schedule

    def counting(*args, **kwargs):
        output = schedule(*args, **kwargs)
        counted["tokens"] += output.total_num_scheduled_tokens
        return output

    scheduler.schedule = counting

    def computed(run) -> tuple[object, dict]:
        engine.llm.reset_prefix_cache()
        counted["tokens"], before = 0, dict(engine.forks.sent)
        result = run()
        return result, {"tokens": counted["tokens"],
                        "requests": {k: n - before.get(k, 0) for k, n in engine.forks.sent.items()
                                     if n > before.get(k, 0)}}

    engine.forks.probe_tokens = 20  # of the tiny model's 99: its first tokens fall in the tail too
    prompt, sampling = whole_blocks_prompt(engine), SamplingSettings(**FORKED)
    forked, forked_tokens = computed(lambda: engine.generate([prompt], sampling)[0])

    def continuous():
        engine.submit("group", prompt, sampling)
        unfinished = [engine.unfinished()]
        returned = []
        while not returned:
            returned = engine.step()
            unfinished.append(engine.unfinished())
        return returned, unfinished

    (returned, unfinished), continuous_tokens = computed(continuous)
    engine.forks.enabled = False
    plain, plain_tokens = computed(lambda: engine.generate([prompt], sampling)[0])
    engine.forks.enabled = True
    first = engine.generate([prompt[:32]], SamplingSettings(n=400, temperature=0.2, top_p=1.0, max_tokens=2))[0]
    nucleus_settings = SamplingSettings(**{**FORKED, "top_p": 0.9})
    nucleus, nucleus_count = computed(lambda: engine.generate([prompt], nucleus_settings)[0])
    scheduler.schedule = schedule
    return {"forked": completions(forked), "forked_tokens": forked_tokens,
            "continuous": {"ids": [rid for rid, _ in returned], "completions": completions(returned[0][1]),
                           "prompt": returned[0][1].prompt_token_ids, "tokens": continuous_tokens,
                           "unfinished": unfinished},
            "plain": completions(plain), "plain_tokens": plain_tokens, "forked_prompt": prompt,
            "first_tokens": [c.token_ids[0] for c in first.completions],
            "forked_nucleus": completions(nucleus), "forked_nucleus_count": nucleus_count}


def fork_across_versions(engine, path: str) -> dict:
    """A group prefilled once whose probe ran on version 0 and whose samples go on after an in-flight load of
    version 7 (continuous submission, KV recomputed): a sample whose first token came from the probe has it from
    version 0 and the rest from 7; one whose first token was in the tail runs on version 7 alone."""
    from rft.engine import SamplingSettings

    prompt = whole_blocks_prompt(engine)
    engine.submit("across", prompt, SamplingSettings(**{**FORKED, "temperature": 0.2}))
    returned = []
    while engine.forks.owns("across/probe"):  # until the probe is back: the samples and tails are queued
        returned += engine.step()
    engine.load_weights_in_flight(path, 7, recompute=True)
    while not returned:
        returned = engine.step()
    return {"prompt": prompt, "completions": completions(returned[0][1])}


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
