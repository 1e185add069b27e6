"""The workflow registry and the contract every workflow meets; the built-in workflow modules register into it.

The interface is one method (AReaL's): `explore(tasks, engine) -> list[GroupResult]`, one result per task, in
task order. It takes a batch of tasks rather than one so that the engine batches all of their rollouts into one
call; each result is still one task's group.

Contract of a `GroupResult`:
- `samples` are the group's `n` samples, each with prompt tokens, response tokens, behaviour log-probs
  and a loss mask of the response's length (1 for tokens the model generated, 0 for tokens an
  environment inserted, whose log-probs are 0), and a reward in [0, 1].
- `policy_version` is the oldest weights version that generated any token of the group; a sample may record the
  version of each of its tokens (`token_versions`: with in-flight weight updates they differ within one sample).
- A task that cannot be explored (prompt too long, a record the reward cannot score, ...) has `error` set and
  no samples; the explorer sends it to the dead-letter topic and goes on. A rollout that failed outside the task
  and the policy (an environment down or crashed, a reward that timed out, crashed or returned None, a sandbox that
  refused) is a sample with its `failure` class (rft.schema.FAILURE_CLASSES; `build_sample` from a failed
  `RewardResult`): the group is still delivered, and the trainer leaves the sample out (rft/trainer/feed.py).
- A task with images (`TaskRecord.images`) reaches the model only through a workflow that says so with a class
  attribute `takes_images = True` (single_turn; `explorer.workflow` of a run of image tasks is checked when the config
  loads, and explorers dead-letter an image task any other workflow would get). It explores it on a vision-language
  engine (`task_prompt` gives an `ImagePrompt`; a text-only model's engine gets the task dead-lettered), and each
  sample carries the task's images and the prompt text the engine's processor took (`Generation.prompt_text`), so the
  trainer can re-run the processor and check it gives the sample's `prompt_tokens` (rft.models.vision).
- `greedy_reward`: with `explorer.greedy_baseline`, the reward of one greedy (temperature 0) response to the task,
  scored by the same reward and not among `samples` (the group's `greedy_reward`); None otherwise. A workflow that
  can record it says so with a class attribute `records_greedy_reward = True` (checked when a config loads).

A registered class (or one named by an import path `package.module:Class`) is built as
`cls(explorer: ExplorerConfig, model: ModelConfig, reward: Reward)`. This module imports no workflow.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from rft.engine.base import ImagePrompt
from rft.models.vision import VisionError, as_pil, placeholder, process_prompt, prompt_length_problem, task_prompt_text
from rft.registry import Registry
from rft.rewards.registry import RewardError, RewardResult, TaskError
from rft.schema import Image, RoutedExperts, Sample, TaskRecord, Turn
from rft.text.chat import ChatError, ChatPrompt

if TYPE_CHECKING:
    from rft.engine import Engine, Generation, SamplingSettings, VisionEngine
    from rft.rewards.registry import Reward


log = logging.getLogger(__name__)


class WorkflowError(ValueError):
    """An unknown workflow or environment, or one that cannot be built."""


@dataclass
class GroupResult:
    task: TaskRecord
    samples: list[Sample] = field(default_factory=list)
    policy_version: int = 0
    error: str | None = None
    greedy_reward: float | None = None


class Workflow(Protocol):
    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]: ...


WORKFLOWS: Registry[Any] = Registry("workflow", noun="workflow", error=WorkflowError)
register_workflow = WORKFLOWS.register  # class decorator: `explorer.workflow: <name>`


def encode_prompt(engine: Engine, task: TaskRecord, max_prompt_len: int,
                  chat: ChatPrompt | None = None) -> list[int] | str:
    """The task's prompt as token ids (rendered by the chat template when `chat` is given: `ChatPrompt.of(model)`,
    else plain text with the tokenizer's special tokens), or the reason it cannot be explored (a task with images:
    text alone would drop them; `task_prompt` takes them)."""
    if task.images:
        return f"the task has {len(task.images)} image(s) and {refuses_images()}"
    try:
        ids = engine.encode_chat(task.prompt, chat) if chat is not None else engine.encode(task.prompt)
    except ChatError as e:
        raise WorkflowError(str(e)) from None
    if not ids:
        return "prompt is empty after tokenization"
    if len(ids) > max_prompt_len:
        return f"prompt is {len(ids)} tokens, over model.max_prompt_len={max_prompt_len}"
    return ids


def takes_images(workflow: Any) -> bool:
    """Whether a workflow (class or instance) explores tasks with images (module docstring: `takes_images`)."""
    return bool(getattr(workflow, "takes_images", False))


def refuses_images(workflow: str = "this workflow") -> str:
    """Why a workflow that does not take images cannot explore an image task, naming those that can."""
    able = sorted(name for name in WORKFLOWS if takes_images(WORKFLOWS[name]))
    return f"{workflow} explores text only (workflows that take images: {', '.join(able)})"


def task_prompt(engine: Engine, task: TaskRecord, max_prompt_len: int,
                chat: ChatPrompt | None = None) -> list[int] | ImagePrompt | str:
    """What the engine generates from for the task: token ids (`encode_prompt`), an `ImagePrompt` for a task with
    images (`image_prompt`), or the reason it cannot be explored."""
    return image_prompt(engine, task, max_prompt_len, chat) if task.images else encode_prompt(engine, task,
                                                                                               max_prompt_len, chat)


def image_prompt(engine: Engine, task: TaskRecord, max_prompt_len: int,
                 chat: ChatPrompt | None = None) -> ImagePrompt | str:
    """A task with images as a vision-language engine's prompt: one placeholder per image, then the task's prompt;
    with `chat` (`ChatPrompt.of(model)`), a user turn of the image parts and the text (after the system prompt, if
    any) rendered by the processor's chat template (rft.models.vision.render_chat); the images decoded once. Else the
    reason it cannot be explored: a text-only model (the engine has no processor), images or placeholders the
    processor refuses (a prompt that writes the placeholder itself), or a prompt over `max_prompt_len` with its image
    tokens as the processor expands them (refused whole, never cut: rft.models.vision.prompt_length_problem).
    WorkflowError when the processor's chat template cannot render the messages (as `encode_prompt`)."""
    processor = getattr(engine, "processor", None)  # an engine from before `Engine.processor` has none
    if processor is None:
        return (f"the task has {len(task.images)} image(s) and the engine's model takes none (model.path has no "
                "vision_config: a text-only model); image tasks need a vision-language model")
    try:
        placeholder(processor)  # VisionError for a processor without an image token
        images = tuple(as_pil((image.data, image.media_type)) for image in task.images)
    except VisionError as e:
        return f"the task's images: {e}"
    try:
        text = task_prompt_text(processor, task.prompt, len(images), chat)
    except VisionError as e:
        raise WorkflowError(f"model.chat_template: {e}") from None
    try:
        processed = process_prompt(processor, text, images)
    except VisionError as e:
        return f"the task's prompt and images: {e}"
    if problem := prompt_length_problem(processed, max_prompt_len):
        return problem
    return ImagePrompt(text, images, processed)


