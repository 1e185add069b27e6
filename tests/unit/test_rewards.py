"""Rewards: known answers, malformed model output, the [0, 1] contract, registry and config-time checks."""
from __future__ import annotations

import math

import pytest

from rft.config import ConfigError
from rft.rewards import (
    RewardError,
    RewardResult,
    WeightedReward,
    available_rewards,
    build_reward,
    checked,
    register_reward,
    resolve,
)
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord

MALFORMED = ["", "\x00\xff\ufffd", "<answer>", "</answer><answer>", "\\boxed{", "}}}\\frac{", "<think>unclosed",
             "9" * 5000, "<answer>" * 100, "((((((", "nan", "inf", "-inf"]


def task(answer, **metadata) -> TaskRecord:
    return TaskRecord(run_id="r", task_id="t", epoch=0, prompt="q", answer=answer, metadata=metadata)


def score(name: str, response: str, t: TaskRecord) -> RewardResult:
    return checked(name, resolve(name)[1](response, t))


@pytest.mark.parametrize("name,answer,metadata", [
    ("exact_match", "42", {}), ("format", None, {}), ("math", "\\frac{1}{2}", {}),
    ("countdown", {"target": 16, "numbers": [3, 5, 2]}, {}), ("char_accuracy", "7", {"alphabet": "0123456789"}),
])
def test_malformed_output_scores_in_range_and_never_raises(name, answer, metadata):
    for response in MALFORMED:
        result = score(name, response, task(answer, **metadata))
        assert 0.0 <= result.score <= 1.0 and math.isfinite(result.score), (name, response)


def test_exact_match():
    assert score("exact_match", " 42\n", task(42)).score == 1.0
    assert score("exact_match", "41", task(42)).score == 0.0
    assert score("exact_match", "42", task(None)).score == 0.0


def test_format_requires_think_then_answer():
    assert score("format", "<think>a\nb</think>\n<answer>7</answer>", task(None)).score == 1.0
    only_answer = score("format", "<answer>7</answer>", task(None))
    assert only_answer.score == 0.0 and only_answer.components == {"has_think": 0.0, "has_answer": 1.0}
    assert score("format", "<think>x</think><answer>7</answer> trailing", task(None)).score == 0.0


@pytest.mark.parametrize("response,answer,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>2+2</think><answer>4</answer>", "4", 1.0),
    ("The result: $\\frac{6}{4}$", "\\frac{3}{2}", 1.0),
    ("\\boxed{3}", "#### 4", 0.0),
    ("Natalia sold 48/2 = 24 clips... \\boxed{72}", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("no number at all", "5", 0.0),
])
def test_math_known_answers(response, answer, expected):
    result = score("math", response, task(answer))
    assert result.score == expected
    assert result.components["correct"] == expected


@pytest.mark.parametrize("response,expected", [
    ("<answer>(3+5)*2</answer>", 1.0),
    ("<think>try</think><answer>(3 + 5) * 2 = 16</answer>", 1.0),
    ("(5+3)*2", 1.0),  # no tags: the last line
    ("<answer>3+5+2</answer>", 0.1),  # uses the numbers, wrong value
    ("<answer>(3+5)*2*2</answer>", 0.0),  # 2 used twice
    ("<answer>3*5</answer>", 0.0),  # 2 unused
    ("<answer>__import__('os').system('x')</answer>", 0.0),
    ("<answer>3**5-2</answer>", 0.0),  # power is not allowed
    ("<answer>3/(5-5)*2</answer>", 0.0),
])
def test_countdown_known_answers(response, expected):
    assert score("countdown", response, task({"target": 16, "numbers": [3, 5, 2]})).score == expected


def test_countdown_reads_numbers_from_metadata():
    assert score("countdown", "<answer>6/3+5</answer>", task(7, nums=[3, 5, 6])).score == 1.0
    assert score("countdown", "<answer>6/3+5</answer>", task(7)).score == 0.0  # no numbers given


@pytest.mark.parametrize("response,expected", [
    ("7", 1.0), ("7\n", 1.0), ("8", 0.25), ("x", 0.0), ("", 0.0),
    ("77", 0.75 * 0.5 + 0.25), ("7x", 0.75 * 0.5 + 0.25 * 0.5),
])
def test_char_accuracy_partial_credit(response, expected):
    assert score("char_accuracy", response, task("7", alphabet="0123456789")).score == pytest.approx(expected)


def test_char_accuracy_multi_character_answer():
    result = score("char_accuracy", "1x3", task("123", alphabet="0123456789"))
    assert result.components["position"] == pytest.approx(2 / 3)
    assert result.score == pytest.approx(0.75 * 2 / 3 + 0.25 * 2 / 3)


def _cfg(**explorer):
    return run_config_from_dict({"model": {"path": "unused"}, "explorer": explorer})


def test_weighted_combination_is_normalised_mean_with_components():
    reward = build_reward(_cfg(reward="weighted", reward_weights={"exact_match": 3.0, "char_accuracy": 1.0}).explorer)
    assert isinstance(reward, WeightedReward)
    [right, wrong] = reward.score(["7", "8"], task("7", alphabet="0123456789"))
    assert right.score == pytest.approx(1.0)
    assert wrong.score == pytest.approx((3 * 0.0 + 1 * 0.25) / 4)
    assert wrong.components["char_accuracy"] == pytest.approx(0.25)
    assert wrong.components["char_accuracy.alphabet"] == 1.0


