"""TRL's `GRPOTrainer` trained on an rft run config: the reference the benchmarks race rft against.

`run_trl(config, ...)` starts one child process (`python -m benchmarks.trl_reference SPEC`, SPEC is JSON; the child has
its own torch thread settings and imports) and returns the child's result. The child trains TRL on exactly what the
rft config describes:
- tasks: every task the run's task publisher would publish, in its order (`build_picker(data).drain()`, the
  selector with fixed statistics), given to TRL unshuffled;
- prompts: the text rft's explorers tokenize. With `model.chat_template` that is the chat template rendered with
  `model.system_prompt` and the generation prompt, passed to TRL as a plain string, so TRL tokenizes it as is and
  does not apply the template a second time (TRL 1.16 applies its own template only to conversational prompts, lists
  of messages). The child checks, off the clock, that TRL's token ids equal rft's (`rft.text.chat.encode_chat`) for
  every task and fails otherwise. Generation stops at the same end-of-turn ids (`rft.text.chat.stop_token_ids`, set as
  the model's `generation_config.eos_token_id`, which TRL also uses to mask what follows);
- reward: `explorer.reward` built from rft's reward registry, scoring the decoded completion (special tokens
  skipped, as rft's engines decode) against the task record; a task the reward cannot score (`TaskError`) scores 0
  (rft would dead-letter it);
- batch and optimisation: `run.groups_per_step` prompts x `explorer.n_samples` completions per step
  (`per_device_train_batch_size` = their product, `num_generations` = n_samples), `trainer.lr` constant (no warm-up,
  no decay, as rft's trainer), Adam betas, weight decay and gradient clipping from `trainer`, `temperature` and
  `top_p` from `explorer`, at most min(`explorer.max_tokens`, `model.max_response_len`) new tokens, `beta` =
  `algorithm.kl_coef`, `epsilon` / `epsilon_high` = `algorithm.clip_eps_low` / `clip_eps_high` (each
  `algorithm.clip_eps` when null), `loss_type` dapo for `loss_agg: token_mean` (the token mean
  over the step) and grpo for seq_mean, rewards scaled by the group std unless `algorithm.std_normalize: false`;
  `model.dtype` decides bf16 / fp16 autocast over float32 parameters, or fp32 (`trl_model`); no gradient
  checkpointing (TRL's default recomputes activations to save memory, which rft's trainer does not do). Only
  `algorithm.name: grpo` has a TRL counterpart here.
- a vision-language model (`rft.models.vision.is_vision_model`; image tasks such as easy_vqa): TRL's processor is
  the model's (`processing_class`), the policy its image-text-to-text class, and each dataset row the task's chat
  (`model.system_prompt`, then the prompt) with the task's images, which TRL puts before the user's text as rft's
  `ChatPrompt.image_messages` does; the child checks, off the clock, that the processor's ids of TRL's rendering
  equal rft's (`process_prompt` of the rendered `image_messages`) for every task. Snapshots save the processor.
Not reproduced: `trainer.operators` (TRL trains on every group; a group whose samples all scored the same gets
zero advantages), replay buffers, and `model.max_prompt_len` (TRL does not drop long prompts). Generation is
Hugging Face `generate`, on the GPU when there is one, else on the CPU.

Clock and stopping. The child's clock starts at `started_at` (epoch seconds: when the parent launched it, so
start-up counts) minus the seconds spent taking snapshots. Training stops after `steps` steps, or at the first step
end at or after `budget_s`. Snapshots (`marks` > 0): mark i of n is the weights that were the newest at
budget x i / n. The child keeps a host-memory copy of the weights after every step (its cost is off the clock), so
when a step ends past mark i it writes the copy from before that step: the weights that existed at the mark. A mark
reached before the first step ended is the initial model (written as no directory: `path` null). The result
(printed as one `TRL-RESULT {json}` line) holds the step end times, the time of the first step, the marks (time,
step, path) and the seconds spent on snapshots.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rft.algorithms import build_options
from rft.data.tasks import build_picker
from rft.models.vision import as_pil, is_vision_model, load_processor, process_prompt, render_chat
from rft.rewards import RewardContext, build_reward
from rft.rewards.registry import TaskError
from rft.run.config import Config
from rft.run.loading import load_run_config
from rft.schema import TaskRecord
from rft.text.chat import ChatPrompt, encode_chat, stop_token_ids

RESULT_PREFIX = "TRL-RESULT "
LOSS_TYPES = {"token_mean": "dapo", "seq_mean": "grpo"}  # rft's algorithm.loss_agg -> TRL's loss_type
UNLIMITED_STEPS = 1_000_000


class TRLReferenceError(RuntimeError):
    """The config has no TRL counterpart, or TRL would not see what rft's explorers see."""


