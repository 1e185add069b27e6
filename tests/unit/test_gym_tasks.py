"""reasoning-gym and GSM8K task sets: rows, stable ids per (dataset, seed, index), seeds of train / mix / eval sets,
the curriculum selector over them, config errors naming the key; answer extraction; GSM8K scored with math-verify."""
from __future__ import annotations

import dataclasses
import json

import pytest
import reasoning_gym

from rft.config import ConfigError
from rft.data.selectors import RewardStats
from rft.data.tasks import DatasetError, build_picker, load_rows, load_task_sets, rows_to_tasks
from rft.evaluation.main import load_eval_sets
from rft.rewards import build_reward, resolve
from rft.rewards.text import last_number
from rft.run.loading import run_config_from_dict
from rft.schema import group_id_for
from tests.records import make_group

OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def cfg_for(data=None, **sections):
    return run_config_from_dict({"run": {"name": "gym"}, "model": {"path": "unused"}, "data": data or {}, **sections})


def gym_data(**extra):
    return {"format": "reasoning_gym", "path": "basic_arithmetic", "options": OPTIONS, "generated_tasks": 6, **extra}


def test_rows_are_the_datasets_entries_and_ids_are_stable_per_dataset_seed_index():
    cfg = cfg_for(gym_data(shuffle_seed=3, prompt_template="{prompt} Answer with a number."))
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="gym")
    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=6, **OPTIONS)
    assert [(t.prompt, t.answer) for t in tasks] == [(f"{e['question']} Answer with a number.", e["answer"])
                                                      for e in dataset]
    assert tasks[2].metadata == {"reasoning_gym": {"dataset": "basic_arithmetic", "options": OPTIONS, "seed": 3,
                                                   "size": 6, "index": 2}}
    again = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="gym")
    assert [t.task_id for t in tasks] == [t.task_id for t in again] and len({t.task_id for t in tasks}) == 6
    other_seed = cfg_for(gym_data(shuffle_seed=4))
    other = rows_to_tasks(load_rows(other_seed.data), other_seed.data, run_id="gym")
    assert not {t.task_id for t in tasks} & {t.task_id for t in other}


def test_mix_sets_and_eval_sets_draw_from_their_own_seeds():
    cfg = cfg_for({"shuffle_seed": 0, "mix": [gym_data(seed=10), gym_data(seed=11, weight=2.0)]},
                  eval={"sets": [{"name": "held_out", **gym_data(seed=99)}]})
    (_, first), (_, second) = load_task_sets(cfg.data, run_id="gym")
    assert [t.metadata["reasoning_gym"]["seed"] for t in first + second] == [10] * 6 + [11] * 6
    assert [t.prompt for t in first] != [t.prompt for t in second]
    assert all(t.task_id.startswith("m0.") for t in first) and all(t.task_id.startswith("m1.") for t in second)
    held_out = load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id="gym", seed=0)[0].tasks
    expected = reasoning_gym.create_dataset("basic_arithmetic", seed=99, size=6, **OPTIONS)
    assert [t.prompt for t in held_out] == [e["question"] for e in expected]


def test_the_curriculum_selector_keys_gym_tasks_by_id():
    cfg = cfg_for(gym_data(selector="curriculum", shuffle_seed=1, curriculum={"target": 0.5, "temperature": 0.0}))
    picker = build_picker(cfg.data, run_id="gym")
    tasks = picker.sets[0].tasks
    stats = RewardStats("gym")
    for i, task in enumerate(tasks):  # task 4 sits at the target, every other task is solved
        group = make_group("gym", i, rewards=[1.0, 0.0] if i == 4 else [1.0, 1.0])
        stats.add(dataclasses.replace(group, task_id=task.task_id, group_id=group_id_for("gym", task.task_id, 0)))
    assert picker.next(stats).task_id == tasks[4].task_id


@pytest.mark.parametrize("data,message", [
    (gym_data(path="basic_arithmetc"), r"data.path: unknown reasoning_gym dataset 'basic_arithmetc' \(did you mean "
                                       r"'basic_arithmetic'\?\)"),
    (gym_data(options={"min_termz": 2}), r"data.options: .*no option 'min_termz' \(did you mean 'min_terms'\?\)"),
    (gym_data(options={"min_terms": 3, "max_terms": 2}), r"data.options: .*max_terms must be >= min_terms"),
    (gym_data(options={"seed": 3}), r"data.options: .*must not set seed or size"),
    ({"mix": [gym_data(), gym_data(path="chain_sun")]}, r"data.mix\[1\].path: unknown .*'chain_sum'"),
    ({"path": "d.jsonl", "options": {"min_terms": 2}},
     r"data.options: dataset options are for formats reasoning_gym, reasoning_gym_image and generated"),
    ({"path": "d.jsonl", "format": "gsm8k"}, None),
])
def test_task_set_config_errors_name_the_key(data, message):
    if message is None:
        cfg_for(data)
        return
    with pytest.raises(ConfigError, match="<dict>: " + message):
        cfg_for(data)


def test_eval_set_and_reward_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"eval.sets\[0\].options: .*did you mean 'max_digits'"):
        cfg_for(eval={"sets": [{"name": "x", **gym_data(options={"max_digit": 2})}]})
    with pytest.raises(ConfigError, match=r"data.format: reward 'reasoning_gym' scores reasoning_gym tasks"):
        cfg_for({"path": "copy_char", "format": "generated"}, explorer={"reward": "reasoning_gym"})


@pytest.mark.parametrize("reply,number", [
    ("17 + 25 = 42.", "42"), ("The answer is -3,162!", "-3162"), ("x = 2.50", "2.50"), ("8-9=-1", "-1"),
    ("no number", None), ("", None),
])
def test_last_number(reply, number):
    assert last_number(reply) == number


def write_gsm8k(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?", "answer": "1000 * 2 = 2000\n#### 2,000"},
]


def test_gsm8k_rows_carry_the_final_answer_and_math_verify_scores_them(tmp_path):
    cfg = cfg_for({"path": str(write_gsm8k(tmp_path / "gsm8k.jsonl", GSM8K)), "format": "gsm8k",
                   "prompt_template": "{prompt}\nPut the final answer in \\boxed{{}}."}, explorer={"reward": "math"})
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="gym")
    assert [t.answer for t in tasks] == ["72", "2000"]
    assert tasks[0].prompt.endswith("altogether in April and May?\nPut the final answer in \\boxed{}.")
    assert tasks[0].metadata == {"solution": GSM8K[0]["answer"]}
    reward = build_reward(cfg.explorer)
    replies = ["She sold 24 in May, so \\boxed{72}.", "The total is 72", "\\boxed{71}", "I do not know",
               "<answer>2000</answer>"]
    assert [r.score for r in reward.score(replies, tasks[0])] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r.score for r in reward.score(["2 days make \\boxed{2000}", "$2{,}000$", "\\boxed{1000}"],
                                          tasks[1])] == [1.0, 1.0, 0.0]
    assert resolve("math")[0] == "function"


@pytest.mark.parametrize("row,message", [
    ({"question": "q"}, r"needs string fields 'question' and 'answer'"),
    ({"question": "q", "answer": "42"}, r"does not end with '#### N'"),
    ({"question": "q", "answer": "so ####  "}, r"nothing follows '####'"),
])
def test_gsm8k_row_errors_name_the_row(tmp_path, row, message):
    cfg = cfg_for({"path": str(write_gsm8k(tmp_path / "g.jsonl", [GSM8K[0], row])), "format": "gsm8k"})
    with pytest.raises(DatasetError, match=r"g.jsonl row 1: .*" + message):
        load_rows(cfg.data)
