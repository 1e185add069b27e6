"""rft/engine/prefill_once.py's group state machine, driven by hand (its engine, vLLM, runs in
tests/integration/test_engine.py): which requests a group asks for, and the samples it assembles."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rft.engine.base import Completion, Generation, SamplingSettings
from rft.engine.prefill_once import ForkedGroup, prefills_once

SAMPLING = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=5)
END = 99


def group(sampling=SAMPLING) -> ForkedGroup:
    return ForkedGroup("g", [1, 2, 3, 4], sampling, frozenset({END}))


def rest(tokens, version=0) -> Completion:
    return Completion(list(tokens), [-0.5] * len(tokens), "", "length", version, token_versions=[version] * len(tokens))


@pytest.mark.parametrize("prompt_len, sampling, expected", [
    (64, SAMPLING, True),
    (63, SAMPLING, False),  # not whole blocks: vLLM's prefix cache already shares what can be shared
    (64, SamplingSettings(n=1, max_tokens=5), False),
    (64, SamplingSettings(n=4, max_tokens=1), False),
    (64, SamplingSettings(n=4, temperature=0.0, max_tokens=5), False),
    (64, SamplingSettings(n=4, max_tokens=5, stop=("\n",)), False),
])
def test_which_groups_are_prefilled_once(prompt_len, sampling, expected):
    assert prefills_once(prompt_len, sampling, 32) is expected


def test_first_tokens_from_the_probe_and_the_tail_with_their_log_probs():
    g = group()
    [probe] = g.requests()
    assert (probe.request_id, probe.kind, probe.prompt, probe.max_tokens) == ("g/probe", "probe", [1, 2, 3, 4], 1)
    known = {7: math.log(0.5), 8: math.log(0.2), END: math.log(0.1)}  # the tail holds 0.2

    class Draws:  # the sample indices a Generator would draw: token 7, the tail, END, token 8
        def choice(self, k, size, p):
            np.testing.assert_allclose(p, [0.5, 0.2, 0.1, 0.2])
            return np.array([0, 3, 2, 1])

    g.on_probe(known, 3, Draws())
    sent = {r.request_id: r for r in g.requests()}
    assert sorted(sent) == ["g/rest0", "g/rest3", "g/tail1"]
    assert sent["g/rest0"].prompt == [1, 2, 3, 4, 7] and sent["g/rest0"].max_tokens == 4
    assert sent["g/tail1"].exclude == frozenset(known) and sent["g/tail1"].max_tokens == 1
    g.on_tail(1, 42, math.log(0.25), 3)  # a quarter of the tail: 0.05 of the whole
    assert [r.request_id for r in g.requests()] == ["g/rest1"]
    for i in (0, 1, 3):
        g.on_sample(i, rest([5, 6, 7, 8], 3), "rest")
    assert g.complete()
    samples = g.generation(lambda tokens: "-".join(map(str, tokens))).completions
    assert [s.token_ids for s in samples] == [[7, 5, 6, 7, 8], [42, 5, 6, 7, 8], [END], [8, 5, 6, 7, 8]]
    assert [s.logprobs[0] for s in samples] == pytest.approx([math.log(0.5), math.log(0.05), math.log(0.1),
                                                              math.log(0.2)])
    assert samples[2].finish_reason == "stop" and samples[0].text == "7-5-6-7-8"
    assert all(s.token_versions == [3] * len(s.token_ids) for s in samples)


def test_a_tail_drawn_on_another_version_runs_its_sample_whole():
    g = group()
    g.requests()
    g.on_probe({7: math.log(0.5)}, 3, np.random.default_rng(0))
    tails = [r for r in g.requests() if r.kind == "tail"]
    assert tails  # half the mass is in the tail: some of 4 samples fall in it with this seed
    g.on_tail(tails[0].index, 42, -1.0, 4)  # an in-flight load came between the probe and the tail
    [whole] = g.requests()
    assert (whole.kind, whole.prompt, whole.max_tokens) == ("whole", [1, 2, 3, 4], 5)
    g.on_sample(whole.index, rest([9, 9, 9, 9, 9], 4), "whole")
    assert g.samples[whole.index].token_ids == [9] * 5 and g.samples[whole.index].token_versions == [4] * 5


def test_first_token_version_and_the_rests_differ_after_an_in_flight_load():
    g = group(SamplingSettings(n=2, temperature=1.0, max_tokens=3))
    g.requests()
    g.on_probe({7: 0.0}, 3, np.random.default_rng(0))  # all the mass on token 7
    assert [r.kind for r in g.requests()] == ["rest", "rest"]
    g.on_sample(0, rest([5, 6], 4), "rest")
    g.on_sample(1, Completion([5, 6], [-1.0, -1.0], "", "length", 4, token_versions=None), "rest")
    first, second = g.generation(str).completions
    assert first.token_versions == [3, 4, 4] and first.weights_version == 3
    assert second.token_versions is None  # vLLM reported no spans: unknown, not guessed


def test_a_nucleus_wider_than_the_probes_tokens_runs_as_one_ordinary_request():
    g = group(SamplingSettings(n=4, temperature=1.0, top_p=0.9, max_tokens=5))
    g.requests()
    g.on_probe({7: math.log(0.5), 8: -math.inf}, 3, np.random.default_rng(0))  # half the nucleus unseen
    [whole] = g.requests()
    assert (whole.kind, whole.n, whole.max_tokens, whole.prompt) == ("all", 4, 5, [1, 2, 3, 4])
    ordinary = Generation([1, 2, 3, 4], [rest([5]) for _ in range(4)])
    g.on_all(ordinary)
    assert g.complete() and g.generation(str) is ordinary


def test_a_nucleus_inside_the_probes_tokens_draws_no_tail():
    g = group(SamplingSettings(n=64, temperature=1.0, top_p=0.9, max_tokens=5))
    g.requests()
    g.on_probe({7: math.log(0.6), 8: math.log(0.4), 9: -math.inf}, 3, np.random.default_rng(0))
    kinds = {r.kind for r in g.requests()}
    assert kinds == {"rest"} and {t for t, _, _ in g.firsts.values()} == {7, 8}