def trl_missing() -> str | None:
    """Why the TRL reference cannot run here (None: it can)."""
    try:
        import trl  # noqa: F401  (heavy: trl, only checked for)
    except ImportError:
        return "trl is not installed"
    return None


# --------------------------------------------------------------------------------------------------
# Parent side


def run_trl(config: str | os.PathLike, *, out: Path, env: dict, timeout_s: float, overrides: list[str] = (),
            steps: int | None = None, budget_s: float | None = None, marks: int = 0,
            started_at: float | None = None, progress: str = "[bench] trl") -> dict:
    """Train TRL on `config` (+ `overrides`, `--set` style) in a child process; its log goes to `out/trl.log`,
    TRL's per-step values (reward, entropy, ...) to `out/metrics.jsonl`, snapshots to `out/mark-<i>`. Stops after
    `steps` steps or at `budget_s` seconds after `started_at` (default: now). Lines the child prints with the
    `progress` prefix are echoed to stderr. Returns the child's result, or {"error": ...} when it failed or ran past
    `timeout_s`."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"config": str(config), "overrides": list(overrides), "out": str(out), "steps": steps,
            "budget_s": budget_s, "marks": marks, "started_at": started_at or time.time(), "progress": progress}
    log_path = out / "trl.log"
    with open(log_path, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.trl_reference", json.dumps(spec)], env=env,
                                 stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        killer = threading.Timer(timeout_s, child.kill)
        killer.start()
        try:
            result = _read_result(child, progress)
        finally:
            killer.cancel()
            code = child.wait()
    if code != 0 or result is None:
        tail = log_path.read_text(errors="replace")[-3000:]
        return {"error": f"TRL exited with code {code} (log {log_path}):\n{tail}"}
    return result


def _read_result(child: subprocess.Popen, progress: str) -> dict | None:
    """Echo the child's progress lines to stderr until it closes stdout; its result line, parsed."""
    result = None
    for line in child.stdout:
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        elif line.startswith(progress):
            print(line.rstrip(), file=sys.stderr, flush=True)
    return result


# --------------------------------------------------------------------------------------------------
# Child side: what TRL trains on


def trl_prompts(cfg: Config, tokenizer: Any, tasks: list[TaskRecord]) -> list[str]:
    """Each task's prompt as the text rft's explorers tokenize (see the module docstring)."""
    chat = ChatPrompt.of(cfg.model)
    if chat is None:
        return [task.prompt for task in tasks]
    return [tokenizer.apply_chat_template(chat.messages(task.prompt), add_generation_prompt=True, tokenize=False)
            for task in tasks]


def check_same_tokens(cfg: Config, tokenizer: Any, tasks: list[TaskRecord], texts: list[str]) -> None:
    """TRLReferenceError unless TRL's tokenization of each text (the tokenizer's default special tokens, as TRL
    tokenizes string prompts) gives the ids rft's explorers generate from (`encode_prompt`'s: `encode_chat`, or
    the tokenizer with its special tokens)."""
    chat = ChatPrompt.of(cfg.model)
    for task, text, ids in zip(tasks, texts, tokenizer(text=texts)["input_ids"], strict=True):
        expected = encode_chat(tokenizer, task.prompt, chat) if chat else tokenizer(text=task.prompt)["input_ids"]
        if list(ids) != list(expected):
            raise TRLReferenceError(f"TRL would tokenize the prompt of task {task.task_id} differently from rft's "
                                    f"explorers (the tokenizer adds special tokens to {text[:60]!r}...)")


