"""`rft bench learn`'s method, piece by piece: which weights each snapshot holds (rft: the store's newest version,
hard-linked, across a garbage-collection race; TRL: the weights that were the newest at the mark), that TRL is given
the chat prompt text whose tokens are exactly rft's, and how the report derives final accuracies, times to reach
TRL's accuracy and the targets' verdicts. The whole benchmark on real parts is tests/e2e/test_bench_learn.py."""
from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch
import yaml

from benchmarks import learn
from benchmarks.learn import (
    DISK_SLACK_BYTES,
    algorithm_config,
    algorithm_section,
    check_disk,
    derived_config,
    disk_needed,
    link_version,
    main,
    mismatch_summary,
    parameter_count,
    parse_args,
    print_report,
    reach_time,
    rft_overrides,
    rft_signal,
    signal_line,
    snapshot,
    summarise,
    trl_signal,
)
from benchmarks.trl_reference import (
    Clock,
    Marks,
    TRLReferenceError,
    check_same_image_tokens,
    check_same_tokens,
    completion_text,
    grpo_config,
    image_rows,
    log_record,
    step_note,
    trl_model,
    trl_prompts,
    within_budget,
)
from rft.config import ConfigError
from rft.data.tasks import build_picker
from rft.models.tiny import build_tokenizer
from rft.run.loading import load_run_config, run_config_from_dict
from rft.schema import TaskRecord
from rft.weights.store import WeightStore


def publish(store: WeightStore, version: int, hf_dir) -> None:
    store.publish(version, [{"w": torch.full((2,), float(version))}], hf_dir)


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    return d


def test_snapshot_links_the_newest_version_and_reuses_an_unchanged_one(tmp_path, hf_dir):
    store = WeightStore(tmp_path / "weights", keep=2)
    assert snapshot(store.root, tmp_path / "mark-1", (0, None)) == (0, None)  # nothing published: the initial model
    publish(store, 0, hf_dir)
    assert snapshot(store.root, tmp_path / "mark-1", (0, None)) == (0, None)  # version 0 is the initial model
    publish(store, 1, hf_dir)
    publish(store, 2, hf_dir)
    version, path = snapshot(store.root, tmp_path / "mark-2", (0, None))
    assert version == 2 and sorted(os.listdir(path)) == sorted(os.listdir(store.path(2)))
    assert all(os.path.samefile(f"{path}/{name}", store.path(2) / name) for name in os.listdir(path))  # hard links
    assert snapshot(store.root, tmp_path / "mark-3", (2, path)) == (2, path)
    assert not (tmp_path / "mark-3").exists()


def test_link_retries_when_the_version_is_collected_while_it_is_linked(tmp_path, hf_dir, monkeypatch):
    store = WeightStore(tmp_path / "weights", keep=2)
    for v in (1, 2):
        publish(store, v, hf_dir)
    real_link, calls = os.link, []

    def racing_link(src, dst):
        if not calls:  # the trainer publishes two more versions: version 2 is collected under our feet
            publish(store, 3, hf_dir)
            publish(store, 4, hf_dir)
        calls.append(src)
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", racing_link)
    version, path = link_version(store.root, tmp_path / "mark-1")
    assert not store.path(2).exists() and version == 4
    assert sorted(os.listdir(path)) == sorted(os.listdir(store.path(4)))


class FakeModel:
    """What Marks uses of a Hugging Face model: state_dict, config, save_pretrained."""
    config = SimpleNamespace(tie_word_embeddings=False)

    def __init__(self):
        self.w = torch.zeros(1)

    def state_dict(self):
        return {"w": self.w}

    def save_pretrained(self, path, state_dict):
        path.mkdir()
        (path / "w").write_text(str(int(state_dict["w"].item())))


class FakeTokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def train_steps(marks: Marks, model: FakeModel, ends: list[float]) -> None:
    for step, end in enumerate(ends, start=1):
        model.w.fill_(step)  # in place, as an optimizer step: the marks must hold copies
        marks.take(step, end)
    marks.finish()


def test_trl_marks_hold_the_weights_that_were_newest_at_each_mark(tmp_path):
    model = FakeModel()
    marks = Marks(model, FakeTokenizer(), out=tmp_path, budget_s=30, count=3, clock=Clock(time.time()))
    train_steps(marks, model, [12, 18, 25, 31])  # the step ending at 31 crossed the budget: its weights came late
    assert [(m["mark"], m["time_s"], m["step"]) for m in marks.taken] == [(1, 10, 0), (2, 20, 2), (3, 30, 3)]
    assert marks.taken[0]["path"] is None  # before the first step ended: the initial model
    assert [(tmp_path / f"mark-{i}" / "w").read_text() for i in (2, 3)] == ["2", "3"]