def test_out_of_range_reward_is_an_error_naming_it():
    with pytest.raises(RewardError, match="'too_big'.*must be in \\[0, 1\\]"):
        checked("too_big", 1.5)
    with pytest.raises(RewardError, match="NaN|nan"):
        checked("nan_reward", float("nan"))
    with pytest.raises(RewardError, match="returned str"):
        checked("text", "1")


def test_registry_rejects_duplicates_and_lists_builtins():
    built_in = {"exact_match", "math", "format", "countdown", "char_accuracy", "judge", "weighted"}
    assert built_in <= set(available_rewards())
    with pytest.raises(RewardError, match="already registered"):
        register_reward("math")(lambda r, t: 0.0)


def test_import_path_reward_is_resolved_at_config_load():
    cfg = _cfg(reward="rft.rewards.text:exact_match")
    assert build_reward(cfg.explorer).score(["5"], task("5"))[0].score == 1.0
    with pytest.raises(ConfigError, match="explorer.reward: .*no callable 'missing'"):
        _cfg(reward="rft.rewards.text:missing")
    with pytest.raises(ConfigError, match="explorer.reward: .*cannot import"):
        _cfg(reward="no_such_package.mod:fn")


@pytest.mark.parametrize("explorer,message", [
    ({"reward": "exact_matc"}, "explorer.reward: unknown reward 'exact_matc' \\(did you mean 'exact_match'\\?\\)"),
    ({"reward_weights": {"math": 1.0}}, "explorer.reward_weights: set explorer.reward to 'weighted'"),
    ({"reward": "weighted"}, "explorer.reward_weights: reward 'weighted' needs"),
    ({"reward": "weighted", "reward_weights": {"math": -1.0}}, "explorer.reward_weights.math: weight must be >= 0"),
    ({"reward": "weighted", "reward_weights": {"math": 0.0}}, "must not all be 0"),
    ({"reward": "weighted", "reward_weights": {"formt": 1.0}},
     "explorer.reward_weights.formt: .*did you mean 'format'"),
    ({"reward": "judge"}, "explorer.judge_model: the judge reward needs"),
])
def test_bad_reward_config_fails_at_load_naming_the_key(explorer, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**explorer)


def test_judge_scores_are_its_yes_probability(tiny_model):
    import torch

    from rft.engine import TransformersEngine
    from rft.rewards.judge import JudgeReward

    engine = TransformersEngine(tiny_model)
    judge = JudgeReward(engine, template="Q{prompt}A{answer}R{response}?", yes="1", no="0")
    t = TaskRecord(run_id="r", task_id="t", epoch=0, prompt="2+2", answer="4")
    results = judge.score(["4", "5", ""], t)
    yes, no = engine.encode("1", add_special_tokens=False)[0], engine.encode("0", add_special_tokens=False)[0]
    for response, result in zip(["4", "5", ""], results, strict=True):
        ids = torch.tensor([engine.encode(f"Q2+2A4R{response}?")])
        with torch.no_grad():
            p = torch.softmax(engine.model(ids).logits[0, -1].double(), -1)
        assert result.score == pytest.approx(float(p[yes] / (p[yes] + p[no])), abs=1e-5)
        assert 0.0 <= result.score <= 1.0
    with pytest.raises(RewardError, match="'Yes' is 3 tokens"):
        JudgeReward(engine, template="{response}", yes="Yes", no="0")


def flaky_cfg(**explorer):
    return run_config_from_dict({"model": {"path": "unused"},
                                 "explorer": {"reward": "tests.reward_plugins:flaky", **explorer}}).explorer


def test_a_reward_that_raises_is_a_verifier_failure_and_none_is_unscored_in_process():
    from rft.rewards.registry import TaskError
    reward = build_reward(flaky_cfg())  # no workers: in this process, failures marked alike
    assert [r.failure for r in reward.score(["a", "b"], task("1", **{"raise": True}))] == ["verifier"] * 2
    assert reward.score(["a"], task("1", none=True)) == [RewardResult(0.0, {}, failure="unscored")]
    assert reward.score(["a"], task("1")) == [RewardResult(0.5)]
    with pytest.raises(TaskError, match="bad_task"):
        reward.score(["a"], task("1", bad_task=True))
    with pytest.raises(RewardError, match="returned failure 'tired'"):
        checked("x", RewardResult(0.0, failure="tired"))


def test_a_weighted_reward_fails_where_a_part_fails():
    cfg = flaky_cfg(reward="weighted", reward_weights={"tests.reward_plugins:flaky": 1.0, "exact_match": 1.0})
    reward = build_reward(cfg)
    assert reward.score(["1"], task("1", **{"raise": True}))[0].failure == "verifier"
    whole = reward.score(["1"], task("1"))[0]
    assert whole.score == 0.75 and not whole.failure


def test_a_reward_that_crashes_on_a_group_fails_every_reply_and_a_bug_stays_loud():
    from rft.workflows.registry import score_group

    class JudgeDown:
        def score(self, responses, task):
            raise ConnectionError("judge engine is gone")

    class Buggy:
        def score(self, responses, task):
            raise RewardError("reward 'buggy' returned score 2.0")

    assert [r.failure for r in score_group(JudgeDown(), ["a", "b"], task("1"))] == ["verifier", "verifier"]
    with pytest.raises(RewardError):
        score_group(Buggy(), ["a"], task("1"))
