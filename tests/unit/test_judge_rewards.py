"""The rubric, ruler and rlcr rewards: their parsing and scoring by hand-computed values, their config checks, and
the judge rewards end to end on the tiny random model as judge (the real engine path, checked against an independent
forward pass or generation)."""
from __future__ import annotations

import math

import pytest
import torch

from rft.config import ConfigError
from rft.engine import Generation, SamplingSettings, TransformersEngine
from rft.engine.base import Completion
from rft.rewards import RewardContext, RewardError, build_reward
from rft.rewards.registry import TaskError
from rft.rewards.rlcr import RlcrReward, parse_confidence, rlcr_value
from rft.rewards.rubric import MAX_CRITERIA, RubricReward, parse_rubric, rubric_score
from rft.rewards.ruler import RulerReward, parse_scores, ranks
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.workflows import build_workflow


def task(answer=None, **metadata) -> TaskRecord:
    return TaskRecord(run_id="r", task_id="t", epoch=0, prompt="2+2", answer=answer, metadata=metadata)


def cfg(model_path="unused", **explorer):
    return run_config_from_dict({"model": {"path": str(model_path), "max_prompt_len": 400, "max_response_len": 64},
                                 "explorer": {"engine": "transformers", **explorer}})


@pytest.fixture(scope="module")
def judge(tiny_model):
    return TransformersEngine(tiny_model, seed=0)


def next_token_p(engine, text: str, yes: str = "1", no: str = "0") -> float:
    """P(yes) / (P(yes) + P(no)) of the next token after `text`, from an independent forward pass."""
    ids = torch.tensor([engine.encode(text)])
    with torch.no_grad():
        p = torch.softmax(engine.model(ids).logits[0, -1].double(), -1)
    y, n = engine.encode(yes, add_special_tokens=False)[0], engine.encode(no, add_special_tokens=False)[0]
    return float(p[y] / (p[y] + p[n]))


# --------------------------------------------------------------------------------------------------------------
# rubric


def test_rubric_parsing_accepts_both_names_a_mapping_and_a_default_weight():
    criteria = parse_rubric([{"criterion": "a", "weight": 2}, {"description": "b"}, {"criterion": "c", "weight": -1}],
                            where="metadata.rubric")
    assert [(c.text, c.weight) for c in criteria] == [("a", 2.0), ("b", 1.0), ("c", -1.0)]
    assert [(c.text, c.weight) for c in parse_rubric({"x": 0.5}, where="d")] == [("x", 0.5)]


