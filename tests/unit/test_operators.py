"""Experience operators on known groups: each built-in's decision or shaping checked against a plain computation,
the chain's order and state, and spec errors that name the key."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from rft.config import ConfigError
from rft.experience.operators import OperatorError, build_operator_chain, ngram_repetition, split_drops
from rft.run.loading import run_config_from_dict
from tests.records import make_group


def chain(*specs):
    return build_operator_chain(list(specs))


def test_ngram_repetition_matches_a_counter():
    rng = np.random.default_rng(0)
    for tokens, n in [([1, 2, 3, 1, 2, 3, 1, 2, 3], 3), ([5] * 10, 2), (list(rng.integers(0, 4, 40)), 4), ([1, 2], 4)]:
        grams = collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
        expected = 1 - len(grams) / sum(grams.values()) if grams else 0.0
        assert ngram_repetition(tokens, n) == pytest.approx(expected)
    assert ngram_repetition([1, 2, 3, 1, 2, 3, 1, 2, 3], 3) == pytest.approx(1 - 3 / 7)


def test_zero_variance_drops_only_groups_without_signal():
    ops = chain("zero_variance")
    assert ops.apply(make_group("r", 1, rewards=[1, 1, 1, 1]))[1] == "dropped/zero_variance"
    assert ops.apply(make_group("r", 2, rewards=[0.3]))[1] == "dropped/zero_variance"  # one sample: no baseline
    kept, reason = ops.apply(make_group("r", 3, rewards=[0, 1, 1, 1]))
    assert reason is None and list(kept.rewards) == [0, 1, 1, 1]
    assert chain({"name": "zero_variance", "eps": 0.2}).apply(make_group("r", 4, rewards=[0.5, 0.6]))[1]


def test_length_penalty_is_linear_between_start_and_end():
    lengths = [2, 4, 6, 9, 20]
    group = make_group("r", 1, rewards=[1.0, 0.5, 1.0, 0.0, 1.0], responses=[[7] * n for n in lengths])
    shaped, reason = chain({"name": "length_penalty", "start": 4, "end": 10, "penalty": 0.6}).apply(group)
    expected_penalty = [0.6 * min(1.0, max(0.0, (n - 4) / 6)) for n in lengths]
    assert reason is None and shaped is not group
    np.testing.assert_allclose(shaped.rewards, group.rewards - np.array(expected_penalty))
    penalties = [s.reward_components["length_penalty"] for s in shaped.samples]
    assert penalties == pytest.approx([-p for p in expected_penalty])
    assert [s.reward for s in group.samples] == [1.0, 0.5, 1.0, 0.0, 1.0]  # the input is not changed


def test_response_length_and_repetition_filters_count_failing_samples():
    ok, short, long_ = [3, 4, 5, 6], [3], [3] * 12
    group = make_group("r", 1, responses=[ok, ok, short, ok])
    assert chain({"name": "response_length", "min_tokens": 2}).apply(group)[1] == "dropped/response_length"
    assert chain({"name": "response_length", "min_tokens": 2, "max_fraction": 0.25}).apply(group)[1] is None
    assert chain({"name": "response_length", "max_tokens": 8}).apply(make_group("r", 2, responses=[ok, long_]))[1]
    looping = [1, 2, 3] * 6  # 4-gram repetition 1 - 3/15 = 0.8
    fresh = list(range(10, 28))
    mixed = make_group("r", 3, responses=[looping, fresh, fresh, fresh])
    assert chain("repetition").apply(mixed)[1] == "dropped/repetition"
    assert chain({"name": "repetition", "max_ratio": 0.85}).apply(mixed)[1] is None
    assert chain({"name": "repetition", "max_fraction": 0.3}).apply(mixed)[1] is None


def test_chain_order_first_drop_wins_and_dedup_state_round_trips():
    ops = chain("dedup", "zero_variance", {"name": "length_penalty", "start": 0, "end": 10})
    flat = make_group("r", 1, rewards=[1, 1])
    assert ops.apply(flat)[1] == "dropped/zero_variance"
    assert ops.apply(make_group("r", 1, rewards=[0, 1]))[1] == "dropped/dedup"  # same group id, re-delivered
    assert ops.reasons == ["dropped/dedup", "dropped/zero_variance"]
    state = ops.state()
    assert state == {"0:dedup": {"seen": [flat.group_id]}}
    resumed = chain("dedup", "zero_variance", {"name": "length_penalty", "start": 0, "end": 10})
    resumed.load_state(state)
    assert resumed.apply(make_group("r", 1, rewards=[0, 1]))[1] == "dropped/dedup"
    fresh = chain("zero_variance", "dedup")  # another chain: the saved state does not apply
    fresh.load_state(state)
    assert fresh.apply(make_group("r", 1, rewards=[0, 1]))[1] is None


def test_split_drops_reports_every_reason_of_the_chain():
    ops = chain("zero_variance", "repetition")
    assert split_drops({"stale": 2, "dropped/repetition": 1}, ops) == (
        {"stale": 2}, {"dropped/zero_variance": 0, "dropped/repetition": 1})
    assert split_drops({"stale": 1}, None) == ({"stale": 1}, {})
    assert build_operator_chain([]) is None


@pytest.mark.parametrize("specs,message", [
    (["zero_var"], r"trainer.operators\[0\]: unknown name 'zero_var' \(did you mean 'zero_variance'"),
    ([{"name": "length_penalty", "start": 4}], r"trainer.operators\[0\]: operator 'length_penalty': missing .*'end'"),
    (["dedup", {"name": "length_penalty", "start": 4, "end": 2}], r"trainer.operators\[1\].end: must be > start"),
    ([{"name": "repetition", "max_ratio": "high"}], r"trainer.operators\[0\].max_ratio: expected a number"),
    ([{"name": "zero_variance", "epss": 1}], r"trainer.operators\[0\].epss: unknown argument .*did you mean 'eps'"),
    ([{"name": "format_bonus", "pattern": "("}], r"trainer.operators\[0\].pattern: not a regular expression"),
    ([{"eps": 1}], r"trainer.operators\[0\].name: required"),
    ([{"name": "nowhere.module:factory"}], r"trainer.operators\[0\].name import path 'nowhere.module:factory'"),
    ([3], r"trainer.operators\[0\]: expected an operator name or a mapping"),
])
def test_bad_specs_are_config_errors_naming_the_key(specs, message):
    with pytest.raises(OperatorError, match=message):
        build_operator_chain(specs)
    with pytest.raises(ConfigError, match="<dict>: " + message):
        run_config_from_dict({"model": {"path": "m"}, "trainer": {"operators": specs}})


def shift_rewards(context, amount: float = 0.25):
    """An operator from an import path (used by the test below)."""
    class Shift:
        reason = None

        def apply(self, group):
            import dataclasses
            return dataclasses.replace(group, samples=[dataclasses.replace(s, reward=s.reward + amount)
                                                       for s in group.samples])
    return Shift()


def test_import_path_operator():
    ops = chain({"name": "tests.unit.test_operators:shift_rewards", "amount": 0.5})
    shaped, reason = ops.apply(make_group("r", 1, rewards=[0.0, 0.25]))
    assert reason is None and list(shaped.rewards) == [0.5, 0.75]