def image_rows(cfg: Config, processor: Any, tasks: list[TaskRecord]) -> list[dict[str, Any]]:
    """The dataset rows of image tasks for a VLM: `prompt` the chat as messages with string contents (TRL inserts
    the images' parts before the user's text), `images` the task's images (PIL), `task_index`."""
    rows = []
    for i, task in enumerate(tasks):
        system = [{"role": "system", "content": cfg.model.system_prompt}] if cfg.model.system_prompt else []
        rows.append({"prompt": system + [{"role": "user", "content": task.prompt}],
                     "images": [as_pil((image.data, image.media_type)) for image in task.images], "task_index": i})
    return rows


def check_same_image_tokens(cfg: Config, processor: Any, tasks: list[TaskRecord], rows: list[dict]) -> None:
    """TRLReferenceError unless the processor's ids of each row as TRL renders it (its multimodal messages through
    `apply_chat_template`) equal rft's (`process_prompt` of `ChatPrompt.image_messages` rendered)."""
    from trl.data_utils import prepare_multimodal_messages  # heavy: trl

    for task, row in zip(tasks, rows, strict=True):
        messages = prepare_multimodal_messages(row["prompt"], images=row["images"])
        ids = processor.apply_chat_template([messages], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"][0]
        text = render_chat(processor, ChatPrompt(cfg.model.system_prompt).image_messages(task.prompt,
                                                                                         len(task.images)))
        expected = process_prompt(processor, text, row["images"]).token_ids
        if [int(t) for t in ids] != expected:
            raise TRLReferenceError(f"TRL would give the prompt of task {task.task_id} other token ids than rft's "
                                    f"explorers ({len(ids)} against {len(expected)} tokens)")


def completion_text(completion: Any) -> str:
    """A TRL completion's text: the string itself, or a conversational prompt's assistant message's content."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def trl_reward(cfg: Config, tasks: list[TaskRecord]) -> Callable[..., list[float]]:
    """A TRL reward function (completions + the dataset's `task_index` column) scoring with `explorer.reward`."""
    reward = build_reward(cfg.explorer, RewardContext.for_run(cfg))

    def score(completions: list[Any], task_index: list[int], **_: Any) -> list[float]:
        scores = []
        for completion, index in zip(completions, task_index, strict=True):
            try:
                scores.append(reward.score([completion_text(completion)], tasks[index])[0].score)
            except TaskError:
                scores.append(0.0)
        return scores

    score.__name__ = cfg.explorer.reward
    return score


def check_trl_config(cfg: Config) -> None:
    """TRLReferenceError naming the key when the config has no TRL counterpart here."""
    if cfg.algorithm.name != "grpo":
        raise TRLReferenceError(f"algorithm.name: the TRL reference runs grpo only, not {cfg.algorithm.name!r}")
    if cfg.stages:
        raise TRLReferenceError("stages: the TRL reference runs single-stage configs only")


def trl_model(cfg: Config):
    """The policy TRL trains, with float32 parameters whatever `model.dtype`: bfloat16 and float16 become TRL's
    autocast (`grpo_config`'s bf16 / fp16), the mixed precision rft's trainer runs (megatron keeps float32 main
    weights). Parameters held in bfloat16 would round most AdamW updates of a small learning rate away (3e-5 against
    a bfloat16 spacing of ~1e-4 at a weight of 0.03), a TRL that could not learn."""
    import torch  # heavy: torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # heavy: transformers

    auto = AutoModelForImageTextToText if is_vision_model(cfg.model.path) else AutoModelForCausalLM
    return auto.from_pretrained(cfg.model.path, dtype=torch.float32)


def grpo_config(cfg: Config, *, out: Path, steps: int | None, use_cpu: bool):
    """TRL's GRPOConfig for the rft config (the mapping of the module docstring)."""
    from trl import GRPOConfig  # heavy: trl

    check_trl_config(cfg)
    e, t, a = cfg.explorer, cfg.trainer, build_options(cfg.algorithm)
    return GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=cfg.run.groups_per_step * e.n_samples,
        num_generations=e.n_samples, max_completion_length=min(e.max_tokens, cfg.model.max_response_len),
        temperature=e.temperature, top_p=e.top_p, top_k=0, learning_rate=t.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        max_grad_norm=t.grad_clip, beta=a.kl_coef, loss_type=LOSS_TYPES[a.loss_agg],
        epsilon=a.clip_eps if a.clip_eps_low is None else a.clip_eps_low,
        epsilon_high=a.clip_eps if a.clip_eps_high is None else a.clip_eps_high,
        scale_rewards="group" if a.std_normalize else "none", max_steps=steps or UNLIMITED_STEPS,
        bf16=cfg.model.dtype == "bfloat16", fp16=cfg.model.dtype == "float16", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=use_cpu, seed=cfg.run.seed, shuffle_dataset=False,
        gradient_checkpointing=False)  # TRL's default recomputes activations: a memory saving rft does not make


# --------------------------------------------------------------------------------------------------
# Child side: clock, stopping and snapshots


class Clock:
    """Seconds since `started_at`, less the seconds excluded with `off_clock`."""

    def __init__(self, started_at: float):
        self.started_at, self.excluded = started_at, 0.0

    def now(self) -> float:
        return time.time() - self.started_at - self.excluded

    def off_clock(self, fn: Callable[[], Any]) -> Any:
        started = time.time()
        try:
            return fn()
        finally:
            self.excluded += time.time() - started


class Marks:
    """The snapshots of the module docstring: `take(step, now)` after each step, `finish()` at the end. Mark
    i's directory is `out/mark-<i>`; marks holding the same weights share the first one's directory."""

    def __init__(self, model: Any, tokenizer: Any, *, out: Path, budget_s: float, count: int, clock: Clock):
        self.model, self.tokenizer, self.out, self.clock = model, tokenizer, out, clock
        self.due = [budget_s * (i + 1) / count for i in range(count)]
        self.taken: list[dict] = []
        self.previous: tuple[int, dict | None] = (0, None)  # (step, weights copy); None: the initial model

    def take(self, step: int, now: float) -> None:
        """Step `step` ended at `now`: marks due by then hold the previous weights; then copy this step's."""
        self._write_due(now, *self.previous)
        if len(self.taken) < len(self.due):
            self.previous = (step, self.clock.off_clock(self._copy))

    def finish(self) -> None:
        """Training ended: every mark not taken holds the final weights."""
        self._write_due(float("inf"), *self.previous)

    def _write_due(self, until: float, step: int, weights: dict | None) -> None:
        while len(self.taken) < len(self.due) and self.due[len(self.taken)] <= until:
            i = len(self.taken) + 1
            same = next((m["path"] for m in self.taken if m["step"] == step), None)
            path = same if same or weights is None else self.clock.off_clock(lambda i=i: self._save(i, weights))
            self.taken.append({"mark": i, "time_s": self.due[i - 1], "step": step, "path": path})

    def _copy(self) -> dict:
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()
                if not (tied and name == "lm_head.weight")}

    def _save(self, i: int, weights: dict) -> str:
        path = self.out / f"mark-{i}"
        self.model.save_pretrained(path, state_dict=weights)
        self.tokenizer.save_pretrained(path)
        return str(path)