def test_trl_marks_share_a_directory_and_take_the_final_weights_when_training_ends_early(tmp_path):
    model = FakeModel()
    marks = Marks(model, FakeTokenizer(), out=tmp_path, budget_s=30, count=3, clock=Clock(time.time()))
    train_steps(marks, model, [5, 8])
    assert [(m["step"], m["path"]) for m in marks.taken] == [(2, str(tmp_path / "mark-1"))] * 3
    assert (tmp_path / "mark-1" / "w").read_text() == "2" and not (tmp_path / "mark-2").exists()


def system(name: str, accuracies: list[float | None], *, versions=None) -> dict:
    marks = [{"mark": i + 1, "time_s": 240.0 * (i + 1), "version": versions[i] if versions else i + 1,
              "path": f"/{name}/mark-{i + 1}"} for i in range(len(accuracies))]
    return {"system": name, "steps": 9, "first_step_s": 30.0, "marks": marks}, dict(
        (m["path"], a) for m, a in zip(marks, accuracies, strict=True) if a is not None)


def test_report_times_to_trl_accuracy_and_verdicts():
    rft, rft_scores = system("rft-async", [0.30, 0.38, 0.40])
    trl, trl_scores = system("trl", [0.20, 0.30, 0.30])
    push, _ = system("rft-async-push", [None, None, None], versions=[None] * 3)
    report = summarise([rft, trl, push], {"initial": 0.14, **rft_scores, **trl_scores}, budget_s=720)
    assert report["trl_final_accuracy"] == 0.30
    assert (rft["final_accuracy"], rft["reach_trl_s"]) == (0.40, 240.0)
    assert (trl["final_accuracy"], trl["reach_trl_s"]) == (0.30, 480.0)  # TRL's own final, first reached at 480 s
    assert push["final_accuracy"] is None and [m["accuracy"] for m in push["marks"]] == [None] * 3
    assert report["targets"]["half_time"]["met"] is True  # 240 s <= 480 s / 2
    assert report["targets"]["equal_budget"]["met"] is True
    slower, slower_scores = system("rft-async", [0.20, 0.25, 0.30])
    report = summarise([slower, trl], {"initial": 0.14, **slower_scores, **trl_scores}, budget_s=720)
    assert report["targets"]["half_time"]["met"] is False  # reached at 720 s
    assert report["targets"]["equal_budget"]["met"] is True  # 0.30 >= 0.30


def test_reach_time_counts_the_initial_model_as_time_zero():
    rft, scores = system("rft-async", [0.1, 0.1, 0.1])
    for m in rft["marks"]:
        m["accuracy"] = scores[m["path"]]
    assert reach_time(rft, 0.2, 0.15) == 0.0
    assert reach_time(rft, 0.0, 0.15) is None


def test_a_config_without_held_out_tasks_is_refused_with_the_key(tmp_path, hf_dir, capsys):
    config = tmp_path / "no-eval.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(hf_dir)},
                                      "data": {"format": "generated", "path": "copy_char"}}))
    assert main(["--config", str(config), "--systems", "rft-async"]) == 2
    assert "eval.sets: no held-out task set" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"model": {"path": str(hf_dir)}, "algorithm": {"name": "dpo"},
                                      "data": {"format": "generated", "path": "copy_char"},
                                      "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}))
    assert main(["--config", str(config), "--systems", "rft-async,trl"]) == 2
    assert "algorithm.name: the TRL reference runs grpo only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(config), "--systems", "rft-async,deepspeed"])


CHATML = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
          "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


