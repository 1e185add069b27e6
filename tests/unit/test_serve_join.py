"""Serve mode's logic without a broker: the joiner's rules (groups of a request, of a prompt, the baseline window,
expiry, duplicate / late / early feedback, the offsets it holds), the server's feedback ledger and request parsing,
and the round trip of the two new record types."""
from __future__ import annotations

import numpy as np
import pytest

from rft.schema import Feedback, RecordError, ServedChoice, ServedCompletion, decode, decode_served, encode
from rft.serve.config import ServeConfig
from rft.serve.joiner import Joining
from rft.serve.ledger import FeedbackLedger, FeedbackRefused
from rft.serve.requests import ApiError, parse_chat_request

T0 = 1_000_000.0
SETTINGS = ServeConfig(feedback_expire_s=100, group_size=3, group_wait_s=10, baseline_window=4)


def served(rid: str, n: int = 1, prompt: str = "p", at: float = T0, version: int = 0) -> ServedCompletion:
    choices = [ServedChoice(i, np.array([5 + i, 6], dtype=np.int32), np.array([-0.5, -0.25], dtype=np.float32), "stop")
               for i in range(n)]
    return ServedCompletion(run_id="r", request_id=rid, prompt_key=prompt, prompt_tokens=np.array([1, 2, 3], np.int32),
                            choices=choices, policy_version=version, created_at=at, finished_at=at + 1)


def fb(rid: str, reward: float, index: int = 0, at: float = T0 + 1) -> Feedback:
    return Feedback(run_id="r", request_id=rid, reward=reward, index=index, components={"app": 1.0}, created_at=at)


class Offsets:
    """Positions on one served and one feedback partition, in arrival order."""
    def __init__(self):
        self.next = {"s:0": 0, "f:0": 0}

    def __call__(self, key: str) -> tuple[str, int]:
        offset = self.next[key]
        self.next[key] += 1
        return key, offset


def ids(group) -> list[str]:
    return group.metadata["completions"]


def test_records_round_trip_and_reject_bad_values():
    s = served("a", n=2)
    assert decode(*encode(s)) == s
    f = fb("a", 0.5, index=1)
    assert decode(*encode(f)) == f
    value, headers = encode(ServedCompletion(**{**s.__dict__, "choices": [s.choices[1]]}))
    with pytest.raises(RecordError, match="indices"):
        decode_served(value, headers)
    value, headers = encode(Feedback(run_id="r", request_id="a", reward=float("nan")))
    with pytest.raises(RecordError, match="NaN"):
        decode(value, headers)


def test_a_request_with_n_choices_is_one_group_once_every_choice_is_rewarded():
    j, at = Joining(SETTINGS, "r"), Offsets()
    j.add_served(served("a", n=3, version=2), at("s:0"))
    j.add_feedback(fb("a", 1.0, 0), at("f:0"))
    j.add_feedback(fb("a", 0.0, 2), at("f:0"))
    assert j.tick(T0 + 2) == []
    assert j.held() == {"s:0": 0, "f:0": 0}
    j.add_feedback(fb("a", 0.5, 1), at("f:0"))
    [group] = j.tick(T0 + 2)
    assert group.group_id == "r/serve/a" and group.policy_version == 2
    assert [s.reward for s in group.samples] == [1.0, 0.5, 0.0]
    assert ids(group) == ["a/0", "a/1", "a/2"]
    assert group.samples[0].reward_components == {"app": 1.0, "feedback": 1.0}
    assert j.held() == {} and j.commit_offsets({"s:0": 1, "f:0": 3}) == {"s:0": 1, "f:0": 3}


def test_singles_of_one_prompt_form_a_group_and_others_meet_in_the_baseline_window():
    j, at = Joining(SETTINGS, "r"), Offsets()
    for i, reward in enumerate([1.0, 0.0, 1.0]):
        j.add_served(served(f"p{i}", prompt="P"), at("s:0"))
        j.add_feedback(fb(f"p{i}", reward), at("f:0"))
    [group] = j.tick(T0 + 2)
    assert group.metadata["kind"] == "prompt" and [s.reward for s in group.samples] == [1.0, 0.0, 1.0]
    # two singles of other prompts: one with history (prompt P, mean 2/3), one without (falls back to every prompt)
    j.add_served(served("q", prompt="P"), at("s:0"))
    j.add_feedback(fb("q", 1.0, at=T0 + 3), at("f:0"))
    j.add_served(served("x", prompt="X"), at("s:0"))
    j.add_feedback(fb("x", 0.0, at=T0 + 3), at("f:0"))
    assert j.tick(T0 + 5) == []  # waiting for peers of their prompts
    assert j.held() == {"s:0": 3, "f:0": 3}
    assert j.tick(T0 + 14) == []  # moved to the window at T0 + 14: it waits there too
    [window] = j.tick(T0 + 24)
    assert window.metadata["kind"] == "window" and ids(window) == ["q/0", "x/0"]
    q, x = window.samples
    assert q.reward_components["baseline"] == pytest.approx(2 / 3) and q.reward == pytest.approx(1 - 2 / 3)
    assert x.reward_components["baseline"] == pytest.approx(3 / 4)  # rewards so far of every prompt: 1, 0, 1, 1
    assert x.reward == pytest.approx(-0.75) and x.reward_components["feedback"] == 0.0