def within_budget(at_s: float, budget_s: float | None) -> bool:
    """Whether a step that ended `at_s` seconds from launch counts in the report: the one rule the progress line, the
    step count and the per-window signal share (so a step a hair past the budget is judged the same by all three;
    the times it is judged on are never rounded first)."""
    return budget_s is None or 0 <= at_s <= budget_s


def step_note(system: str, step: int, at_s: float, budget_s: float | None) -> str:
    """The progress line of a step that ended `at_s` seconds from launch; a step past the budget, which the report
    does not count (`within_budget`), says so."""
    late = not within_budget(at_s, budget_s)
    return f"{system}: step {step} at {at_s:.0f} s{' (past the budget: not counted)' if late else ''}"


def log_record(step: int, at_s: float, logs: dict) -> dict:
    """One line of TRL's `metrics.jsonl`: the step, when it ended (the clock's seconds) and TRL's own log values
    (its names: reward, reward_std, entropy, completions/mean_length, clip_ratio/..., loss, grad_norm,
    learning_rate); a value that is not a finite number is left out (strict JSON has no NaN). `at_s` is kept as
    measured: rounded, a step a hair past the budget would be counted by the report yet noted as past it."""
    values = {k: float(v) for k, v in logs.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return {"step": step, "at_s": at_s, **values}


def stepping_callback(clock: Clock, *, budget_s: float | None, marks: Marks | None, progress: str,
                      metrics: Path | None = None):
    """A TrainerCallback recording step end times (on `clock`), taking the marks, stopping at the budget and
    appending TRL's per-step logs to `metrics` (JSON lines, `log_record`), the record rft's runs keep in theirs."""
    from transformers import TrainerCallback  # heavy: transformers

    class Stepping(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if metrics is not None and logs and "reward" in logs:  # a training step's log, not the final summary
                # at the time its step ended (`on_step_end` runs first), which decides whether the report counts it
                with open(metrics, "a") as f:
                    f.write(json.dumps(log_record(state.global_step, self.ends[-1], logs)) + "\n")

        def on_step_end(self, args, state, control, **kwargs):
            now = clock.now()
            self.ends.append(now)
            print(step_note(progress, state.global_step, now, budget_s), flush=True)
            if marks is not None:
                marks.take(state.global_step, now)
            if budget_s is not None and now >= budget_s:
                control.should_training_stop = True

        def on_train_end(self, args, state, control, **kwargs):
            if marks is not None:
                marks.finish()

    return Stepping()


def train(spec: dict) -> dict:
    """The child: TRL on the spec's config (see `run_trl`); returns the result."""
    import torch  # heavy: torch
    from datasets import Dataset  # heavy: datasets
    from transformers import AutoTokenizer  # heavy: transformers
    from trl import GRPOTrainer  # heavy: trl

    clock = Clock(spec["started_at"])
    cfg = load_run_config(spec["config"], spec["overrides"])
    out = Path(spec["out"])
    tasks = list(build_picker(cfg.data, run_id=cfg.run.name).drain())
    processor = load_processor(cfg.model.path) if is_vision_model(cfg.model.path) else None
    tokenizer = processor.tokenizer if processor else AutoTokenizer.from_pretrained(cfg.model.tokenizer or
                                                                                    cfg.model.path)
    model = trl_model(cfg)
    if cfg.model.chat_template or processor:
        model.generation_config.eos_token_id = stop_token_ids(tokenizer)
    if processor is not None:  # image tasks: TRL renders the chat and runs the processor itself
        rows = image_rows(cfg, processor, tasks)
        clock.off_clock(lambda: check_same_image_tokens(cfg, processor, tasks, rows))
    else:
        texts = trl_prompts(cfg, tokenizer, tasks)
        clock.off_clock(lambda: check_same_tokens(cfg, tokenizer, tasks, texts))
        rows = [{"prompt": text, "task_index": i} for i, text in enumerate(texts)]
    dataset = Dataset.from_list(rows)
    processing_class = processor or tokenizer
    marks = Marks(model, processing_class, out=out, budget_s=spec["budget_s"], count=spec["marks"],
                  clock=clock) if spec["marks"] else None
    stepping = stepping_callback(clock, budget_s=spec["budget_s"], marks=marks, progress=spec["progress"],
                                 metrics=out / "metrics.jsonl")
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward(cfg, tasks), train_dataset=dataset,
                          args=grpo_config(cfg, out=out, steps=spec["steps"], use_cpu=not torch.cuda.is_available()),
                          processing_class=processing_class, callbacks=[stepping])
    trainer.train()
    ends = stepping.ends
    return {"steps": len(ends), "step_end_s": ends, "first_step_s": ends[0] if ends else None,
            "samples_per_step": cfg.run.groups_per_step * cfg.explorer.n_samples,
            "marks": marks.taken if marks else [], "snapshot_s": round(clock.excluded, 3)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.trl_reference SPEC_JSON (started by run_trl)", file=sys.stderr)
        return 2
    print(RESULT_PREFIX + json.dumps(train(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
