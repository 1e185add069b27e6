"""SFT demonstrations: a dataset's (prompt, answer) rows as one-sample experience groups on a topic.

`rft run` publishes them before the trainer starts when `replay.from_data: true` (an offline run, e.g. the SFT
stage of a multi-stage run), into the replay's topic (`replay.topic`, else the run's experiences topic), unless
that topic already holds records (a resumed run). The rows, prompt templates, epochs, seeded shuffles and task ids
are the task publisher's (rft/explorer/tasks.py); each task becomes one ExperienceGroup (group id
`<run>/<task id>/e<epoch>`) with one Sample:
- prompt tokens: the prompt as explorers encode it: with the tokenizer's special tokens, or, with
  `model.chat_template: true`, rendered by the chat template as a user turn (after `model.system_prompt`) up to
  the assistant header (rft/chat.py);
- response tokens: the answer (`str()` of it unless it is a string) encoded without special tokens, then the token
  that ends the model's turn (the tokenizer's EOS, or the chat template's end-of-turn token such as `<|im_end|>`)
  when there is one, so the model learns to stop where the engines stop; loss mask all ones: the loss is on the
  answer (the assistant turn) only, never on the prompt;
- behaviour log-probs 0 (there is no behaviour policy: for `sft`, not for policy-gradient algorithms), reward 1,
  policy version 0.
A row with no answer, or whose prompt or response is over `model.max_prompt_len` / `model.max_response_len`
tokens, is an error naming the row; nothing is published then.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from rft.chat import ChatError, ChatPrompt, encode_chat, end_of_turn_id
from rft.config import DataConfig, KafkaConfig, ModelConfig
from rft.explorer.tasks import DatasetError, build_picker, load_task_sets
from rft.schema import ExperienceGroup, Sample, TaskRecord
from rft.transport import connect


def demonstration_groups(data: DataConfig, model: ModelConfig, tokenizer, *, run_id: str) -> Iterator[ExperienceGroup]:
    """Every epoch's demonstrations in the order `data.selector` publishes tasks (all rows are checked first)."""
    chat = ChatPrompt.of(model)
    end = tokenizer.eos_token_id if chat is None else end_of_turn_id(tokenizer)  # what ends the model's turn
    samples = {task.task_id: _sample(task, tokenizer, model, chat=chat, end=end, where=f"{task_set.path} row {i}")
               for task_set, tasks in load_task_sets(data, run_id=run_id) for i, task in enumerate(tasks)}
    for task in build_picker(data, run_id=run_id).drain():
        yield ExperienceGroup(run_id=task.run_id, task_id=task.task_id, group_id=task.group_id, attempt=0,
                              explorer_id="demonstrations", policy_version=0, samples=[samples[task.task_id]],
                              answer=task.answer)


def _sample(task: TaskRecord, tokenizer, model: ModelConfig, *, chat: ChatPrompt | None, end: int | None,
            where: str) -> Sample:
    """One demonstration: the prompt as explorers encode it (`chat`: ChatPrompt.of(model)), the answer then `end`
    (the token that ends the model's turn, or None)."""
    if task.answer is None:
        raise DatasetError(f"{where}: a demonstration needs an answer (data.answer_key is empty)")
    if chat is None:
        prompt = tokenizer(task.prompt, add_special_tokens=True)["input_ids"]
    else:
        try:
            prompt = encode_chat(tokenizer, task.prompt, chat)
        except ChatError as e:
            raise DatasetError(str(e)) from None
    answer = task.answer if isinstance(task.answer, str) else str(task.answer)
    response = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if end is not None:
        response = response + [end]
    for what, tokens, limit, key in (("prompt", prompt, model.max_prompt_len, "max_prompt_len"),
                                     ("answer", response, model.max_response_len, "max_response_len")):
        if not tokens or len(tokens) > limit:
            raise DatasetError(f"{where}: the {what} is {len(tokens)} tokens; a demonstration needs 1 to "
                               f"model.{key}={limit}")
    return Sample(sample_index=0, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                  response_tokens=np.asarray(response, dtype=np.int32),
                  logprobs=np.zeros(len(response), dtype=np.float32),
                  loss_mask=np.ones(len(response), dtype=np.uint8), reward=1.0)


def publish_demonstrations(data: DataConfig, model: ModelConfig, kafka: KafkaConfig, *, topic: str, run_id: str,
                           bootstrap: str | None = None) -> int:
    """Publish the demonstrations to `topic` (the replay's: `replay.topic`, else the run's experiences topic;
    created if missing) unless it holds records already; returns how many were published (0 when it held
    records), once the broker acknowledged every one. `run_id` is the run's name."""
    from transformers import AutoTokenizer  # heavy: transformers

    transport = connect(kafka, bootstrap)
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
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.path)
    groups = list(demonstration_groups(data, model, tokenizer, run_id=run_id))
    sink = transport.sink(client_id=f"{run_id}-demonstrations")
    try:
        futures = [sink.send_record(topic, group, key=group.group_id) for group in groups]
        sink.flush()
        for future in futures:
            future.get(timeout=kafka.request_timeout_ms / 1000)
    finally:
        sink.close()
    return len(groups)
