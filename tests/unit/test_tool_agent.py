"""tool_agent's chat rendering and episodes on a real (HF transformers) engine: prompts with tools as Qwen2.5's
template renders them, the documented fallback for a template without tool support (SmolLM2's), tool turns as the
template renders them after the assistant's end-of-turn token, and an episode with two tool calls, one of them bad.
The first assistant turn is scripted (tests/tool_agent_support.py says why); the tool and the following sampled
turn are real, and sampled tokens are checked against an independent forward pass."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rft.agent_tools import ToolBox, ToolLimits
from rft.engine import TransformersEngine
from rft.rewards import build_reward, resolve
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.text.chat import TOOLS_FALLBACK, ChatPrompt, encode_messages, renders_tools, tool_turn_text
from rft.workflows import WorkflowError, build_workflow
from tests.tool_agent_support import SMOLLM2_TEMPLATE, make_chat_model, tool_call

TOOLS = tuple(ToolBox(["calculator", "python"], ToolLimits(sandbox="none")).schemas)  # built, not run: no bwrap probe


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("models") / "tool-qwen")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("models") / "tool-smol", SMOLLM2_TEMPLATE)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_tools_rendered_by_the_template_or_the_fallback(qwen, smol):
    messages = ChatPrompt("Be brief.", TOOLS).messages("What is 2 + 3?")
    q = AutoTokenizer.from_pretrained(qwen)
    assert renders_tools(q)
    ids = encode_messages(q, messages, TOOLS)
    expected = q.apply_chat_template(messages, tools=list(TOOLS), add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"])
    assert '"name": "calculator"' in render(q, messages, tools=list(TOOLS), add_generation_prompt=True)
    s = AutoTokenizer.from_pretrained(smol)
    assert not renders_tools(s)  # SmolLM2's template ignores tools=
    fallback = [{"role": "system", "content": "Be brief.\n\n" + TOOLS_FALLBACK.format(
        tools="\n".join(json.dumps(t) for t in TOOLS))}, messages[1]]
    assert encode_messages(s, messages, TOOLS) == list(
        s.apply_chat_template(fallback, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert "<tool_call>" in fallback[0]["content"] and '"name": "python"' in fallback[0]["content"]


def test_tool_turn_text_is_the_template_rendering_after_end_of_turn(qwen, smol):
    results = [{"role": "tool", "name": "calculator", "content": "5"},
               {"role": "tool", "name": "python", "content": "error: timed out after 5 s"}]
    q = AutoTokenizer.from_pretrained(qwen)
    messages = ChatPrompt("", TOOLS).messages("q")
    assert tool_turn_text(q, messages, results, TOOLS) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
                                                           "<tool_response>\nerror: timed out after 5 s\n"
                                                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    s = AutoTokenizer.from_pretrained(smol)
    assert tool_turn_text(s, messages, results[:1], TOOLS) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_episode_with_tool_calls(qwen):
    cfg = run_config_from_dict({
        "model": {"path": str(qwen), "chat_template": True, "max_prompt_len": 1100, "max_response_len": 300},
        # only the calculator runs here: the python tool is built without its sandbox, whose check starts a process
        "explorer": {"engine": "transformers", "workflow": "tests.tool_agent_support:ForcedFirstTurn",
                     "python_sandbox": "none",
                     "reward": "exact_match", "n_samples": 2, "max_tokens": 12, "max_turns": 2,
                     "temperature": 0.8}})
    engine = TransformersEngine(qwen, seed=0, chat_template=True, weights_version=4)
    forced = tool_call("calculator", expression="(3 + 4) * 12") + tool_call("nope")
    task = TaskRecord("r", "t", 0, "What is (3 + 4) * 12?", "84", {"forced_turn": forced})
    [result] = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore([task], engine)
    tok = engine.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    forced_ids = tok(forced, add_special_tokens=False)["input_ids"] + [end]
    conversation = ChatPrompt("", TOOLS).messages(task.prompt) + [
        {"role": "assistant", "content": "x"}, {"role": "tool", "content": str((3 + 4) * 12)},
        {"role": "tool", "content": "error: unknown tool 'nope' (tools: calculator, python)"}]
    tool_ids = tok(render(tok, conversation, tools=list(TOOLS), add_generation_prompt=True).split(
        "x<|im_end|>", 1)[1], add_special_tokens=False)["input_ids"]
    assert result.error is None and result.policy_version == 4 and len(result.samples) == 2
    for s in result.samples:
        head = len(forced_ids) + len(tool_ids)
        assert s.response_tokens[:head].tolist() == forced_ids + tool_ids
        assert s.loss_mask[:head].tolist() == [0] * head and not s.logprobs[:head].any()
        final = s.response_tokens[head:].tolist()
        assert 1 <= len(final) <= 12 and s.loss_mask[head:].tolist() == [1] * len(final)
        ids = torch.tensor([s.prompt_tokens.tolist() + s.response_tokens.tolist()])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(s.prompt_tokens) + head - 1:-1] / 0.8
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(final)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(s.logprobs[head:], ref, atol=1e-4)
        assert s.reward == resolve("exact_match")[1](tok.decode(final, skip_special_tokens=True), task).score
        assert s.reward_components["turns"] == 2.0


def test_tool_agent_needs_the_chat_template(qwen):
    cfg = run_config_from_dict({"model": {"path": str(qwen)}, "explorer": {
        "engine": "transformers", "workflow": "tool_agent", "python_sandbox": "none"}})
    with pytest.raises(WorkflowError, match="model.chat_template: the tool_agent workflow"):
        build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))


def test_a_sandbox_that_refuses_fails_the_episode_as_sandbox(qwen):
    cfg = run_config_from_dict({
        "model": {"path": str(qwen), "chat_template": True, "max_prompt_len": 1100, "max_response_len": 300},
        "explorer": {"engine": "transformers", "workflow": "tests.tool_agent_support:ForcedFirstTurn",
                     "tools": ["calculator", "tests.tool_agent_support:RefusingSandbox"], "reward": "exact_match",
                     "n_samples": 2, "max_tokens": 4, "max_turns": 2}})
    engine = TransformersEngine(qwen, seed=0, chat_template=True, weights_version=1)
    task = TaskRecord("r", "t", 0, "Run it", "1", {"forced_turn": tool_call("refused", code="print(1)")})
    [result] = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore([task], engine)
    assert result.error is None and [s.failure for s in result.samples] == ["sandbox", "sandbox"]
