"""Chat prompts (`model.chat_template: true`): a task's prompt rendered by the tokenizer's chat template, and the
token ids that end the model's turn.

A prompt becomes `[system: model.system_prompt (when set), user: the prompt]`, rendered with
`add_generation_prompt=True`, so the reply starts right after the assistant header (a prompt with images: the user
turn's content is the image parts, then the text, rendered by the model's processor: `ChatPrompt.image_messages`).
The end of the model's turn is the tokenizer's EOS and the special token the template writes after an assistant
message (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3); both engines stop at either, and SFT demonstrations end
the answer with it.
Tools (`tool_agent`): a `ChatPrompt` with `tools` (OpenAI function schemas) renders them with
`apply_chat_template(messages, tools=...)`; a template that ignores `tools` gets the Hermes tool instructions
(`TOOLS_FALLBACK`) appended to the system message. `tool_turn_text` is the text the template writes after an
assistant turn for the given tool messages, through the next assistant header (a template that rejects the `tool`
role gets them as a user message of `<tool_response>` blocks).

Invariant: `encode_chat` returns exactly `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)`'s ids (with `tools=` when the template renders them); with `model.chat_template: false` nothing here
is used. Tokenizers are duck-typed; this module imports no rft module but the config types, and no heavy dependency.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rft.models.config import ModelConfig

_PROBE = "rft-end-of-turn-probe"  # an assistant message whose end the template marks


class ChatError(ValueError):
    """The tokenizer cannot render chat prompts (it has no chat template)."""


@dataclass(frozen=True)
class ChatPrompt:
    """How prompts are rendered when `model.chat_template` is on (`tools`: function schemas shown to the model)."""
    system_prompt: str = ""
    tools: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, model: ModelConfig, tools: tuple[dict[str, Any], ...] = ()) -> ChatPrompt | None:
        """The model section's chat settings; None when `model.chat_template` is off."""
        return cls(model.system_prompt, tools) if model.chat_template else None

    def messages(self, prompt: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": prompt}]

    def image_messages(self, prompt: str, images: int) -> list[dict[str, Any]]:
        """`messages` for a vision-language processor's template (rft.models.vision.render_chat): the user turn's
        content is `images` image parts, then the prompt as a text part; the system prompt is a text part."""
        system = ([{"role": "system", "content": [{"type": "text", "text": self.system_prompt}]}]
                  if self.system_prompt else [])
        parts = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": prompt}]
        return system + [{"role": "user", "content": parts}]


def _ids(rendered: Any) -> list[int]:
    """apply_chat_template's token ids: a list in transformers 4, a BatchEncoding (mapping) in 5."""
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def encode_chat(tokenizer: Any, prompt: str, chat: ChatPrompt) -> list[int]:
    """`prompt` as the template renders a user turn (after the system turn, if any) and the assistant header;
    ChatError when the tokenizer has no template."""
    return encode_messages(tokenizer, chat.messages(prompt), tools=chat.tools)


def encode_messages(tokenizer: Any, messages: list[dict[str, str]],
                    tools: tuple[dict[str, Any], ...] = ()) -> list[int]:
    """A whole conversation (OpenAI-style `{"role", "content"}` messages) as the template renders it, with the
    assistant header after it (`rft serve`, and tools for `tool_agent`); ChatError when the tokenizer has no
    template."""
    messages, template_tools = _with_tools(tokenizer, messages, tools)
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              **template_tools))


