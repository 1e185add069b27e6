"""Image tasks through the explorer side (rft/workflows/registry.py `image_prompt`, single_turn): on the tiny random
Idefics3 with the transformers engine, an easy-VQA task becomes a group on the experience topic (the in-memory
transport) whose samples carry the task's images and the prompt text the processor expanded into exactly their
prompt tokens (what the trainer re-checks), through the schema; greedy baselines, the continuous explorer's
`submit_images`, and `rft eval` go the same way. Refused by name: a prompt over model.max_prompt_len with its image
tokens (whole, never cut), a prompt that writes the placeholder itself, an image task on a text-only model, and image
tasks for a workflow that takes none (when the config loads, and per task at an explorer's intake)."""
from __future__ import annotations

import dataclasses
import zipfile

import pytest

from rft.config import ConfigError
from rft.data.easy_vqa import WHEEL
from rft.data.tasks import TaskSet, load_rows, rows_to_tasks
from rft.engine import TransformersEngine
from rft.evaluation.checkpoints import Checkpoint
from rft.evaluation.main import build_evaluator, evaluate_checkpoints, load_eval_sets
from rft.explorer.continuous import Continuous
from rft.explorer.explorer import Explorer
from rft.models.vision import engine_prompt_problem, process_prompt, render_chat
from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import HEADER_ERROR, TaskRecord, decode_group
from rft.text.chat import ChatPrompt
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import create_run_topics
from rft.weights.store import WeightStore
from rft.workflows import build_workflow
from tests.records import make_image, read_topic
from tests.unit.test_explorer_loop_memory import TOPICS

SYSTEM = "Look closely."
# the tests that read easy-VQA tasks from the wheel `make` downloads
needs_wheel = pytest.mark.skipif(not zipfile.is_zipfile(WHEEL),
                                 reason=f"`make` downloads the easy-vqa wheel to {WHEEL}")
