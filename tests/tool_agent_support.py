"""Shared by the tool_agent tests: a tiny chat model with a real tool-calling chat template, and `ForcedFirstTurn`,
the tool_agent workflow with a scripted first assistant turn.

Why the first turn is forced: the tiny random model never writes a valid `<tool_call>` block by itself, and
fine-tuning it to do so on this CPU took minutes (a tool prompt is ~950 tokens of a character tokenizer). So a
task may carry `metadata.forced_turn`, the text of its first assistant turn: it is appended (with the template's
end-of-turn token) as tokens the policy did not sample, loss_mask 0 and log-prob 0, and parsed and answered like
any model turn. Everything after it is real: the tools run, their results are rendered by the chat template, and
the engine samples the following turns (loss_mask 1, behaviour log-probs). Tasks without `forced_turn` are
sampled from the first token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trl
from transformers import AutoTokenizer

from rft.agent_tools import SandboxError
from rft.agent_tools.registry import function_schema
from rft.models.tiny import build_tokenizer, make_tiny_model
from rft.text.chat import end_of_turn_id
from rft.workflows.tool_agent import ToolAgent

QWEN25_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")  # SmolLM2-135M-Instruct's template: it ignores tools


def make_chat_model(path: Path, template: str = QWEN25_TEMPLATE) -> Path:
    """The tiny model (room for 2048 positions) with the two ChatML special tokens and `template`."""
    make_tiny_model(path, vocab_size=build_tokenizer().get_vocab_size() + 2, tie_word_embeddings=False,
                    max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def tool_call(name: str, **arguments: Any) -> str:
    """A Hermes / Qwen2.5 tool-call block."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class ForcedFirstTurn(ToolAgent):
    """tool_agent whose first assistant turn is `task.metadata["forced_turn"]` when a task has one (module
    docstring)."""

    def _model_turn(self, episodes, engine) -> None:
        forced = [e for e in episodes if e.turns == 0 and e.environment.task.metadata.get("forced_turn")]
        sampled = [e for e in episodes if e not in forced]
        for e in forced:
            ids = engine.encode(e.environment.task.metadata["forced_turn"], add_special_tokens=False)
            ids.append(end_of_turn_id(engine.tokenizer))
            e.add_environment_turn(ids)  # not sampled from the policy: loss_mask 0, log-prob 0
            e.last_text, e.finish_reason, e.turns = engine.decode(ids), "stop", 1
            e.versions.append(engine.weights_version)
        if sampled:
            super()._model_turn(sampled, engine)


class RefusingSandbox:
    """A tool whose sandbox cannot be set up (every call raises SandboxError). Named in configs as
    `tests.tool_agent_support:RefusingSandbox`."""

    schema = function_schema("refused", "A tool whose sandbox refuses every call.", code="a program")

    def __init__(self, limits: Any):
        self.limits = limits

    def __call__(self, arguments: dict[str, Any]) -> str:
        raise SandboxError("refused: bwrap: Creating new namespace failed: Operation not permitted")