def chat_tokenizer(*, adds_bos: bool):
    """The tiny model's character tokenizer with a ChatML-like template; `adds_bos`: it prepends <bos> to every
    text it encodes with special tokens (as Llama tokenizers do), which would double the template's own."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>")
    tokenizer.chat_template = CHATML
    if adds_bos:
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)])
    return tokenizer


def test_trl_gets_the_chat_prompt_text_whose_tokens_are_rfts(hf_dir):
    cfg = run_config_from_dict({"model": {"path": str(hf_dir), "chat_template": True, "system_prompt": "Be brief."},
                                "data": {"format": "generated", "path": "copy_char"}})
    tasks = [TaskRecord(run_id="r", task_id=f"t{i}", epoch=0, prompt=f":{i}", answer=str(i)) for i in range(3)]
    tokenizer = chat_tokenizer(adds_bos=False)
    texts = trl_prompts(cfg, tokenizer, tasks)
    assert texts[1] == "<bos>system\nBe brief.<eos>\n<bos>user\n:1<eos>\n<bos>assistant\n"
    check_same_tokens(cfg, tokenizer, tasks, texts)
    with pytest.raises(TRLReferenceError, match="differently from rft's explorers"):
        check_same_tokens(cfg, chat_tokenizer(adds_bos=True), tasks, texts)



def test_trl_gets_a_vlms_image_tasks_as_chats_with_images_whose_tokens_are_rfts(tmp_path):
    """A VLM config (easy_vqa on the tiny Idefics3): TRL's rows are the chat with the task's images, its processor's
    ids of them are rft's (`ChatPrompt.image_messages` rendered and processed), and its policy is the image-text
    model."""
    from rft.data.easy_vqa import WHEEL
    from rft.models.tiny_vlm import make_tiny_idefics3
    from rft.models.vision import load_processor

    vlm = make_tiny_idefics3(tmp_path / "vlm", image_size=64)
    cfg = run_config_from_dict({"model": {"path": str(vlm), "chat_template": True, "system_prompt": "S."},
                                "data": {"format": "easy_vqa", "path": f"{WHEEL}:train", "generated_tasks": 2}})
    tasks = list(build_picker(cfg.data, run_id="r").drain())
    processor = load_processor(vlm)
    rows = image_rows(cfg, processor, tasks)
    assert rows[0]["prompt"] == [{"role": "system", "content": "S."}, {"role": "user", "content": tasks[0].prompt}]
    assert [len(r["images"]) for r in rows] == [1, 1] and rows[1]["task_index"] == 1
    check_same_image_tokens(cfg, processor, tasks, rows)
    other = run_config_from_dict({"model": {"path": str(vlm), "chat_template": True, "system_prompt": "T."},
                                  "data": cfg.to_dict()["data"]})
    with pytest.raises(TRLReferenceError, match="other token ids than rft's"):
        check_same_image_tokens(other, processor, tasks, rows)
    assert type(trl_model(cfg)).__name__ == "Idefics3ForConditionalGeneration"
    assert completion_text([{"role": "assistant", "content": "red"}]) == completion_text("red") == "red"


def test_trl_trains_float32_parameters_under_bfloat16_autocast(tmp_path, tiny_model):
    """model.dtype bfloat16 is mixed precision on both sides of a race: TRL's parameters stay float32 (as megatron's
    main weights) and its config turns on bf16 autocast; bfloat16 parameters would round small AdamW steps away."""
    cfg = run_config_from_dict({"model": {"path": str(tiny_model), "dtype": "bfloat16"},
                                "data": {"format": "generated", "path": "copy_char"}})
    model = trl_model(cfg)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    args = grpo_config(cfg, out=tmp_path, steps=1, use_cpu=True)
    assert args.bf16 and not args.fp16
    # what the float32 copy is for: one AdamW-sized step (lr 3e-5) survives in float32 and rounds away in bfloat16
    weight = torch.tensor(0.03)
    assert weight + 3e-5 != weight
    assert (weight.bfloat16() + 3e-5).item() == weight.bfloat16().item()

def test_race_targets_of_issue_28():
    """A quarter of TRL's time, the target system within noise of the config's own mode, and the best rft system at
    or above TRL at every mark."""
    inflight, inflight_scores = system("rft-async-inflight", [0.32, 0.36, 0.37])
    own, own_scores = system("rft", [0.31, 0.35, 0.40])
    trl, trl_scores = system("trl", [0.20, 0.31, 0.30])
    report = summarise([inflight, own, trl], {"initial": 0.14, **inflight_scores, **own_scores, **trl_scores},
                       budget_s=720, target="rft-async-inflight", eval_tasks=300)
    targets = report["targets"]
    assert targets["quarter_time"]["met"] is False  # TRL reached its 0.30 at 480 s; the target at 240 s > 120 s
    noise = 1.96 * math.hypot(math.sqrt(0.37 * 0.63 / 300), math.sqrt(0.40 * 0.60 / 300))
    assert f"= {noise:.3f} on 300 tasks" in targets["vs_off_policy"]["text"] and noise == pytest.approx(0.078, abs=1e-3)
    assert targets["vs_off_policy"]["met"] is True  # 0.37 >= 0.40 - 0.078
    assert targets["every_mark"]["met"] is True
    report = summarise([inflight, own, trl], {"initial": 0.14, **inflight_scores, **own_scores, **trl_scores},
                       budget_s=720, target="rft-async-inflight", eval_tasks=30)
    assert report["targets"]["vs_off_policy"]["met"] is True  # 30 tasks: noisier still
    behind, behind_scores = system("rft-async-inflight", [0.10, 0.20, 0.30])
    lagging, lagging_scores = system("rft", [0.10, 0.20, 0.50])
    report = summarise([behind, lagging, trl], {"initial": 0.14, **behind_scores, **lagging_scores, **trl_scores},
                       budget_s=720, target="rft-async-inflight", eval_tasks=300)
    assert report["targets"]["vs_off_policy"]["met"] is False  # 0.30 < 0.50 - 0.08
    assert report["targets"]["every_mark"]["met"] is False
    assert report["targets"]["every_mark"]["text"].endswith(
        "240 s (best rft 0.100, TRL 0.200), 480 s (best rft 0.200, TRL 0.310)")
    fast, fast_scores = system("rft-async-inflight", [0.32, 0.32, 0.32])
    fast["marks"][0]["time_s"] = 100.0  # a quarter of TRL's 480 s is 120 s
    report = summarise([fast, trl], {"initial": 0.14, **fast_scores, **trl_scores}, budget_s=720,
                       target="rft-async-inflight", eval_tasks=300)
    assert report["targets"]["quarter_time"]["met"] is True and report["targets"]["vs_off_policy"]["met"] is None


def test_seed_and_held_out_tasks_make_a_copy_of_the_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"seed": 0}, "model": {"path": "m"}, "eval": {"sets": [
        {"name": "a", "format": "reasoning_gym", "path": "basic_arithmetic", "generated_tasks": 100},
        {"name": "b", "format": "generated", "path": "copy_char"},
        {"name": "c", "format": "easy_vqa", "path": "test"}]}}))  # image sets are drawn by generated_tasks too
    assert derived_config(str(config), tmp_path, seed=None, eval_tasks=None) == str(config)
    copy = yaml.safe_load(open(derived_config(str(config), tmp_path, seed=3, eval_tasks=300)))
    assert copy["run"]["seed"] == 3 and [s["generated_tasks"] for s in copy["eval"]["sets"]] == [300, 300, 300]
    copy = yaml.safe_load(open(derived_config(str(config), tmp_path, seed=None, eval_tasks=None,
                                              overrides=["model.dtype=bfloat16", "trainer.lr=6.0e-5"])))
    assert copy["model"] == {"path": "m", "dtype": "bfloat16"} and copy["trainer"]["lr"] == 6e-5
    config.write_text(yaml.safe_dump({"model": {"path": "m"}, "eval": {"sets": [{"name": "f", "format": "jsonl",
                                                                                  "path": "held.jsonl"}]}}))
    with pytest.raises(ConfigError, match=r"eval.sets\[0\]: --eval-tasks resizes generated task sets"):
        derived_config(str(config), tmp_path, seed=None, eval_tasks=300)


def test_the_mismatch_of_a_systems_steps_is_summarised():
    steps = [{"logprob_mismatch_mean": m, "logprob_mismatch_max": x, "logprob_mismatch_kl": m / 10,
              "logprob_mismatch_frac": 0.0, "logprob_mismatch_stale0_mean": m / 2,
              **({"logprob_mismatch_stale1_mean": m} if i else {})}
             for i, (m, x) in enumerate([(0.01, 0.3), (0.02, 0.9), (0.04, 0.5)])]
    summary = mismatch_summary(steps)
    assert summary == {"mean": 0.02, "kl": 0.002, "frac": 0.0, "max": 0.9,
                       "by_staleness": {"stale0": 0.01, "stale1": 0.03}}
    assert mismatch_summary([])["mean"] is None


def test_system_overrides_are_checked_before_anything_runs(tmp_path, hf_dir, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(hf_dir)}, "data": {"format": "generated",
                                                                              "path": "copy_char"},
                                      "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}))
    assert main(["--config", str(config), "--systems", "rft-async-inflight",
                 "--system-set", "rft-async-inflight:algorithm.sequence_mask=0.5"]) == 2
    assert "rft-async-inflight:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(config), "--systems", "rft", "--system-set", "trl:run.seed=1"])
    assert main(["--config", str(config), "--systems", "trl", "--set", "model.dtype=bf16"]) == 2
    assert "model.dtype" in capsys.readouterr().err


def test_trls_log_values_become_strict_json_lines():
    record = log_record(3, 41.23456, {"reward": 0.25, "entropy": 1.5, "grad_norm": float("nan"), "epoch": 0,
                                      "note": "text", "flag": True})
    assert record == {"step": 3, "at_s": 41.23456, "reward": 0.25, "entropy": 1.5, "epoch": 0.0}
    json.loads(json.dumps(record, allow_nan=False))


def test_a_step_a_hair_past_the_budget_is_judged_alike_by_its_line_the_count_and_the_signal():
    """CI once counted 1991 TRL steps against 1990 lines not marked past the budget: the count and the signal read
    end times rounded to the millisecond, the line the time as measured. One rule now judges all three."""
    budget, late = 12.0, 12.0004  # rounds to the budget, yet ended after it
    assert step_note("trl", 7, late, budget) == "trl: step 7 at 12 s (past the budget: not counted)"
    assert not within_budget(late, budget) and within_budget(budget, budget) and within_budget(5.0, None)
    record = log_record(7, late, {"reward": 0.5})
    assert trl_signal([record], budget)["steps"] == [0, 0, 0, 0]
    assert trl_signal([log_record(7, budget, {"reward": 0.5})], budget)["steps"] == [0, 0, 0, 1]


def test_where_the_time_went_is_reported_per_quarter_of_the_budget():
    started = 1000.0
    steps = [{"time": started + at, "data_wait_s": wait, "train_s": 5.0, "keep_fraction": keep, "entropy": ent}
             for at, wait, keep, ent in [(30, 20.0, 0.5, 2.0), (40, 0.0, 0.25, 1.0), (120, 10.0, 0.1, 0.5),
                                         (399, 15.0, 0.1, 0.2), (401, 99.0, 0.0, 0.0)]]  # the last past the budget
    signal = rft_signal(steps, started, budget_s=400)
    assert signal == {"steps": [2, 1, 0, 1], "data_wait_s": [20.0, 10.0, 0.0, 15.0], "train_s": [10.0, 5.0, 0.0, 5.0],
                      "keep_fraction": [0.38, 0.1, None, 0.1], "entropy": [1.5, 0.5, None, 0.2]}
    assert signal_line(signal) == ("by 4 parts of the budget: steps 2/1/0/1, waiting for data 20/10/0/15 s, "
                                   "training 10/5/0/5 s, groups kept 0.38/0.10/-/0.10, entropy 1.50/0.50/-/0.20")
    log = [{"step": i + 1, "at_s": at, "frac_reward_zero_std": zero, "entropy": 1.0}
           for i, (at, zero) in enumerate([(20, 0.5), (90, 1.0), (110, 0.75), (350, 1.0), (420, 0.0)])]
    trl = trl_signal(log, budget_s=400)
    assert trl == {"steps": [2, 1, 0, 1], "no_gradient_steps": [1, 0, 0, 1], "keep_fraction": [0.25, 0.25, None, 0.0],
                   "entropy": [1.0, 1.0, None, 1.0]}
    assert "steps without a gradient 1/0/0/1, groups with a gradient 0.25/0.25/-/0.00" in signal_line(trl)


def test_a_race_whose_snapshots_would_not_fit_is_refused_before_anything_runs(tmp_path, tiny_model, capsys,
                                                                              monkeypatch):
    """An rft system keeps up to marks + keep_versions versions in model.dtype, TRL `marks` float32 snapshots; the
    parameter count read from the safetensors headers is checked against transformers' own count. A 16-mark race
    once filled the disk 20 minutes in (TRL's snapshots): the check refuses it before the first system starts."""
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert parameter_count(tiny_model) == params > 0
    cfg = run_config_from_dict({"model": {"path": str(tiny_model), "dtype": "bfloat16"},
                                "data": {"format": "generated", "path": "copy_char"}})
    need = disk_needed(cfg, ["rft", "rft-async-push", "rft-lora", "trl"], marks=16)
    assert need == {"slack": DISK_SLACK_BYTES, "rft": (16 + cfg.sync.keep_versions) * params * 2,
                    "trl": 16 * params * 4}  # push stores no versions, LoRA versions are adapters
    assert check_disk(need, tmp_path, free=sum(need.values())) is None
    problem = check_disk(need, tmp_path / "out", free=sum(need.values()) - 1)
    assert problem.startswith(f"--out {tmp_path / 'out'}: the race writes up to") and "fewer --marks" in problem

    # Through the command: a full disk cannot be made here, so the free space is the one thing faked.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tiny_model)}, "data": {"format": "generated",
                                                                                  "path": "copy_char"},
                                      "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}))
    monkeypatch.setattr(learn, "free_bytes", lambda where: DISK_SLACK_BYTES)
    out = tmp_path / "race"
    assert main(["--config", str(config), "--systems", "rft,trl", "--marks", "16", "--out", str(out)]) == 2
    assert "take fewer --marks" in capsys.readouterr().err
    assert not out.exists()


