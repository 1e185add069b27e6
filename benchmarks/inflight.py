"""`rft bench inflight`: in-flight weight updates of the continuous explorer (`explorer.inflight_updates`), measured on
a real model: what each token's log-probability is after a version is loaded with requests in flight, and what each
way of taking a version costs.

1. Log-probs (`explorer.inflight_kv`). One vLLM engine (prefix cache off), requests stepped `--steps-before` engine
   steps with version v, version v + 1 loaded in flight, the requests finished: first keeping the KV cache (0 -> 1),
   then recomputing it (1 -> 2). Version v is the model plus v x `--lr` x sign(seeded noise): one Adam step of
   learning rate `--lr` per version. Each completion is scored with Hugging Face transformers teacher-forced on each
   version's weights, and, for keep, on the new weights continuing the old weights' KV cache (transformers'
   past_key_values). Reported, mean and max |log-prob difference| over tokens: old-version tokens against their
   version, new-version tokens against their version, new-version tokens against the old-cache continuation, and
   the drift of one version (the two versions' teacher-forced log-probs of the same new tokens).
2. Cost. `--tasks` tasks of the config (default the flagship's arithmetic through its chat template) through the
   continuous scheduler (rft/explorer/continuous.py `Continuous`, `--max-inflight` tasks), with a new version every
   `--version-every` engine steps (two weight directories taken in turn, versions counting up), three ways: drain
   (stop submitting, finish what is in flight, reload: the default loop), in flight with the KV recomputed, in flight
   keeping it (its engine has no prefix cache). Reported per way: response tokens per second, seconds, versions
   loaded, and tasks in flight at the reloads.

Usage: rft bench inflight [--config CONFIG] [--model DIR] [--lr 3e-5] [--tasks 64] [--version-every 8] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rft.data.tasks import load_rows, rows_to_tasks
from rft.engine import SamplingSettings, VLLMEngine
from rft.explorer.continuous import Continuous
from rft.rewards import RewardContext, build_reward
from rft.run.config import load_config
from rft.weights.store import WeightStore, iter_safetensors
from rft.workflows import build_workflow

PROMPTS = [":3", ":8", "+1", ":5", "What is 2 + 3?", "Say hi.", "Count: 1 2 3", "Name a color."]


def publish_versions(model_dir: str, store_dir: Path, scale: float, kind: str = "sign") -> dict[int, str]:
    """Versions 1 and 2 of the model in a weight store: every tensor moved by v x `scale` x the same seeded noise
    (`sign`: its sign, one Adam step of learning rate `scale` per version; `noise`: the normal draw itself)."""
    import torch  # heavy: torch

    generator = torch.Generator().manual_seed(1)
    base = dict(iter_safetensors(model_dir))
    noise = {name: torch.randn(t.shape, generator=generator) for name, t in base.items()}
    step = {name: (torch.sign(n) if kind == "sign" else n) for name, n in noise.items()}
    store = WeightStore(store_dir)
    return {v: str(store.publish(v, [{name: t + v * scale * step[name].to(t.dtype) for name, t in base.items()}],
                                  model_dir)) for v in (1, 2)}


def in_flight_scenario(engine, version: int, path: str, *, recompute: bool, prompts: list[str], max_tokens: int,
                       steps_before: int, n: int = 2) -> dict:
    """Submit `prompts` (n samples each), step `steps_before` times, load `version` in flight, step to the end; every
    completion's prompt, tokens, log-probs and token versions, the reload's seconds and the sequences in flight."""
    sampling = SamplingSettings(n=n, temperature=1.0, max_tokens=max_tokens)
    requests = {}
    for i, text in enumerate(prompts):
        requests[f"v{version}-r{i}"] = engine.encode(text)
        engine.submit(f"v{version}-r{i}", requests[f"v{version}-r{i}"], sampling)
    done = []
    for _ in range(steps_before):
        done += engine.step()
    in_flight = engine.unfinished()
    started = time.monotonic()
    engine.load_weights_in_flight(path, version, recompute=recompute)
    reload_s = time.monotonic() - started
    while engine.unfinished():
        done += engine.step()
    out = {"version": version, "recompute": recompute, "path": path, "reload_s": reload_s,
           "in_flight_at_reload": in_flight, "weights_version": engine.weights_version, "completions": []}
    for request_id, generation in done:
        for c in generation.completions:
            out["completions"].append({"request": request_id, "prompt": list(generation.prompt_token_ids),
                                       "tokens": c.token_ids, "logprobs": c.logprobs, "versions": c.token_versions,
                                       "version": c.weights_version})
    return out


def teacher_forced(model, prompt: list[int], tokens: list[int], *, past=None, offset: int = 0):
    """log p(tokens[offset + j] | everything before) for j >= 0, float64 numpy: one forward pass over prompt +
    tokens, or over tokens[offset - 1:] on top of `past`, the KV cache of prompt + tokens[:offset - 1]."""
    import torch  # heavy: torch

    with torch.no_grad():
        if past is None:
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 + offset:-1]
        else:
            start = len(prompt) + offset - 1
            logits = model(torch.tensor([tokens[offset - 1:]]), past_key_values=past,
                           position_ids=torch.arange(start, len(prompt) + len(tokens))[None]).logits[0, :-1]
    logprobs = torch.log_softmax(logits.double(), -1)
    return logprobs.gather(-1, torch.tensor(tokens[offset:])[:, None])[:, 0].numpy()


def old_cache_continuation(old_model, new_model, prompt: list[int], tokens: list[int], first_new: int):
    """What a request that kept its KV cache computes for tokens[first_new:]: the KV of prompt +
    tokens[:first_new - 1] by the old weights (the forward passes before the load), the rest by the new ones."""
    import torch  # heavy: torch

    with torch.no_grad():
        past = old_model(torch.tensor([prompt + tokens[:first_new - 1]]), use_cache=True).past_key_values
    return teacher_forced(new_model, prompt, tokens, past=past, offset=first_new)


def score_scenario(scenario: dict, models: dict) -> dict:
    """Mean and max |difference| per comparison of the module docstring (part 1), over a scenario's tokens."""
    import numpy as np

    new = scenario["version"]
    old = new - 1
    gaps: dict[str, list[float]] = {"old_vs_own_version": [], "new_vs_own_version": [], "new_vs_old_cache": [],
                                    "one_version_drift": []}
    two_versions = 0
    for c in scenario["completions"]:
        lp, prompt, tokens, versions = np.array(c["logprobs"]), c["prompt"], c["tokens"], c["versions"]
        s = versions.index(new) if new in versions else len(versions)
        own_old, own_new = (teacher_forced(models[v], prompt, tokens) for v in (old, new))
        gaps["old_vs_own_version"] += list(np.abs(lp[:s] - own_old[:s]))
        gaps["new_vs_own_version"] += list(np.abs(lp[s:] - own_new[s:]))
        gaps["one_version_drift"] += list(np.abs(own_old[s:] - own_new[s:]))
        if 0 < s < len(tokens):
            two_versions += 1
            gaps["new_vs_old_cache"] += list(np.abs(lp[s:] - old_cache_continuation(models[old], models[new], prompt,
                                                                                     tokens, s)))
    return {"mode": "recompute" if scenario["recompute"] else "keep", "from": old, "to": new,
            "in_flight_at_reload": scenario["in_flight_at_reload"], "reload_s": round(scenario["reload_s"], 3),
            "two_version_samples": two_versions, "samples": len(scenario["completions"]),
            **{k: {"tokens": len(v), "mean": float(np.mean(v)) if v else None, "max": float(np.max(v)) if v else None}
               for k, v in gaps.items()}}


