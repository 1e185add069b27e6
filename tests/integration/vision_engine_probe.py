"""Run in a subprocess by test_vision_engine.py (vLLM's LLM must be built under __main__): one VLLMEngine on a tiny
Idefics3, greedy generation from image prompts, a reload of other weights in place, the same images again; prints
one JSON object with what the test checks; then an in-flight reload (recompute) under an image request, and an image
task explored through the continuous explorer's scheduler (single_turn: `submit_images`).

argv: MODEL_DIR OTHER_WEIGHTS_DIR
"""
from __future__ import annotations

import json
import sys
import time

from tests.vision_prompts import PROMPTS, image_prompts


def main(model_dir: str, other_dir: str) -> dict:
    from rft.engine import EngineError, SamplingSettings, VLLMEngine

    started = time.monotonic()
    engine = VLLMEngine(model_dir, max_model_len=256, cpu_kvcache_gb=0.25, seed=0)
    out: dict = {"start_s": time.monotonic() - started}
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
    prompts = image_prompts(engine.processor)

    def run(key: str) -> None:
        t = time.monotonic()
        generations = engine.generate_images(prompts, greedy)
        out[f"{key}_s"] = time.monotonic() - t
        out[f"{key}_prompt_ids"] = [g.prompt_token_ids for g in generations]
        out[key] = [g.completions[0].token_ids for g in generations]
        out[f"{key}_version"] = [g.completions[0].weights_version for g in generations]
        out[f"{key}_prompt_text"] = [g.prompt_text for g in generations]

    run("before")
    try:  # a prompt whose placeholders do not pair with its images is refused, and the engine goes on
        engine.generate_images([prompts[0].__class__(PROMPTS[0][0], ())], greedy)
        out["unpaired"] = "accepted"
    except EngineError as e:
        out["unpaired"] = str(e)
    started = time.monotonic()
    engine.load_weights(other_dir, 3)
    out["reload_s"] = time.monotonic() - started
    run("after")  # the same images: the encoder cache was reset, or this kills the engine
    try:
        engine.load_weights_in_flight(model_dir, 4, recompute=False)
        out["kept_in_flight"] = "accepted"
    except EngineError as e:
        out["kept_in_flight"] = str(e)
    # in flight with recompute: an image request started on version 3 finishes on version 4, the same images again
    engine.submit_images("flight", prompts[0], greedy)
    engine.step()
    engine.load_weights_in_flight(model_dir, 4, recompute=True)
    finished = []
    while not finished:
        finished = engine.step()
    out["in_flight_versions"] = finished[0][1].completions[0].token_versions
    out["continuous"] = explore_continuously(engine, model_dir)
    engine.close()
    return out


def explore_continuously(engine, model_dir: str) -> dict:
    """An image task through the continuous explorer's scheduler and single_turn (prepare -> `submit_images` ->
    finish): its samples' prompt text, prompt ids and image digests."""
    from rft.explorer.continuous import Continuous
    from rft.rewards import build_reward
    from rft.run.loading import run_config_from_dict
    from rft.schema import Image, TaskRecord
    from rft.workflows import build_workflow
    from tests.vision_prompts import encoded_image

    cfg = run_config_from_dict({"model": {"path": model_dir, "chat_template": True, "max_response_len": 4},
                                "explorer": {"n_samples": 2, "max_tokens": 4, "reward": "exact_match"}})
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    task = TaskRecord(run_id="run", task_id="pictured", epoch=0, prompt="what colour?", answer="red",
                      images=[Image.of(encoded_image(64, 48, seed=7)[0])])
    scheduler = Continuous(engine, workflow, max_inflight=1)
    assert scheduler.submit(task, "source") is None
    finished = []
    while not finished:
        finished = scheduler.step()
    result = finished[0].result
    return {"error": result.error, "prompt_text": [s.prompt_text for s in result.samples],
            "prompt_ids": [s.prompt_tokens.tolist() for s in result.samples],
            "images": [[i.sha256 for i in s.images] for s in result.samples], "task_images": [task.images[0].sha256]}


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(*sys.argv[1:3])), flush=True)