def test_a_model_whose_weights_cannot_be_read_is_refused_with_its_path(tmp_path, hf_dir, capsys):
    (hf_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(hf_dir)}, "data": {"format": "generated",
                                                                              "path": "copy_char"},
                                      "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}))
    assert main(["--config", str(config), "--systems", "rft", "--out", str(tmp_path / "race")]) == 2
    assert f"model.path: {hf_dir}: its safetensors files cannot be read" in capsys.readouterr().err


def test_an_algorithm_system_keeps_the_keys_its_algorithm_takes_and_reports_those_it_drops(tmp_path):
    """`rft:<algorithm>`: the config with algorithm.name switched; the config's algorithm keys the algorithm takes
    keep their values, another algorithm's are dropped and returned; the rest are the algorithm's defaults."""
    grpo = {"name": "grpo", "loss_agg": "seq_mean", "clip_eps": 0.3, "kl_coef": 0.01}
    assert algorithm_section(grpo, "sapo") == ({**grpo, "name": "sapo"}, {})  # sapo takes GRPO's keys
    assert algorithm_section(grpo, "raft") == ({"name": "raft", "loss_agg": "seq_mean"},
                                               {"clip_eps": 0.3, "kl_coef": 0.01})
    assert algorithm_section({"name": "sapo", "sapo_tau_neg": 1.2}, "grpo") == ({"name": "grpo"},
                                                                                  {"sapo_tau_neg": 1.2})
    with pytest.raises(ValueError, match="algorithm.name"):
        algorithm_section(grpo, "no_such_loss")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "m"}, "algorithm": grpo, "trainer": {"lr": 3e-5}}))
    path, dropped = algorithm_config(str(config), "rft:raft", tmp_path, ["algorithm.clip_eps=0.25"])
    assert path == str(tmp_path / "run-algorithm-raft.yaml") and dropped == {"clip_eps": 0.25, "kl_coef": 0.01}
    cfg = load_run_config(path)
    assert cfg.algorithm.name == "raft" and cfg.algorithm.options["loss_agg"] == "seq_mean"
    assert cfg.algorithm.options["raft_best_only"] is True and cfg.trainer.lr == 3e-5  # raft's default; the rest kept