TOOLS_FALLBACK = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                  "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                  "function call, return a json object with function name and arguments within <tool_call>"
                  "</tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                  "<args-json-object>}}\n</tool_call>")


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools=` (else `encode_messages` uses TOOLS_FALLBACK)."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}]
    return _PROBE in tokenizer.apply_chat_template([{"role": "user", "content": "1"}], tools=probe, tokenize=False)


def _with_tools(tokenizer: Any, messages: list[dict[str, Any]],
                tools: tuple[dict[str, Any], ...]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and apply_chat_template's extra arguments that show `tools` to the model (module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"model.chat_template: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                        "template (set model.chat_template: false, or use an instruct model's tokenizer)")
    if not tools:
        return messages, {}
    if renders_tools(tokenizer):
        return messages, {"tools": list(tools)}
    text = TOOLS_FALLBACK.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:], {}
    return [{"role": "system", "content": text}] + messages, {}


def tool_turn_text(tokenizer: Any, messages: list[dict[str, Any]], results: list[dict[str, Any]],
                   tools: tuple[dict[str, Any], ...] = ()) -> str:
    """The text the template writes after an assistant turn of the conversation `messages` (as `encode_messages`
    rendered it) for the messages `results` (tool messages `{"role": "tool", "name", "content"}`, or any others: a
    user turn), from just after the assistant's end-of-turn token through the next assistant header. ChatError when
    the template writes anything but its end-of-turn token right after an assistant message."""
    messages, template_tools = _with_tools(tokenizer, messages, tools)
    assistant = [{"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages + assistant + results, add_generation_prompt=True,
                                             tokenize=False, **template_tools)
    except Exception:  # jinja2's TemplateError: a template without the tool role (module docstring)
        text = tokenizer.apply_chat_template(messages + assistant + _tools_as_user(results),
                                             add_generation_prompt=True, tokenize=False, **template_tools)
    end = end_of_turn_id(tokenizer)
    end_text = tokenizer.convert_ids_to_tokens(end) if end is not None else ""
    after = text.split(_PROBE, 1)[1] if _PROBE in text else ""
    if not end_text or not after.startswith(end_text):
        raise ChatError("model.chat_template: the chat template does not end an assistant message with its "
                        f"end-of-turn token (after the message it writes {after[:40]!r})")
    return after[len(end_text):]


def _tools_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each run of tool messages as one user message of `<tool_response>` blocks (a template without
    the tool role)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            out.append(m)
            continue
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if i and messages[i - 1]["role"] == "tool":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
        else:
            out.append({"role": "user", "content": block})
    return out


def observation_text(tokenizer: Any, observation: str) -> str:
    """The text that, right after the model's end-of-turn token, makes `observation` the next user turn and opens
    the assistant's reply, as the template renders it (multi-turn environments). For ChatML:
    `"\n<|im_start|>user\n" + observation + "<|im_end|>\n<|im_start|>assistant\n"`. ChatError when the tokenizer
    has no template, or its template does not render a conversation as a prefix of its continuation."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"model.chat_template: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                        "template")
    turns = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    before = tokenizer.apply_chat_template(turns, tokenize=False)
    after = tokenizer.apply_chat_template(turns + [{"role": "user", "content": observation}], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ChatError("model.chat_template: the template does not extend a conversation by appending to it")
    end = end_of_turn_id(tokenizer)
    tail = before.split(_PROBE, 1)[1]  # what the template writes after an assistant message
    marker = tokenizer.convert_ids_to_tokens(end) if end is not None else ""
    if marker and tail.startswith(marker):
        tail = tail[len(marker):]  # the model's own turn already ends with this token
    return tail + after[len(before):]


def special_ids(tokenizer: Any) -> set[int]:
    """Every special token id of the tokenizer (named ones and added special tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ids | {int(i) for i, token in decoder.items() if getattr(token, "special", False)}


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, else the tokenizer's EOS
    (None when it has neither)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1"},
                                              {"role": "assistant", "content": _PROBE}], tokenize=False)
        if _PROBE in text:
            after = tokenizer(text.split(_PROBE, 1)[1], add_special_tokens=False)["input_ids"]
            if after and int(after[0]) in special_ids(tokenizer):
                return int(after[0])
    return getattr(tokenizer, "eos_token_id", None)


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids that end the model's turn with a chat template: the EOS and the template's end-of-turn token."""
    ids = [getattr(tokenizer, "eos_token_id", None), end_of_turn_id(tokenizer)]
    return sorted({int(i) for i in ids if i is not None})