def log_probs(args: argparse.Namespace, engine, paths: dict[int, str]) -> list[dict]:
    """Part 1 of the module docstring on `engine` (prefix cache off), versions 0 -> 1 (keep) and 1 -> 2 (recompute)."""
    import torch  # heavy: torch
    from transformers import AutoModelForCausalLM  # heavy: transformers

    settings = dict(prompts=PROMPTS[:args.prompts], max_tokens=args.max_tokens, steps_before=args.steps_before)
    scenarios = [in_flight_scenario(engine, 1, paths[1], recompute=False, **settings),
                 in_flight_scenario(engine, 2, paths[2], recompute=True, **settings)]
    models = {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for v, p in {0: args.model, **paths}.items()}
    return [score_scenario(s, models) for s in scenarios]


def run_cost(engine, tasks, workflow, *, way: str, paths: dict[int, str], max_inflight: int,
             version_every: int) -> dict:
    """Part 2 of the module docstring, one way (`drain`, `recompute` or `keep`), from the engine's current version."""
    scheduler = Continuous(engine, workflow, max_inflight, in_flight_updates=way != "drain")
    queue, results, steps, loads, due = list(tasks), [], 0, [], False
    started = time.perf_counter()
    while queue or scheduler.inflight:
        if due and (way != "drain" or not scheduler.inflight):
            version = engine.weights_version + 1
            path = paths[1 + version % 2]
            loads.append(len(scheduler.inflight))
            if way == "drain":
                engine.load_weights(path, version)
            else:
                engine.load_weights_in_flight(path, version, recompute=way == "recompute")
            due = False
        while queue and scheduler.free() and not (due and way == "drain"):
            done = scheduler.submit(queue.pop(0), None)
            if done is not None:
                results.append(done.result)
        results.extend(f.result for f in scheduler.step())
        steps += 1
        due = due or steps % version_every == 0
    seconds = time.perf_counter() - started
    tokens = sum(len(s.response_tokens) for r in results for s in r.samples)
    return {"way": way, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "steps": steps, "versions_loaded": len(loads),
            "tasks_in_flight_at_reloads": statistics.mean(loads) if loads else 0.0}