@pytest.mark.parametrize("raw,message", [
    ([], "non-empty list"), ("be nice", "non-empty list"), (None, "non-empty list"),
    ([{"weight": 1}], r"metadata.rubric\[0\]: needs a non-empty 'criterion'"),
    ([{"criterion": "  "}], r"\[0\]: needs a non-empty"), (["text"], r"\[0\]: needs"),
    ([{"criterion": "a", "weight": True}], r"\[0\].weight: must be a finite number"),
    ([{"criterion": "a", "weight": float("nan")}], "finite"), ([{"criterion": "a", "weight": "2"}], "finite"),
    ([{"criterion": "a", "weight": 0}], "must not all be 0"),
    ([{"criterion": str(i)} for i in range(MAX_CRITERIA + 1)], "over the limit"),
])
def test_rubric_parsing_rejects_bad_rubrics_naming_the_item(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_rubric(raw, where="metadata.rubric")


@pytest.mark.parametrize("weights,verdicts,expected", [
    ([1, 1], [1, 0], 0.5),
    ([3, 1], [1, 0], 0.75),
    ([3, 1], [0.5, 1], (1.5 + 1) / 4),
    ([2, -1], [1, 0], 1.0),          # met the criterion, avoided the pitfall
    ([2, -1], [1, 1], 2 / 3),        # (2 - 1 + 1) / 3
    ([2, -1], [0, 1], 0.0),          # the worst case
    ([2, -1], [0, 0], 1 / 3),
    ([0, 4], [0, 0.25], 0.25),
])
def test_rubric_score_is_the_normalised_weighted_fraction_met(weights, verdicts, expected):
    assert rubric_score(weights, verdicts) == pytest.approx(expected)


def test_rubric_reward_is_the_weighted_mean_of_the_judges_yes_probabilities(judge):
    reward = RubricReward(judge, template="Q{prompt}R{response}C{criterion}?", yes="1", no="0")
    rubric = [{"criterion": "short", "weight": 3.0}, {"criterion": "has 4", "weight": 1.0}]
    results = reward.score(["4", "5 apples", ""], task(rubric=rubric))
    for response, result in zip(["4", "5 apples", ""], results, strict=True):
        p = [next_token_p(judge, f"Q2+2R{response}C{c}?") for c in ("short", "has 4")]
        assert result.components["criterion.0"] == pytest.approx(p[0], abs=1e-5)
        assert result.components["criterion.1"] == pytest.approx(p[1], abs=1e-5)
        assert result.components["judge_success"] == 1.0
        assert result.score == pytest.approx((3 * p[0] + p[1]) / 4, abs=1e-5)


def test_rubric_default_applies_without_metadata_and_a_task_without_either_is_a_task_error(judge):
    reward = RubricReward(judge, template="{response}{criterion}", yes="1", no="0", default={"polite": 1.0})
    [result] = reward.score(["ok"], task())
    assert result.score == pytest.approx(next_token_p(judge, "okpolite"), abs=1e-5)
    bare = RubricReward(judge, template="{response}{criterion}", yes="1", no="0")
    with pytest.raises(TaskError, match="no metadata.rubric and no explorer.rubric_default"):
        bare.score(["ok"], task())
    with pytest.raises(TaskError, match=r"metadata.rubric\[0\].weight"):
        reward.score(["ok"], task(rubric=[{"criterion": "a", "weight": "heavy"}]))


class _NoVerdictEngine:
    """An in-memory Engine (our protocol) whose judge puts no probability on either token."""
    def encode(self, text, *, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def next_token_probs(self, prompts, candidates):
        return [[0.0, 0.0] for _ in prompts]


def test_a_missing_verdict_is_named_not_silent():
    reward = RubricReward(_NoVerdictEngine(), template="{criterion}", yes="1", no="0")  # type: ignore[arg-type]
    [result] = reward.score(["x"], task(rubric=[{"criterion": "a"}]))
    assert result.score == 0.0 and result.components["judge_success"] == 0.0


# --------------------------------------------------------------------------------------------------------------
# ruler


@pytest.mark.parametrize("text,n,expected", [
    ("Response 2 is best.\n[0.2, 1, 0.5]", 3, [0.2, 1.0, 0.5]),
    ("first guess [0.1, 0.1] then final: [0.3, 0.9]", 2, [0.3, 0.9]),    # the last list wins
    ("[1.5, -0.2]", 2, [1.0, 0.0]),                                      # clipped to [0, 1]
    ("[0.5, 0.5] and a trailing note", 2, [0.5, 0.5]),
    ("[0.2, 0.3]", 3, None),                                             # wrong length
    ("[NaN, 0.3]", 2, None), ("[Infinity, 1]", 2, None),                 # json accepts them; not finite
    ("[true, 0]", 2, None), ('["0.5", 1]', 2, None), ("[0.5, oops]", 2, None),
    ("no list at all", 1, None), ("", 1, None), ("[0.5", 1, None), ("[]", 1, None),
    ("[[0.5], [0.7]]", 2, None),
])
def test_ruler_parses_the_last_json_list_of_n_finite_scores(text, n, expected):
    assert parse_scores(text, n) == expected


def test_ranks_best_first_and_ties_share_the_better_place():
    assert ranks([0.2, 0.9, 0.5, 0.9]) == [3, 0, 2, 0]


class _ScriptedJudge:
    """An in-memory Engine (our protocol) whose judge writes `reply` for any prompt, recording the prompts."""
    def __init__(self, reply: str):
        self.reply, self.prompts = reply, []

    def encode(self, text, *, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def generate(self, prompts, sampling):
        self.prompts.extend(self.decode(p) for p in prompts)
        assert sampling.temperature == 0 and sampling.n == 1
        return [Generation(list(p), [Completion([], [], self.reply, "stop", 0)]) for p in prompts]


def test_ruler_scores_the_group_from_one_judgement_and_names_a_malformed_one():
    judge = _ScriptedJudge("thinking... [0.1, 0.9, 0.4]")
    reward = RulerReward(judge, template="{prompt}|{n}|{responses}", max_tokens=8,  # type: ignore[arg-type]
                         max_prompt_tokens=1000)
    results = reward.score(["a", "b", "c"], task())
    assert judge.prompts == ["2+2|3|Response 1:\na\n\nResponse 2:\nb\n\nResponse 3:\nc"]
    assert [r.score for r in results] == [0.1, 0.9, 0.4]
    assert [r.components for r in results] == [{"judge_success": 1.0, "rank": 2.0},
                                               {"judge_success": 1.0, "rank": 0.0},
                                               {"judge_success": 1.0, "rank": 1.0}]
    judge.reply = "[0.1, 0.9]"  # two scores for three responses
    assert [(r.score, r.components) for r in reward.score(["a", "b", "c"], task())] == [
        (0.0, {"judge_success": 0.0})] * 3


def test_ruler_cuts_each_response_to_fit_keeping_its_end_or_fails_when_nothing_fits():
    judge = _ScriptedJudge("[1, 0]")
    reward = RulerReward(judge, template="{prompt}:{responses}", max_tokens=8,  # type: ignore[arg-type]
                         max_prompt_tokens=80)
    long = "x" * 100 + "ANSWER"
    assert [r.score for r in reward.score([long, "short"], task())] == [1.0, 0.0]
    [prompt] = judge.prompts
    assert len(prompt) <= 80 and "ANSWER" in prompt and "short" in prompt and prompt.startswith("2+2:")
    tight = RulerReward(judge, template="{prompt}:{responses}", max_tokens=8,  # type: ignore[arg-type]
                        max_prompt_tokens=30)
    assert [r.components["judge_success"] for r in tight.score(["a", "b"], task())] == [0.0, 0.0]
    assert len(judge.prompts) == 1  # the judge was not asked
    with pytest.raises(RewardError, match="explorer.ruler_max_tokens: 8 leaves no room"):
        RulerReward(judge, template="", max_tokens=8, max_prompt_tokens=0)  # type: ignore[arg-type]


def test_ruler_on_the_tiny_judge_reports_what_its_greedy_reply_parses_to(judge):
    reward = RulerReward(judge, template="Q:{prompt} {responses} scores:", max_tokens=24, max_prompt_tokens=200)
    responses = ["4", "5", "four"]
    results = reward.score(responses, task("4"))
    prompt = reward.judge_prompt(responses, task("4"))
    assert prompt == judge.encode("Q:2+2 Response 1:\n4\n\nResponse 2:\n5\n\nResponse 3:\nfour scores:")
    # an independent greedy generation of the same prompt says what the reward must have read
    with torch.no_grad():
        out = judge.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                   pad_token_id=judge.tokenizer.pad_token_id)
    expected = parse_scores(judge.decode(out[0, len(prompt):].tolist()), 3)  # special tokens (EOS, padding) dropped
    assert [r.score for r in results] == (expected or [0.0] * 3)
    assert {r.components["judge_success"] for r in results} == {float(expected is not None)}


# --------------------------------------------------------------------------------------------------------------
# rlcr


@pytest.mark.parametrize("response,expected", [
    ("<answer>4</answer><confidence>0.8</confidence>", 0.8),
    ("<confidence> 1 </confidence>", 1.0), ("<confidence>0</confidence>", 0.0),
    ("<confidence>0.3</confidence> then <confidence>0.6</confidence>", 0.6),   # the last block
    ("<confidence>80</confidence>", None), ("<confidence>-0.1</confidence>", None),
    ("<confidence>nan</confidence>", None), ("<confidence>inf</confidence>", None),
    ("<confidence>high</confidence>", None), ("<confidence></confidence>", None),
    ("<confidence>0.5", None), ("confidence: 0.9", None), ("", None),
])
def test_rlcr_confidence_parsing(response, expected):
    assert parse_confidence(response) == expected


@pytest.mark.parametrize("correct,confidence,expected", [
    (1.0, 1.0, 1.0), (1.0, 0.8, 1 - 0.04), (1.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.3, -0.09), (0.0, 1.0, -1.0),
    (1.0, None, -1.0), (0.0, None, -1.0),
])
def test_rlcr_value_is_correctness_minus_the_brier_term(correct, confidence, expected):
    assert rlcr_value(correct, confidence) == pytest.approx(expected)


def test_rlcr_reward_maps_r_into_the_reward_range_and_keeps_its_parts():
    reward = build_reward(cfg(reward="rlcr").explorer)  # the default verifier: math
    right, wrong, unsure, silent = reward.score(
        ["<answer>4</answer><confidence>0.8</confidence>", "<answer>5</answer><confidence>0.8</confidence>",
         "<answer>4</answer><confidence>0.5</confidence>", "<answer>4</answer>"], task("4"))
    assert right.score == pytest.approx((1 + 0.96) / 2) and right.components["rlcr"] == pytest.approx(0.96)
    assert wrong.score == pytest.approx((1 - 0.64) / 2) and wrong.components["correct"] == 0.0
    assert unsure.components["brier"] == pytest.approx(0.25)
    assert silent.score == 0.0 and silent.components["confidence_parsed"] == 0.0
    assert silent.components["correct"] == 1.0 and silent.components["math.parsed"] == 1.0
    exact = build_reward(cfg(reward="rlcr", rlcr_verifier="exact_match").explorer)
    [result] = exact.score(["4<confidence>1</confidence>"], task("4<confidence>1</confidence>"))
    assert result.score == 1.0


def test_rlcr_never_raises_on_malformed_output():
    reward = RlcrReward("math")
    junk = ["", "\x00\xff", "<confidence>", "<confidence>" * 50, "<confidence>1e999</confidence>", "9" * 3000]
    for result in reward.score(junk, task("4")):
        assert 0.0 <= result.score <= 1.0 and math.isfinite(result.score)


# --------------------------------------------------------------------------------------------------------------
# configuration, and the judge rewards built from it on the tiny judge


@pytest.mark.parametrize("explorer,message", [
    ({"reward": "rubric"}, "explorer.judge_model: the rubric reward needs a judge model"),
    ({"reward": "ruler"}, "explorer.judge_model: the ruler reward needs a judge model"),
    ({"reward": "weighted", "reward_weights": {"math": 1, "ruler": 1}}, "explorer.judge_model: the ruler reward"),
    ({"reward": "rubric", "judge_model": "j", "rubric_template": "{response} {rubric}"},
     r"explorer.rubric_template: invalid template \(KeyError: 'rubric'\)"),
    ({"reward": "ruler", "judge_model": "j", "ruler_template": "{responses"}, "explorer.ruler_template: invalid"),
    ({"reward": "judge", "judge_model": "j", "judge_template": "{criterion}"}, "explorer.judge_template: invalid"),
    ({"reward": "rubric", "judge_model": "j", "rubric_default": {"a": 0.0}}, "explorer.rubric_default: the weights"),
    ({"reward": "rlcr", "rlcr_verifier": "mth"}, "explorer.rlcr_verifier: unknown reward 'mth' .*did you mean 'math'"),
    ({"reward": "rlcr", "rlcr_verifier": "judge"}, "explorer.rlcr_verifier: 'judge' is a stateful reward"),
    ({"reward": "rlcr", "rlcr_verifier": "rlcr"}, "explorer.rlcr_verifier: 'rlcr' is a stateful reward"),
    ({"reward": "rubric", "judge_model": "j", "ruler_max_tokens": 0}, "explorer.ruler_max_tokens"),
])
def test_bad_judge_reward_config_fails_at_load_naming_the_key(explorer, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**explorer)


def test_judge_rewards_built_from_the_config_run_on_the_tiny_judge_through_the_workflow(tiny_model):
    judged = {"judge_model": str(tiny_model), "judge_yes": "1", "judge_no": "0", "n_samples": 3, "max_tokens": 4,
              "temperature": 1.0}
    rubric_cfg = cfg(tiny_model, reward="rubric", rubric_template="{prompt}{response}{criterion}?", **judged)
    context = RewardContext.for_run(rubric_cfg)
    rubric = build_reward(rubric_cfg.explorer, context)
    policy = TransformersEngine(tiny_model, seed=1)
    t = TaskRecord("r", "t0", 0, "2+2=", "4", {"rubric": [{"criterion": "a", "weight": 1}, {"criterion": "b"}]})
    [group] = build_workflow(rubric_cfg.explorer, rubric_cfg.model, rubric).explore([t], policy)
    assert group.error is None and len(group.samples) == 3
    for s in group.samples:
        text = policy.decode(s.response_tokens)
        p = [next_token_p(rubric.judge.engine, f"2+2={text}{c}?") for c in "ab"]
        assert s.reward == pytest.approx(sum(p) / 2, abs=1e-5) and s.reward_components["judge_success"] == 1.0

    ruler_cfg = cfg(tiny_model, reward="ruler", ruler_template="{prompt}{responses}:", ruler_max_tokens=16, **judged)
    ruler = build_reward(ruler_cfg.explorer, RewardContext.for_run(ruler_cfg))
    assert isinstance(ruler, RulerReward) and ruler.max_prompt_tokens == 400 + 64 - 16
    [group] = build_workflow(ruler_cfg.explorer, ruler_cfg.model, ruler).explore([t], policy)
    texts = [policy.decode(s.response_tokens) for s in group.samples]
    judge = ruler.engine
    prompt = ruler.judge_prompt(texts, t)
    assert prompt is not None
    [generation] = judge.generate([prompt], SamplingSettings(n=1, temperature=0.0, max_tokens=16))
    expected = parse_scores(generation.completions[0].text, 3)
    assert [s.reward for s in group.samples] == (expected or [0.0] * 3)
    assert {s.reward_components["judge_success"] for s in group.samples} == {float(expected is not None)}
