"""An engine on a CPU run's core board (rft/cores.py): the explorer's composition wraps its engine and workflow once
(`paced`), so that no loop marks anything itself. Absent on GPUs: the launcher writes a board only for CPU runs.

While the engine computes, the explorer's part is busy, and it takes the threads of the parts that wait (the
trainer's, while it waits for experiences); otherwise it waits, and they may take its threads. A unit of work:
  - one `workflow.explore` of the batch loop (generation and rewards, every turn of a multi-turn workflow);
  - one `generate` or `next_token_probs` outside it (the warm-up);
  - one engine `step` of the continuous loop;
  - one reload (`load_weights`, `load_weights_in_flight`, `receive_pushed_weights`).
A unit marks the part busy and, except reloads, applies the board's threads to torch in the calling thread
(`CoreShare.fit_torch`: OpenMP's count is per thread). After it the part waits, unless requests are still unfinished
in the engine (continuous submission: it computes on at the next step). Units nest: only the outermost one marks.
Not thread-safe, as the engine.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from rft.cores import CoreShare
from rft.engine.base import Engine, Generation, ImagePrompt, SamplingSettings, StreamingEngine, VisionEngine

if TYPE_CHECKING:
    from rft.schema import TaskRecord
    from rft.text.chat import ChatPrompt


class Pace:
    """The units of the module docstring over one part's `cores`; `unfinished()`: the engine's requests in flight."""

    def __init__(self, cores: CoreShare, unfinished: Callable[[], int] | None = None):
        self.cores, self.unfinished = cores, unfinished
        self._depth = 0

    @contextlib.contextmanager
    def unit(self, *, fit: bool) -> Iterator[None]:
        outermost = self._depth == 0
        if outermost:
            self.cores.set_busy(True)
            if fit:
                self.cores.fit_torch()  # the threads of a waiting trainer too
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outermost and not (self.unfinished is not None and self.unfinished()):
                self.cores.set_busy(False)


class PacedEngine:
    """`engine`, each call that computes a unit of `pace` (module docstring); the rest as is."""

    def __init__(self, engine: Engine, pace: Pace):
        self.engine, self.pace = engine, pace

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.engine.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, prompt: str, chat: ChatPrompt) -> list[int]:
        return self.engine.encode_chat(prompt, chat)

    def encode_observation(self, text: str, chat: ChatPrompt | None) -> list[int]:
        return self.engine.encode_observation(text, chat)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.engine.decode(token_ids)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        with self.pace.unit(fit=True):
            return self.engine.generate(prompts, sampling)

    def next_token_probs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int]) -> list[list[float]]:
        with self.pace.unit(fit=True):
            return self.engine.next_token_probs(prompts, candidates)

    @property
    def processor(self) -> Any:
        """The engine's processor on a vision-language model (rft.engine.VisionEngine), else None."""
        return getattr(self.engine, "processor", None)

    def generate_images(self, prompts: Sequence[ImagePrompt], sampling: SamplingSettings) -> list[Generation]:
        with self.pace.unit(fit=True):
            return cast(VisionEngine, self.engine).generate_images(prompts, sampling)

    def load_weights(self, path: str | os.PathLike, version: int) -> None:
        with self.pace.unit(fit=False):
            self.engine.load_weights(path, version)

    def join_push_group(self, spec: dict) -> None:
        self.engine.join_push_group(spec)

    def receive_pushed_weights(self) -> int:
        with self.pace.unit(fit=False):
            return self.engine.receive_pushed_weights()

    def leave_push_group(self) -> None:
        self.engine.leave_push_group()

    def close(self) -> None:
        self.engine.close()


class PacedStreamingEngine(PacedEngine):
    """A `PacedEngine` of an engine with continuous submission (`submit`, `step`: VLLMEngine)."""

    def __init__(self, engine: StreamingEngine, pace: Pace):
        super().__init__(engine, pace)
        self.streaming = engine

    def submit(self, request_id: str, prompt: Sequence[int], sampling: SamplingSettings) -> None:
        self.streaming.submit(request_id, prompt, sampling)

    def submit_images(self, request_id: str, prompt: ImagePrompt, sampling: SamplingSettings) -> None:
        self.streaming.submit_images(request_id, prompt, sampling)

    def step(self) -> list[tuple[str, Generation]]:
        with self.pace.unit(fit=True):
            return self.streaming.step()

    def unfinished(self) -> int:
        return self.streaming.unfinished()

    def load_weights_in_flight(self, path: str | os.PathLike, version: int, *, recompute: bool) -> None:
        with self.pace.unit(fit=False):
            self.streaming.load_weights_in_flight(path, version, recompute=recompute)


class PacedWorkflow:
    """`workflow`, each `explore` one unit of `pace` (its generates nest in it); the streaming interface as is."""

    def __init__(self, workflow: Any, pace: Pace):  # a Workflow, with the streaming interface or without
        self.workflow, self.pace = workflow, pace

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[Any]:
        with self.pace.unit(fit=True):
            return self.workflow.explore(tasks, engine)

    @property
    def sampling(self) -> SamplingSettings:
        return self.workflow.sampling

    @property
    def takes_images(self) -> bool:
        return bool(getattr(self.workflow, "takes_images", False))

    def prepare(self, task: TaskRecord, engine: Engine) -> Any:
        return self.workflow.prepare(task, engine)

    def finish(self, task: TaskRecord, generation: Generation) -> Any:
        return self.workflow.finish(task, generation)


def paced(engine: Engine, workflow: Any, cores: CoreShare) -> tuple[PacedEngine, PacedWorkflow]:
    """`engine` and `workflow` paced on `cores` (the module docstring)."""
    if not callable(getattr(engine, "step", None)):
        pace = Pace(cores)
        return PacedEngine(engine, pace), PacedWorkflow(workflow, pace)
    streaming = cast(StreamingEngine, engine)  # it has continuous submission (VLLMEngine)
    pace = Pace(cores, streaming.unfinished)
    return PacedStreamingEngine(streaming, pace), PacedWorkflow(workflow, pace)