def flagship_tasks(config: str, count: int):
    """The config's first `count` tasks, its workflow and explorer/model sections (chat template, sampling)."""
    cfg = load_config(config)
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="bench")[:count]
    return cfg, tasks, build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer, RewardContext.for_run(cfg)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench inflight", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-arithmetic.yaml", help="tasks, chat template, sampling "
                        "and the model of part 2 (default: %(default)s)")
    parser.add_argument("--model", default=None, help="HF model directory (default: the config's model.path)")
    parser.add_argument("--lr", type=float, default=3e-5, help="each version moves every weight by this (sign of "
                        "seeded noise): one Adam step (default: the flagship's learning rate)")
    parser.add_argument("--prompts", type=int, default=8, help="part 1: prompts (2 samples each)")
    parser.add_argument("--max-tokens", type=int, default=24, help="part 1: tokens per sample")
    parser.add_argument("--steps-before", type=int, default=6, help="part 1: engine steps before the load")
    parser.add_argument("--tasks", type=int, default=64, help="part 2: tasks per way")
    parser.add_argument("--max-inflight", type=int, default=16, help="part 2: explorer.max_inflight (tasks)")
    parser.add_argument("--version-every", type=int, default=8, help="part 2: a new version every N engine steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report (--json: one line)
    cfg, tasks, workflow = flagship_tasks(args.config, args.tasks)
    args.model = args.model or cfg.model.path
    result: dict = {"model": args.model, "lr": args.lr, "config": args.config, "tasks": len(tasks)}
    with tempfile.TemporaryDirectory(prefix="rft-bench-inflight-") as tmp:
        paths = publish_versions(args.model, Path(tmp) / "store", args.lr)
        max_len = cfg.model.max_prompt_len + max(cfg.model.max_response_len, args.max_tokens) + 16
        settings = dict(max_model_len=max_len, cpu_kvcache_gb=cfg.explorer.cpu_kvcache_gb, seed=cfg.run.seed)
        engine = VLLMEngine(args.model, prefix_cache=False, chat_template=cfg.model.chat_template, **settings)
        try:
            result["log_probs"] = log_probs(args, engine, paths)
            cost = [run_cost(engine, tasks, workflow, way="keep", paths=paths, max_inflight=args.max_inflight,
                             version_every=args.version_every)]
        finally:
            engine.close()
        engine = VLLMEngine(args.model, chat_template=cfg.model.chat_template, **settings)
        try:
            for way in ("drain", "recompute"):
                cost.append(run_cost(engine, tasks, workflow, way=way, paths=paths, max_inflight=args.max_inflight,
                                     version_every=args.version_every))
        finally:
            engine.close()
    result["cost"] = cost
    print(json.dumps(result)) if args.json else print_report(result)
    return 0


def print_report(result: dict) -> None:
    print(f"{result['model']}: a version = one Adam step at lr {result['lr']:g}")
    print("  log-prob differences (mean / max over tokens):")
    for r in result["log_probs"]:
        cells = ", ".join(f"{k} {v['mean']:.1e} / {v['max']:.1e}" for k, v in r.items()
                          if isinstance(v, dict) and v["mean"] is not None)
        print(f"    {r['mode']:<9} v{r['from']}->v{r['to']} ({r['two_version_samples']}/{r['samples']} samples span "
              f"both): {cells}")
    print(f"  cost, {result['tasks']} tasks of {result['config']}:")
    for r in result["cost"]:
        print(f"    {r['way']:<9} {r['tokens_per_s']:8.1f} tokens/s ({r['tokens']} tokens in {r['seconds']} s), "
              f"{r['versions_loaded']} versions loaded, {r['tasks_in_flight_at_reloads']:.1f} tasks in flight at "
              "each")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
