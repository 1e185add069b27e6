"""SFT demonstrations: a dataset's (prompt, answer) rows as one-sample experience groups on a topic.

`rft run` publishes them before the trainer starts when `replay.from_data: true` (an offline run, e.g. the SFT stage
of a multi-stage run), into `replay.topic` (else the run's experiences topic), unless that topic already holds
records (a resumed run). Rows, templates, epochs, shuffles and task ids are the task publisher's (rft/data/tasks.py);
each task becomes one ExperienceGroup (`<run>/<task id>/e<epoch>`) with one Sample:
- prompt tokens: as explorers encode the prompt (special tokens, or with `model.chat_template: true` the chat
  template's user turn after `model.system_prompt`, up to the assistant header; rft/text/chat.py), showing the tools
  the explorers show (`prompt_tools`);
- response tokens: the answer encoded without special tokens, then the end-of-turn token (EOS or the template's,
  e.g. `<|im_end|>`) when there is one; loss mask all ones (the loss is on the answer only);
- a conversation answer (`model.chat_template: true`): messages `{"role": "assistant" | "tool" | "user", "content"}`
  starting and ending with an assistant turn, laid out as the multi-turn workflows lay out an episode: assistant
  turns with loss mask 1, tool runs (`tool_turn_text`) and user turns (`observation_text`) with loss mask 0;
- behaviour log-probs 0 (no behaviour policy: for `sft`, not policy-gradient algorithms), reward 1, version 0;
- a task with images (an image source's, e.g. easy_vqa) on a vision-language model (`processor`): the sample carries
  the task's images and `prompt_text`, the prompt as explorers give it to the engine (with `model.chat_template`, the
  chat rendered by the processor's template, `ChatPrompt.image_messages`: the system prompt, then a user turn of one
  image part per image and the prompt's text; else one placeholder per image, then the prompt), and `prompt_tokens` are
  `process_prompt(processor, prompt_text, images).token_ids` (placeholders expanded), the contract the trainer
  checks (rft.models.vision.engine_prompt_problem); on a text model such a task is an error.
A row with no answer, or over `model.max_prompt_len` / `model.max_response_len` tokens, is an error naming the row;
nothing is published then.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from rft.agent_tools import ToolBox, ToolError, ToolLimits
from rft.data.config import DataConfig
from rft.data.tasks import DatasetError, build_picker, load_task_sets
from rft.explorer.config import ExplorerConfig
from rft.models.config import ModelConfig
from rft.models.vision import (
    VisionError,
    is_vision_model,
    load_processor,
    process_prompt,
    prompt_length_problem,
    task_prompt_text,
)
from rft.schema import ExperienceGroup, Sample, TaskRecord
from rft.text.chat import ChatError, ChatPrompt, encode_chat, end_of_turn_id, observation_text, tool_turn_text
from rft.transport import ClaimStore, connect
from rft.transport.config import KafkaConfig

ROLES = ("assistant", "tool", "user")  # the messages of a conversation answer


def prompt_tools(explorer: ExplorerConfig) -> tuple[dict[str, Any], ...]:
    """The function schemas the explorers show in every prompt: `explorer.tools`' when the workflow is
    `tool_agent`, else none."""
    if explorer.workflow != "tool_agent":
        return ()
    try:
        return tuple(ToolBox(explorer.tools, ToolLimits(sandbox=explorer.python_sandbox)).schemas)
    except ToolError as e:
        raise DatasetError(str(e)) from None


def demonstration_groups(data: DataConfig, model: ModelConfig, tokenizer, *, run_id: str,
                         tools: tuple[dict[str, Any], ...] = (), processor: Any = None) -> Iterator[ExperienceGroup]:
    """Every epoch's demonstrations in the order `data.selector` publishes tasks (all rows are checked first);
    `tools`: the function schemas the prompts show (`prompt_tools`); `processor`: the model's processor when it
    is a vision-language model (`tokenizer` is then its tokenizer), else None."""
    chat = ChatPrompt.of(model, tools)
    end = tokenizer.eos_token_id if chat is None else end_of_turn_id(tokenizer)  # what ends the model's turn
    samples = {task.task_id: _sample(task, tokenizer, model, chat=chat, end=end, where=f"{task_set.path} row {i}",
                                     processor=processor)
               for task_set, tasks in load_task_sets(data, run_id=run_id) for i, task in enumerate(tasks)}
    for task in build_picker(data, run_id=run_id).drain():
        yield ExperienceGroup(run_id=task.run_id, task_id=task.task_id, group_id=task.group_id, attempt=0,
                              explorer_id="demonstrations", policy_version=0, samples=[samples[task.task_id]],
                              answer=task.answer)


def _sample(task: TaskRecord, tokenizer, model: ModelConfig, *, chat: ChatPrompt | None, end: int | None,
            where: str, processor: Any = None) -> Sample:
    """One demonstration: the prompt as explorers encode it (`chat`: ChatPrompt.of(model); with images, as
    `processor` expands it), the answer then `end` (the token that ends the model's turn, or None)."""
    if task.answer is None:
        raise DatasetError(f"{where}: a demonstration needs an answer (data.answer_key is empty)")
    prompt_text = ""
    if task.images:
        prompt, prompt_text = _image_prompt(task, processor, model, where=where)
    elif chat is None:
        prompt = tokenizer(task.prompt, add_special_tokens=True)["input_ids"]
    else:
        try:
            prompt = encode_chat(tokenizer, task.prompt, chat)
        except ChatError as e:
            raise DatasetError(str(e)) from None
    if isinstance(task.answer, list):
        response, mask = _conversation(task.answer, tokenizer, chat, end=end, where=where, prompt=task.prompt)
    else:
        answer = task.answer if isinstance(task.answer, str) else str(task.answer)
        response = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
        if end is not None:
            response = response + [end]
        mask = [1] * len(response)
    for what, tokens, limit, key in (("prompt", prompt, model.max_prompt_len, "max_prompt_len"),
                                     ("answer", response, model.max_response_len, "max_response_len")):
        if not tokens or len(tokens) > limit:
            raise DatasetError(f"{where}: the {what} is {len(tokens)} tokens; a demonstration needs 1 to "
                               f"model.{key}={limit}")
    return Sample(sample_index=0, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                  response_tokens=np.asarray(response, dtype=np.int32),
                  logprobs=np.zeros(len(response), dtype=np.float32),
                  loss_mask=np.asarray(mask, dtype=np.uint8), reward=1.0, images=list(task.images),
                  prompt_text=prompt_text)


def _image_prompt(task: TaskRecord, processor: Any, model: ModelConfig, *, where: str) -> tuple[list[int], str]:
    """An image task's prompt ids (placeholders expanded) and prompt text (module docstring); DatasetError naming
    the row when the model is not a VLM, or the processor refuses the prompt or it is too long."""
    if processor is None:
        raise DatasetError(f"{where}: the task has {len(task.images)} image(s) but model.path {model.path!r} is not "
                           "a vision-language model")
    try:
        text = task_prompt_text(processor, task.prompt, len(task.images), ChatPrompt.of(model))
        processed = process_prompt(processor, text, [(image.data, image.media_type) for image in task.images])
    except VisionError as e:
        raise DatasetError(f"{where}: {e}") from None
    problem = prompt_length_problem(processed, model.max_prompt_len)
    if problem:
        raise DatasetError(f"{where}: {problem}")
    return processed.token_ids, text


def _conversation(turns: list, tokenizer, chat: ChatPrompt | None, *, end: int | None, where: str,
                  prompt: str) -> tuple[list[int], list[int]]:
    """A conversation answer's response tokens and loss mask (module docstring); DatasetError naming the row and
    message when it is malformed."""
    if chat is None:
        raise DatasetError(f"{where}: a conversation answer needs model.chat_template: true (its tool and user turns "
                           "are rendered by the chat template)")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise DatasetError(f"{where}: answer[{i}] must be {{\"role\": {' | '.join(ROLES)}, \"content\": str}}, "
                               f"got {turn!r:.80}")
    if not turns or turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
        raise DatasetError(f"{where}: a conversation answer starts and ends with an assistant turn (roles: "
                           f"{[t['role'] for t in turns]})")
    if end is None:
        raise DatasetError(f"{where}: the chat template marks no end of an assistant turn, so a conversation's turns "
                           "cannot be told apart")
    tokens: list[int] = []
    mask: list[int] = []

    def add(ids: list[int], trained: int) -> None:
        tokens.extend(ids)
        mask.extend([trained] * len(ids))

    i = 0
    while i < len(turns):
        role = turns[i]["role"]
        if role == "assistant":
            add(list(tokenizer(turns[i]["content"], add_special_tokens=False)["input_ids"]) + [end], 1)
            i += 1
            continue
        if role == "user":
            text = observation_text(tokenizer, turns[i]["content"])
            i += 1
        else:  # a run of tool messages is one tool turn, as tool_agent answers every call of a model turn at once
            results = []
            while turns[i]["role"] == "tool":
                results.append({"role": "tool", "name": str(turns[i].get("name") or "unknown"),
                                "content": turns[i]["content"]})
                i += 1
            text = tool_turn_text(tokenizer, chat.messages(prompt), results, chat.tools)
        add(list(tokenizer(text, add_special_tokens=False)["input_ids"]), 0)
    return tokens, mask


def publish_demonstrations(data: DataConfig, model: ModelConfig, kafka: KafkaConfig, *, topic: str, run_id: str,
                           bootstrap: str | None = None, tools: tuple[dict[str, Any], ...] = (),
                           claims: ClaimStore | None = None) -> int:
    """Publish the demonstrations to `topic` (the replay's: `replay.topic`, else the run's experiences topic;
    created if missing) unless it holds records already; returns how many were published (0 when it held
    records), once the broker acknowledged every one. `run_id` is the run's name; `tools` as in
    `demonstration_groups`; `claims`: the run's claim store (large groups are claim-checked, rft.run.records)."""
    from transformers import AutoTokenizer  # heavy: transformers

    transport = connect(kafka, bootstrap, claims=claims)
    admin = transport.admin()
    try:
        admin.create_topics([topic], partitions=kafka.experience_partitions)
    finally:
        admin.close()
    source = transport.source()
    try:
        if any(source.end_offsets(topic)[k] > start for k, start in source.beginning_offsets(topic).items()):
            return 0
    finally:
        source.close()
    processor = load_processor(model.path) if is_vision_model(model.path) else None
    tokenizer = processor.tokenizer if processor else AutoTokenizer.from_pretrained(model.tokenizer or model.path)
    groups = list(demonstration_groups(data, model, tokenizer, run_id=run_id, tools=tools, processor=processor))
    sink = transport.sink(client_id=f"{run_id}-demonstrations")
    try:
        futures = [sink.send_record(topic, group, key=group.group_id) for group in groups]
        sink.flush()
        for future in futures:
            future.get(timeout=kafka.request_timeout_ms / 1000)
    finally:
        sink.close()
    return len(groups)
