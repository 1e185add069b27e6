"""The recording endpoint (rft/workflows/endpoint.py) and the stitching of an episode's calls into samples
(rft/workflows/recording.py), on an in-memory engine of our own protocol that answers scripted texts with a real
chat tokenizer (the tiny character tokenizer with Qwen2.5's template). Calls go through `parse_agent_request`,
`submit` and `pump` in this thread; the HTTP face is tested in tests/integration/test_agent_endpoint_http.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from rft.engine import Completion, Generation, SamplingSettings
from rft.engine.base import TokenizerMixin
from rft.models.tiny import build_tokenizer
from rft.text.chat import encode_messages
from rft.text.openai_api import ApiError
from rft.workflows.agent_requests import EndpointSettings, parse_agent_request
from rft.workflows.endpoint import RecordingEndpoint
from rft.workflows.recording import RecordedCall, branch_sample, episode_branches, state_key
from tests.tool_agent_support import QWEN25_TEMPLATE, tool_call

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate",
                                             "parameters": {"type": "object", "properties": {
                                                 "expression": {"type": "string"}}}}}]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


class ScriptedEngine(TokenizerMixin):
    """Our engine protocol in memory: each prompt's completion is the next scripted text (then `<|im_end|>`), each
    token's log-prob -0.25; it records the prompts and settings it was given."""

    def __init__(self, texts: list[str], *, version: int = 3):
        self.tokenizer = chat_tokenizer()
        self.texts, self.weights_version = list(texts), version
        self.prompts: list[list[int]] = []
        self.settings: list[SamplingSettings] = []

    def generate(self, prompts, sampling):
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            self.settings.append(sampling)
            text = self.texts.pop(0)
            ids = self.encode(text, add_special_tokens=False)[:sampling.max_tokens]
            finish = "length" if len(ids) == sampling.max_tokens else "stop"
            if finish == "stop":
                ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            out.append(Generation(list(prompt), [Completion(ids, [-0.25] * len(ids), self.decode(ids), finish,
                                                            self.weights_version)]))
        return out


SETTINGS = EndpointSettings(max_prompt_len=2000, max_response_len=400, temperature=0.7)


def call(endpoint, engine, episode, body):
    """One call through the endpoint's queue and pump: the response body (ApiError raised)."""
    future = endpoint.submit(episode, parse_agent_request(body, endpoint.settings))
    endpoint.pump(engine, until=future.done)
    return future.result()


def test_a_conversation_with_a_tool_call_is_one_sample_of_the_engines_tokens():
    engine = ScriptedEngine(["Let me compute. " + tool_call("calculator", expression="2+3"), "It is 5."])
    endpoint = RecordingEndpoint(SETTINGS)
    episode = endpoint.open_episode()
    messages = [{"role": "user", "content": "What is 2+3?"}]
    first = call(endpoint, engine, episode, {"messages": messages, "tools": TOOLS, "logprobs": True})
    tokenizer = engine.tokenizer
    assert first["prompt_token_ids"] == encode_messages(tokenizer, messages, tuple(TOOLS))  # the template, once
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me compute."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "calculator", "arguments": json.dumps({"expression": "2+3"})}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert choice["token_ids"] == engine.encode(choice["message"]["content"] + " " + tool_call(
        "calculator", expression="2+3"), add_special_tokens=False) + [im_end]
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.25] * len(choice["token_ids"])
    assert engine.settings[0].temperature == 0.7 and engine.settings[0].max_tokens == 400  # the explorer's default

    # the client sends back the reply as the openai client serialises it, and the tool's result
    messages += [{"role": "assistant", "content": choice["message"]["content"], "refusal": None, "tool_calls": [
        {"id": tc["id"], "type": "function", "function": tc["function"]}]},
                 {"role": "tool", "tool_call_id": tc["id"], "content": "5"}]
    second = call(endpoint, engine, episode, {"messages": messages, "tools": TOOLS, "max_tokens": 50})
    end = first["prompt_token_ids"] + choice["token_ids"]
    added = second["prompt_token_ids"][len(end):]
    assert second["prompt_token_ids"][:len(end)] == end  # extends the first call's tokens exactly
    assert tokenizer.decode(added) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                       "<|im_start|>assistant\n")
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "It is 5."}
    assert engine.settings[1].max_tokens == 50

    calls = endpoint.close_episode(episode)
    (branch,) = episode_branches(calls)
    sample = branch_sample(calls, branch, 0, reward=1.0)
    assert sample.prompt_tokens.tolist() == first["prompt_token_ids"]
    second_ids = second["choices"][0]["token_ids"]
    assert sample.response_tokens.tolist() == choice["token_ids"] + added + second_ids
    assert sample.loss_mask.tolist() == [1] * len(choice["token_ids"]) + [0] * len(added) + [1] * len(second_ids)
    assert sample.logprobs[sample.loss_mask == 0].tolist() == [0.0] * len(added)
    assert np.all(sample.logprobs[sample.loss_mask == 1] == np.float32(-0.25))
    n1 = len(choice["token_ids"])
    assert [(t.start, t.end) for t in sample.turns] == [(0, n1 + len(added)),
                                                        (n1 + len(added), len(sample.response_tokens))]
    assert sample.turns[1].state == state_key(second["prompt_token_ids"])
    with pytest.raises(ApiError) as refused:  # the episode is over
        call(endpoint, engine, episode, {"messages": messages})
    assert refused.value.status == 410