def generate_prompts(engine: Engine, prompts: dict[int, list[int] | ImagePrompt],
                     sampling: SamplingSettings) -> dict[int, Generation]:
    """Each prompt's generation, by the same key: the token prompts in one `engine.generate` call, the image prompts
    in one `generate_images` call (the engine is then a vision-language one: `image_prompt` made them)."""
    tokens = {i: p for i, p in prompts.items() if not isinstance(p, ImagePrompt)}
    images = {i: p for i, p in prompts.items() if isinstance(p, ImagePrompt)}
    out: dict[int, Generation] = {}
    if tokens:
        out.update(zip(tokens, engine.generate(list(tokens.values()), sampling), strict=True))
    if images:
        vision = cast("VisionEngine", engine)  # image_prompt made them: the engine has a processor
        out.update(zip(images, vision.generate_images(list(images.values()), sampling), strict=True))
    return out


def score_group(reward: Reward, texts: Sequence[str], task: TaskRecord) -> list[RewardResult] | str:
    """The reward's results for one task's replies, or the reason the task cannot be scored (a `TaskError`: the
    group's `error`, so the task goes to the dead-letter topic). A reward that crashes on the group (a judge's
    engine down: anything but a TaskError or RewardError) fails every reply as `verifier`, not the explorer."""
    try:
        return reward.score(texts, task)
    except TaskError as e:
        return f"task cannot be scored: {e}"
    except RewardError:
        raise
    except Exception as e:
        log.warning("reward %s failed on task %s: %s: %s", type(reward).__name__, task.task_id, type(e).__name__, e)
        return [RewardResult(0.0, {}, failure="verifier") for _ in texts]


def build_sample(index: int, *, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
                 loss_mask: Sequence[int], reward: RewardResult, finish_reason: str,
                 metadata: dict[str, Any] | None = None, extra_components: dict[str, float] | None = None,
                 routed_experts: RoutedExperts | None = None, token_versions: Sequence[int] | None = None,
                 turns: list[Turn] | None = None, images: Sequence[Image] = (), prompt_text: str = "") -> Sample:
    """One sample with the wire dtypes (int32 tokens, float32 log-probs, uint8 mask); `routed_experts`: the engine's
    MoE routing of its tokens (rft.engine's `Completion.routed_experts`), when recorded; `token_versions`: the
    weights version of each token (`Completion.token_versions`), when the engine reported them; `turns`: a
    multi-turn episode's steps (rft/algorithms/gigpo.py says how to fill them); `images` and `prompt_text`: an image
    prompt's images (the task's) and its text as the engine's processor took it (`Generation.prompt_text`), both or
    neither. A `reward` with a `failure` makes a failed sample (reward 0 in Python, nil on the wire)."""
    return Sample(sample_index=index, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                  response_tokens=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                  loss_mask=np.asarray(loss_mask, dtype=np.uint8), reward=0.0 if reward.failure else reward.score,
                  reward_components={**reward.components, **(extra_components or {})},
                  finish_reason=finish_reason, metadata=metadata or {}, routed_experts=routed_experts,
                  token_versions=None if token_versions is None else np.asarray(token_versions, dtype=np.int64),
                  failure=reward.failure, turns=turns, images=list(images), prompt_text=prompt_text)