def test_algorithm_systems_are_named_on_the_command_line_and_run_in_the_configs_own_mode(tmp_path):
    args = parse_args(["--systems", "rft:grpo", "rft:sapo,rft:rec", "--system-set",
                       "rft:rec:algorithm.rec_clip_mode=one_side", "--system-set", "rft:sapo:run.name=a:b"])
    assert args.systems == ["rft:grpo", "rft:sapo", "rft:rec"]
    assert args.extra == {"rft:rec": ["algorithm.rec_clip_mode=one_side"], "rft:sapo": ["run.name=a:b"]}
    assert parse_args(["--systems", "rft,trl"]).systems == ["rft", "trl"]
    overrides = rft_overrides("rft:sapo", tmp_path)
    assert f"run.output_dir={tmp_path / 'algorithm-sapo'}" in overrides and "sync.method=pull" in overrides
    assert not any(o.startswith("run.mode=") for o in overrides)  # the config's own mode
    for bad in (["--systems", "rft:no_such_loss"], ["--systems", "rft:sapo,rft:sapo"],
                ["--systems", "rft:sapo", "--system-set", "rft:opmd=1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_an_algorithm_systems_overrides_are_checked_against_its_algorithm_before_anything_runs(tmp_path, hf_dir,
                                                                                                 capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(hf_dir)}, "algorithm": {"name": "grpo", "clip_eps": 0.3},
                                      "data": {"format": "generated", "path": "copy_char"},
                                      "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}))
    assert main(["--config", str(config), "--systems", "rft:grpo,rft:raft",
                 "--system-set", "rft:raft:algorithm.sapo_tau_pos=2"]) == 2
    err = capsys.readouterr().err
    assert "rft:raft:" in err and "sapo_tau_pos" in err
    out = tmp_path / "out"
    (out / "kept").mkdir(parents=True)  # refused after the systems' checks: nothing runs
    assert main(["--config", str(config), "--systems", "rft:grpo,rft:raft", "--out", str(out),
                 "--system-set", "rft:raft:algorithm.raft_threshold=0.5"]) == 2  # raft's key, not grpo's: checked
    assert "not empty" in capsys.readouterr().err  # as raft's, with grpo's clip_eps dropped


def test_an_algorithm_race_compares_each_algorithm_with_grpo_at_each_mark_within_noise(capsys):
    grpo, grpo_scores = system("rft:grpo", [0.30, 0.35, 0.40])
    sapo, sapo_scores = system("rft:sapo", [0.32, 0.45, 0.50])
    opmd, opmd_scores = system("rft:opmd", [0.20, 0.30, 0.30])
    report = summarise([grpo, sapo, opmd], {"initial": 0.14, **grpo_scores, **sapo_scores, **opmd_scores},
                       budget_s=720, eval_tasks=300)
    race = report["algorithm_race"]
    assert race["baseline"] == "rft:grpo" and list(race["systems"]) == ["rft:sapo", "rft:opmd"]
    noise = 1.96 * math.hypot(math.sqrt(0.5 * 0.5 / 300), math.sqrt(0.4 * 0.6 / 300))
    final = race["systems"]["rft:sapo"]["final"]
    assert final["noise"] == pytest.approx(noise, abs=1e-4) and final["difference"] == pytest.approx(0.10)
    assert [m["verdict"] for m in race["systems"]["rft:sapo"]["marks"]] == ["within noise", "better", "better"]
    assert [m["verdict"] for m in race["systems"]["rft:opmd"]["marks"]] == ["worse", "within noise", "worse"]
    report = summarise([grpo, sapo], {"initial": 0.14, **grpo_scores, **sapo_scores}, budget_s=720, eval_tasks=30)
    assert report["algorithm_race"]["systems"]["rft:sapo"]["final"]["verdict"] == "within noise"  # 30 tasks
    print_report(report)
    out = capsys.readouterr().out
    assert "rft:sapo against rft:grpo: @240 s 0.320 vs 0.300 (+0.020" in out and "target:" not in out  # no TRL
    assert "missing" in summarise([sapo], {"initial": 0.14, **sapo_scores}, budget_s=720)["algorithm_race"]
    assert "algorithm_race" not in summarise([grpo], {"initial": 0.14, **grpo_scores}, budget_s=720)


def test_a_variant_with_its_own_config_is_named_on_the_command_line(tmp_path):
    args = parse_args(["--systems", "rft:grpo,rft:grpo@openenv", "rft-async@b", "--system-config",
                       "rft:grpo@openenv=configs/smollm2-arithmetic-openenv.yaml", "--system-set",
                       "rft:grpo@openenv:trainer.lr=1e-5", "--system-set", "rft-async@b:run.name=a:b"])
    assert args.systems == ["rft:grpo", "rft:grpo@openenv", "rft-async@b"]
    assert args.configs == {"rft:grpo@openenv": "configs/smollm2-arithmetic-openenv.yaml"}
    assert args.extra == {"rft:grpo@openenv": ["trainer.lr=1e-5"], "rft-async@b": ["run.name=a:b"]}
    assert learn.algorithm_of("rft:grpo@openenv") == "grpo" and learn.algorithm_of("rft-async@b") is None
    overrides = rft_overrides("rft-async@b", tmp_path)  # the system it is a variant of: async, its own directory
    assert "run.mode=async" in overrides and f"run.output_dir={tmp_path / 'rft-async@b'}" in overrides
    assert f"run.output_dir={tmp_path / 'algorithm-grpo@openenv'}" in rft_overrides("rft:grpo@openenv", tmp_path)
    assert parse_args(["--systems", "rft", "--system-config", "rft=other.yaml"]).configs == {"rft": "other.yaml"}
    for bad in (["--systems", "rft,trl", "--system-config", "trl=x.yaml"],  # TRL runs --config
                ["--systems", "rft@a", "--system-config", "rft@a"],
                ["--systems", "rft@a", "--system-config", "rft@a=x.yaml", "--system-config", "rft@a=y.yaml"],
                ["--systems", "rft", "--system-config", "rft@a=x.yaml"],  # not in --systems
                ["--systems", "rft@"], ["--systems", "trl@a"], ["--systems", "rft@a/b"], ["--systems", "rft:nope@a"],
                ["--systems", "rft@a,rft@a"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_system_config_is_checked_against_the_configs_model_before_anything_runs(tmp_path, hf_dir, capsys):
    raw = {"model": {"path": str(hf_dir)}, "data": {"format": "generated", "path": "copy_char"},
           "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}
    config, own = tmp_path / "run.yaml", tmp_path / "own.yaml"
    config.write_text(yaml.safe_dump(raw))
    other = tmp_path / "other-model"
    other.mkdir()
    for own_raw, problem in (({**raw, "model": {"path": str(other)}}, "is not --config's"),
                             ({**raw, "stages": [{"name": "a"}, {"name": "b"}]}, "stages: a multi-stage"),
                             ({**raw, "trainer": {"lr": -1}}, "trainer.lr")):
        own.write_text(yaml.safe_dump(own_raw))
        assert main(["--config", str(config), "--systems", "rft:grpo,rft:grpo@own",
                     "--system-config", f"rft:grpo@own={own}"]) == 2
        assert problem in capsys.readouterr().err
    own.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    (out / "kept").mkdir(parents=True)  # refused after the systems' checks: nothing runs
    assert main(["--config", str(config), "--systems", "rft:grpo,rft:grpo@own", "--out", str(out),
                 "--system-config", f"rft:grpo@own={own}"]) == 2
    assert "not empty" in capsys.readouterr().err


def test_a_variant_runs_its_own_config_and_races_the_baseline_on_the_configs_held_out_tasks(tmp_path, monkeypatch,
                                                                                          capsys):
    raw = {"model": {"path": "m"}, "algorithm": {"name": "grpo", "clip_eps": 0.3},
           "data": {"format": "generated", "path": "copy_char"},
           "eval": {"sets": [{"name": "c", "format": "generated", "path": "copy_char"}]}}
    config, own = tmp_path / "run.yaml", tmp_path / "own.yaml"
    config.write_text(yaml.safe_dump(raw))
    own.write_text(yaml.safe_dump({**raw, "explorer": {"max_turns": 3}}))
    ran, evaluated = {}, []

    def fake_run(system, path, **_):
        ran[system] = load_run_config(path)
        return system_result(system)

    def system_result(name):
        return system(name, [0.3 if name == "rft:grpo" else 0.5])[0]

    monkeypatch.setattr(learn, "run_rft", fake_run)
    monkeypatch.setattr(learn, "evaluate", lambda path, systems, **_: evaluated.append(path) or {
        "initial": 0.2, **{m["path"]: 0.3 if s["system"] == "rft:grpo" else 0.5 for s in systems for m in s["marks"]}})
    args = parse_args(["--config", str(config), "--systems", "rft:grpo,rft:grpo@own", "--seed", "7",
                       "--eval-tasks", "40", "--system-config", f"rft:grpo@own={own}"])
    (tmp_path / "out").mkdir()
    result = learn.run_all(args, tmp_path / "out")
    assert ran["rft:grpo@own"].explorer.max_turns == 3 and ran["rft:grpo"].explorer.max_turns != 3
    assert {c.run.seed for c in ran.values()} == {7} and {c.algorithm.name for c in ran.values()} == {"grpo"}
    assert ran["rft:grpo@own"].eval.sets[0].generated_tasks == 40
    assert evaluated == [str(tmp_path / "out" / "run-bench.yaml")]  # every snapshot: --config's held-out tasks
    race = result["algorithm_race"]["systems"]
    assert list(race) == ["rft:grpo@own"] and race["rft:grpo@own"]["final"]["difference"] == pytest.approx(0.2)
    print_report(result)
    assert f"rft:grpo@own: ran {own} (evaluated on {config}'s held-out tasks)" in capsys.readouterr().out