def test_a_rewritten_history_renders_the_conversation_again_and_starts_a_branch():
    engine = ScriptedEngine(["one", "two", "three"])
    endpoint = RecordingEndpoint(SETTINGS)
    episode = endpoint.open_episode()
    messages = [{"role": "user", "content": "hi"}]
    first = call(endpoint, engine, episode, {"messages": messages})
    # compacted: the reply is replaced by a summary, so nothing extends the recorded tokens
    compacted = [{"role": "user", "content": "summary: said one"}, {"role": "user", "content": "go on"}]
    second = call(endpoint, engine, episode, {"messages": compacted})
    assert second["prompt_token_ids"] == encode_messages(engine.tokenizer, compacted)
    # a fork: a second continuation of the first call (a retry with another user turn)
    retry = messages + [{"role": "assistant", "content": "one"}, {"role": "user", "content": "again"}]
    third = call(endpoint, engine, episode, {"messages": retry})
    assert third["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    calls = endpoint.close_episode(episode)
    branches = episode_branches(calls)
    assert [b.calls for b in branches] == [(0, 2), (1,)]  # the first call's branch continues; the rewrite is a root
    samples = [branch_sample(calls, b, k, reward=0.5) for k, b in enumerate(branches)]
    assert samples[1].prompt_tokens.tolist() == second["prompt_token_ids"]
    assert samples[1].response_tokens.tolist() == second["choices"][0]["token_ids"]


def recorded(prompt, completion, version=0):
    return RecordedCall(prompt, completion, [-1.0] * len(completion), "stop", version)


def test_a_fork_trains_each_completion_once():
    calls = [recorded([1, 2], [3, 4]),             # root
             recorded([1, 2, 3, 4, 9], [5]),       # continues it
             recorded([1, 2, 3, 4, 8, 8], [6, 7]),  # forks from the root's end (the branch's tip is call 1)
             recorded([1, 2, 3, 4, 9, 5, 0], [2])]  # continues call 1
    branches = episode_branches(calls)
    assert [(b.calls, sorted(b.trained)) for b in branches] == [((0, 1, 3), [0, 1, 3]), ((0, 2), [2])]
    fork = branch_sample(calls, branches[1], 1, reward=0.0)
    assert fork.prompt_tokens.tolist() == [1, 2]
    assert fork.response_tokens.tolist() == [3, 4, 8, 8, 6, 7]
    assert fork.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]  # the root's completion is trained in the first branch
    assert fork.logprobs.tolist() == [0, 0, 0, 0, -1, -1]
    failed = branch_sample(calls, branches[0], 0, reward=1.0, failure="agent")
    assert failed.failure == "agent" and not failed.scored


def test_limits_refuse_what_its_sample_could_not_hold():
    endpoint = RecordingEndpoint(EndpointSettings(max_prompt_len=120, max_response_len=40, max_calls=2))
    engine = ScriptedEngine(["x" * 5, "y"])
    episode = endpoint.open_episode()
    with pytest.raises(ApiError) as long_prompt:
        call(endpoint, engine, episode, {"messages": [{"role": "user", "content": "a" * 200}]})
    assert long_prompt.value.code == "context_length_exceeded"
    first = call(endpoint, engine, episode, {"messages": [{"role": "user", "content": "a"}]})
    reply = first["choices"][0]["message"]["content"]
    follow = [{"role": "user", "content": "a"}, {"role": "assistant", "content": reply},
              {"role": "user", "content": "b"}]
    second = call(endpoint, engine, episode, {"messages": follow})  # the budget left: 40 - its tokens after the root
    assert engine.settings[1].max_tokens == 40 - (len(second["prompt_token_ids"]) - len(first["prompt_token_ids"]))
    with pytest.raises(ApiError) as limit:
        call(endpoint, engine, episode, {"messages": follow})
    assert limit.value.code == "episode_call_limit"
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "x"}]}, "messages[0]"),
                        ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
                        ({"messages": [{"role": "user", "content": "a"}], "stream": True}, "stream"),
                        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools[0]"),
                        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
                            {"function": {"name": "f", "arguments": "{not json"}}]}]},
                         "messages[0].tool_calls[0]")]:
        with pytest.raises(ApiError) as bad:
            parse_agent_request(body, SETTINGS)
        assert bad.value.status == 400 and bad.value.param == param, body