def test_expiry_duplicates_and_feedback_before_its_completion():
    j, at = Joining(SETTINGS, "r"), Offsets()
    j.add_feedback(fb("early", 1.0), at("f:0"))  # its served record comes later (another topic)
    assert j.held() == {"f:0": 0}
    j.add_served(served("early"), at("s:0"))
    j.add_served(served("never", at=T0), at("s:0"))
    j.add_served(served("part", n=2), at("s:0"))
    j.add_feedback(fb("part", 0.3, 1), at("f:0"))
    j.add_feedback(fb("part", 0.9, 1), at("f:0"))  # a second reward for the same choice
    j.add_feedback(fb("late", 1.0, at=T0 + 50), at("f:0"))
    groups = j.tick(T0 + 101)  # past feedback_expire_s for every served one
    assert sorted(g.group_id for g in groups) == ["r/serve/part"] and ids(groups[0]) == ["part/1"]
    assert j.counts["expired"] == 2 and j.counts["feedback_duplicate"] == 1  # never/0 and part/0
    assert [i.served.request_id for i in j.window] == ["early"]  # joined once its served record came
    j.add_feedback(fb("never", 1.0, at=T0 + 120), at("f:0"))
    assert j.counts["feedback_for_done"] == 1
    j.tick(T0 + 151)
    assert j.counts["feedback_unknown"] == 1  # "late": no completion ever came
    # a re-read served record whose choices were emitted (a restart) is skipped
    restarted = Joining(SETTINGS, "r", done=["part/0", "part/1"])
    restarted.add_served(served("part", n=2), ("s:0", 2))
    assert restarted.counts["served_again"] == 1 and restarted.pending == {}
    # done ids are forgotten 2 x feedback_expire_s after their request was served: memory stays bounded
    assert "never/0" in j.done
    j.tick(T0 + 201)
    assert "never/0" not in j.done and "part/1" not in j.done


def test_a_reward_after_the_expiry_time_is_not_joined():
    j = Joining(SETTINGS, "r")
    j.add_served(served("a"), ("s:0", 0))
    j.add_feedback(fb("a", 1.0, at=T0 + 101), ("f:0", 0))
    assert j.counts["feedback_late"] == 1 and j.singles == {}


def test_the_ledger_refuses_unknown_expired_repeated_and_bad_index_feedback():
    now = [T0]
    ledger = FeedbackLedger(100, clock=lambda: now[0])
    ledger.served("a", 2, T0)
    ledger.reserve([("a", 0)])
    for items, status, code in [([("b", 0)], 404, "unknown_id"), ([("a", 2)], 400, "invalid_index"),
                                ([("a", 0)], 409, "already_rewarded"), ([("a", 1), ("a", 1)], 409, "already_rewarded")]:
        with pytest.raises(FeedbackRefused) as refused:
            ledger.reserve(items)
        assert (refused.value.status, refused.value.code) == (status, code)
    ledger.reserve([("a", 1)])  # the refused batch marked nothing
    ledger.release([("a", 1)])
    now[0] = T0 + 101
    with pytest.raises(FeedbackRefused) as refused:
        ledger.reserve([("a", 1)])
    assert refused.value.status == 410


@pytest.mark.parametrize("body, status, param", [
    ({"model": "m"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
def test_bad_requests_name_the_field(body, status, param):
    with pytest.raises(ApiError) as refused:
        parse_chat_request(body, model_name="m", max_tokens=16)
    assert refused.value.status == status and refused.value.param == param


def test_a_request_becomes_sampling_settings():
    r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                            "n": 3, "temperature": 0, "stop": "x", "max_completion_tokens": 5, "stream": True},
                           model_name="m", max_tokens=16)
    assert r.messages == [{"role": "user", "content": "hi"}] and r.stream
    assert (r.sampling.n, r.sampling.temperature, r.sampling.max_tokens, r.sampling.stop) == (3, 0.0, 5, ("x",))