VQA = {"format": "easy_vqa", "prompt_template": "{prompt}", "generated_tasks": 3}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny Idefics3 whose images split into 2 x 2 tiles and a global view (31 image tokens a 64 x 64 image)."""
    from rft.models.tiny_vlm import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3", longest_edge=64)


@pytest.fixture(scope="module")
def engine(vlm):
    return TransformersEngine(vlm, seed=0, weights_version=2, chat_template=True)


def make_cfg(model_dir, *, model=None, **explorer):
    return run_config_from_dict({
        "run": {"name": "run"},
        "model": {"path": str(model_dir), "chat_template": True, "system_prompt": SYSTEM, "max_response_len": 4,
                  **(model or {})},
        "explorer": {"engine": "transformers", "reward": "exact_match", "n_samples": 2, "max_tokens": 4,
                     **explorer}})


def vqa_tasks(n: int, split: str = "train") -> list[TaskRecord]:
    source = TaskSet(key="data", id_prefix="", path=f"{WHEEL}:{split}", format="easy_vqa", weight=1.0, epochs=1,
                     prompt_key="prompt", answer_key="answer", prompt_template="{prompt}", generated_tasks=n, seed=0,
                     options={})
    return rows_to_tasks(load_rows(source), source, run_id="run")


def explore_batch(cfg, engine, tasks: list[TaskRecord], tmp_path, explorer_id: str) -> MemoryTransport:
    """One explorer batch of `tasks` on the in-memory transport (it explores all of them); the transport."""
    transport = MemoryTransport(partitions=1)
    create_run_topics(TOPICS, cfg.kafka, transport)
    sink = transport.sink()
    for task in tasks:
        sink.send_record(TOPICS.tasks, task, key=task.task_id)
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    explorer = Explorer(cfg.explorer, kafka=cfg.kafka, sync=cfg.sync, topics=TOPICS,
                        store=WeightStore(tmp_path / "store"), explorer_id=explorer_id, engine=engine,
                        workflow=workflow, transport=transport)
    try:
        explorer.join()
        assert explorer.run_batch() == len(tasks)
    finally:
        explorer.close("test over")
    return transport


@needs_wheel
def test_an_image_task_becomes_samples_with_its_images_on_the_experience_topic(vlm, engine, tmp_path, monkeypatch):
    import rft.engine.hf_engine as hf_engine

    engine_runs: list[str] = []  # the engine reuses the processor's output the workflow's length check made
    monkeypatch.setattr(hf_engine, "process_prompt", lambda *a, **k: engine_runs.append("run") or process_prompt(*a))
    cfg = make_cfg(vlm, tasks_per_batch=8, greedy_baseline=True)
    pictured = vqa_tasks(2)
    text = TaskRecord(run_id="run", task_id="text", epoch=0, prompt="3+4=", answer="7")
    # 242 tokens as text: over model.max_prompt_len 256 only with the image's 31 tokens
    too_long = dataclasses.replace(pictured[0], task_id="long", prompt="x" * 200)
    transport = explore_batch(cfg, engine, [*pictured, text, too_long], tmp_path, "e1")

    groups = {g.task_id: g for g in (decode_group(m.value) for m in read_topic(transport, TOPICS.experiences))}
    assert sorted(groups) == sorted([t.task_id for t in pictured] + ["text"])
    assert engine_runs == []  # sampling and the greedy baseline alike
    processor = engine.processor
    for task in pictured:
        group = groups[task.task_id]
        assert group.policy_version == 2 and group.greedy_reward is not None and len(group.samples) == 2
        # the chat template's user turn: the image, then the question; the system prompt kept before it
        messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": task.prompt}]}]
        for sample in group.samples:
            assert sample.images == task.images and len(sample.images) == 1
            assert sample.prompt_text == render_chat(processor, messages)
            assert sample.prompt_text.startswith(f"System:{SYSTEM}") and sample.prompt_text.count("<image>") == 1
            expected = process_prompt(processor, sample.prompt_text, [(i.data, i.media_type) for i in sample.images])
            assert sample.prompt_tokens.tolist() == expected.token_ids and expected.image_tokens == 31
            assert engine_prompt_problem(processor, sample.prompt_text, [(i.data, i.media_type) for i in sample.images],
                                         sample.prompt_tokens.tolist()) is None
    # a text task on the vision-language model: explored as text
    [*text_samples] = groups["text"].samples
    assert all(s.images == [] and s.prompt_text == "" for s in text_samples)
    assert text_samples[0].prompt_tokens.tolist() == engine.encode_chat("3+4=", ChatPrompt.of(cfg.model))

    [dead] = read_topic(transport, TOPICS.dead_letter)
    reason = dict(dead.headers)[HEADER_ERROR].decode()
    assert "the prompt is 273 tokens (31 of them image tokens), over model.max_prompt_len 256" in reason, reason
    assert "refused whole, never cut" in reason


@needs_wheel
def test_image_tasks_are_refused_by_name(vlm, engine, tiny_model):
    cfg = make_cfg(vlm)
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    [task] = vqa_tasks(1)
    writes_a_placeholder = dataclasses.replace(task, prompt="<image> and what else?")
    # on a text-only model (the tiny Qwen2): dead-lettered, not explored without its image
    text_model = TransformersEngine(tiny_model)
    [on_text_model] = workflow.explore([task], text_model)
    [placeholder] = workflow.explore([writes_a_placeholder], engine)
    assert on_text_model.error is not None and "text-only model" in on_text_model.error and not on_text_model.samples
    assert placeholder.error is not None and "2 image placeholders (<image>) for 1 images" in placeholder.error
    # a workflow that takes no images refuses an image task it would be given anyway
    turns = make_cfg(vlm, workflow="multi_turn", environment="retry")
    [multi] = build_workflow(turns.explorer, turns.model, build_reward(turns.explorer)).explore([task], engine)
    assert multi.error == ("the task has 1 image(s) and this workflow explores text only (workflows that take "
                           "images: single_turn)")


@pytest.mark.parametrize("sets, key", [({"data": {**VQA, "path": f"{WHEEL}:train"}}, "data.format"),
                                       ({"eval": {"sets": [{**VQA, "name": "vqa", "path": f"{WHEEL}:test"}]}},
                                        r"eval.sets\[0\].format")])
def test_image_sets_are_refused_a_workflow_or_model_that_takes_no_images_when_the_config_loads(vlm, tiny_model,
                                                                                                sets, key):
    base = {"model": {"path": str(vlm)}, "explorer": {"reward": "exact_match"}}
    assert run_config_from_dict({**base, **sets}).explorer.workflow == "single_turn"
    with pytest.raises(ConfigError, match=rf"explorer.workflow: workflow multi_turn explores text only \(workflows "
                                          rf"that take images: single_turn\), and {key} gives tasks with images"):
        run_config_from_dict({**base, **sets, "explorer": {"reward": "exact_match", "workflow": "multi_turn",
                                                            "environment": "retry"}})
    with pytest.raises(ConfigError, match=rf"model.path: .* is a text-only model \(its config.json has no "
                                          rf"vision_config\), and {key} gives tasks with images"):
        run_config_from_dict({**base, **sets, "model": {"path": str(tiny_model)}})


def test_an_explorer_dead_letters_image_tasks_its_workflow_cannot_take(vlm, engine, tmp_path):
    cfg = make_cfg(vlm, workflow="multi_turn", environment="retry", tasks_per_batch=4)
    pictured = TaskRecord(run_id="run", task_id="i", epoch=0, prompt="which colour?", images=[make_image()])
    transport = explore_batch(cfg, engine, [pictured], tmp_path, "e2")
    assert read_topic(transport, TOPICS.experiences) == []
    [dead] = read_topic(transport, TOPICS.dead_letter)
    assert dict(dead.headers)[HEADER_ERROR].decode() == (
        "task cannot be explored: it has 1 image(s) and explorer.workflow multi_turn explores text only (workflows "
        "that take images: single_turn)")


class Streaming:
    """The streaming engine protocol (rft/engine/base.py `StreamingEngine`) over the transformers engine, in memory:
    a submitted request runs whole at the next step."""

    def __init__(self, engine: TransformersEngine):
        self.engine, self.pending, self.submitted = engine, [], []
        self.processor, self.weights_version = engine.processor, engine.weights_version

    def encode(self, text, *, add_special_tokens=True):
        return self.engine.encode(text, add_special_tokens=add_special_tokens)

    def submit(self, request_id, prompt, sampling):
        self.submitted.append("submit")
        self.pending.append((request_id, self.engine.generate([prompt], sampling)[0]))

    def submit_images(self, request_id, prompt, sampling):
        self.submitted.append("submit_images")
        self.pending.append((request_id, self.engine.generate_images([prompt], sampling)[0]))

    def step(self):
        done, self.pending = self.pending, []
        return done

    def unfinished(self):
        return len(self.pending)


@needs_wheel
def test_the_continuous_explorer_submits_image_prompts(vlm, engine):
    cfg = make_cfg(vlm, model={"chat_template": False, "system_prompt": ""})
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    streaming = Streaming(engine)
    continuous = Continuous(streaming, workflow, max_inflight=4)
    tasks = [*vqa_tasks(1), TaskRecord(run_id="run", task_id="text", epoch=0, prompt="3+4=")]
    assert [continuous.submit(task, task.task_id) for task in tasks] == [None, None]
    assert streaming.submitted == ["submit_images", "submit"]
    finished = {f.source: f.result for f in continuous.step()}
    pictured = finished[tasks[0].task_id].samples
    assert len(pictured) == 2 and all(s.images == tasks[0].images for s in pictured)
    assert pictured[0].prompt_text == "<image>" + tasks[0].prompt  # no chat template: the placeholder, then the text
    image = [(i.data, i.media_type) for i in tasks[0].images]
    assert pictured[0].prompt_tokens.tolist() == process_prompt(engine.processor, pictured[0].prompt_text,
                                                               image).token_ids
    assert all(s.images == [] and s.prompt_text == "" for s in finished["text"].samples)


@needs_wheel
def test_rft_eval_scores_image_tasks(vlm, tmp_path):
    cfg = run_config_from_dict({
        "run": {"name": "ev", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(vlm), "chat_template": True, "max_response_len": 4},
        "explorer": {"engine": "transformers", "reward": "exact_match"},
        "eval": {"n_samples": 2, "k": 2, "max_tokens": 4,
                 "sets": [{**VQA, "name": "vqa", "path": f"{WHEEL}:test", "generated_tasks": 4}]}})
    sets = load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id=cfg.run.name, seed=cfg.run.seed)
    assert all(len(t.images) == 1 for t in sets[0].tasks)
    [(_, scores)] = evaluate_checkpoints(build_evaluator(cfg, sets, progress=False),
                                         [Checkpoint("initial", vlm, 0)])
    assert scores["vqa"].tasks == 4 and scores["vqa"].errors == 0
