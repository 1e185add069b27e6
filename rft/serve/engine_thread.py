"""The one thread that owns `rft serve`'s engine (`EngineWorker`): the explorers' engine (`explorer.engine` and its
settings; rft/engine/), fed token ids, never text (requests are tokenized before they are submitted, off this thread),
or, for a vision-language model's requests with images, `ImagePrompt`s the engine expands with its processor (their
`Served.prompt_tokens` are the engine's expansion).

Contracts:
- Each engine call generates up to `serve.max_batch` waiting requests (one call per distinct sampling settings and
  adapter); the newest weights (the weight store's LATEST or a `weights` announcement, rft/weights/subscriber.py)
  are loaded in place only between calls, so all choices of a request come from one version.
- Several adapters, one base (`serve.adapters`, a LoRA run's name -> its weight store): each adapter is the newest
  version of its store, loaded into the same vLLM engine beside the base between calls
  (rft.engine.VLLMEngine.load_adapter); a request naming one that has no version yet is 503.
- A job whose future is cancelled before the thread takes it is skipped (its deadline passed); one cancelled later
  is generated and its result dropped. An engine failure is a 500 for every request of that call.
- Weights that cannot be loaded (refused, failing to load, any error of the store) leave the engine on the version it
  has, logged, tried again later: never the end of the thread. If the thread ends anyway (an error outside a call),
  `died` says why: `/health` answers 503 with it, and every request queued or submitted since is a 503.
- Streaming: each choice's text split into per-token deltas that add up to it (the engine returns whole
  completions, so the first token's latency is the whole completion's), decoded incrementally: O(tokens) work.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rft.engine import ImagePrompt, SamplingSettings
from rft.serve.requests import ApiError
from rft.weights.subscriber import load_newest_weights

if TYPE_CHECKING:
    from rft.engine import Completion, Engine, Generation

log = logging.getLogger("rft.serve")

REFRESH_S = 0.5  # how often an idle engine thread looks for newer weights


@dataclass
class _Job:
    prompt: list[int] | ImagePrompt
    sampling: SamplingSettings
    stream: bool
    future: concurrent.futures.Future
    adapter: str | None = None


@dataclass
class Served:
    """One request's result: the prompt ids, the generation, and (streaming) each choice's text deltas."""
    prompt_tokens: list[int]
    generation: Generation
    deltas: list[list[str]]


class EngineWorker:
    """The one thread that owns the engine (module docstring); it gets token ids, never text (requests are
    tokenized before they are submitted, off this thread). `newest()` names the newest trusted weights
    (WeightUpdates.newest), None: never reload. `adapters`: name -> newest(above) of each served adapter's store
    (serve.adapters; a vLLM engine with LoRA). `start()` builds the engine with `factory()` in the thread and waits
    for it. A submitted job whose future is cancelled before the thread takes it is skipped (its deadline passed);
    one cancelled later is generated and its result dropped."""

    def __init__(self, factory: Callable[[], Engine], *, newest: Callable[[int], Any] | None = None,
                 max_batch: int = 16, adapters: dict[str, Callable[[int], Any]] | None = None):
        self.factory, self.newest, self.max_batch = factory, newest, max_batch
        self.adapters = adapters or {}
        self.adapter_versions: dict[str, int] = {}  # adapter name -> the version loaded
        self.engine: Engine | None = None
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.reloads = 0
        self.last_call_s = 0.0  # how long the last engine call took (seconds)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.died: str | None = None  # why the thread ended, when it ended other than by `stop`
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def waiting(self) -> int:
        """Jobs submitted and not yet taken by the engine thread."""
        return self.queue.qsize()

    @property
    def version(self) -> int:
        return self.engine.weights_version if self.engine is not None else -1

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def submit(self, prompt: list[int] | ImagePrompt, sampling: SamplingSettings, stream: bool,
               adapter: str | None = None) -> concurrent.futures.Future:
        """Queue one request (`prompt`: token ids, or an image prompt for a vision-language model; `adapter`: the
        served adapter's name, None: the run's own weights); the future holds its `Served`, or an ApiError."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.died is not None:
            future.set_exception(self._dead_error())
            return future
        self.queue.put(_Job(prompt, sampling, stream, future, adapter))
        return future

    def _dead_error(self) -> ApiError:
        return ApiError(503, f"the engine thread died: {self.died}", kind="server_error")

    def stop(self) -> None:
        """End the thread (after the jobs queued before this call); a no-op for a worker never started."""
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.engine = engine = self.factory()
            self._refresh(engine)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(engine)
        except BaseException as e:  # noqa: BLE001  (recorded for /health; the thread ends here)
            self.died = f"{type(e).__name__}: {e}"[:500]
            log.exception("the engine thread died")
            self._fail_queued()
        finally:
            engine.close()

    def _fail_queued(self) -> None:
        """Every job still queued gets the 503 of a dead engine thread."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(self._dead_error())

    def _serve(self, engine: Engine) -> None:
        """The thread's loop: batches of jobs, weights refreshed between calls, until `stop`."""
        while True:
            try:
                first = self.queue.get(timeout=REFRESH_S)
            except queue.Empty:
                self._refresh(engine)
                continue
            if first is None:
                return
            jobs = [first]
            while len(jobs) < self.max_batch:
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.queue.put(None)
                    break
                jobs.append(job)
            self._refresh(engine)
            self._generate(engine, jobs)

    def _refresh(self, engine: Engine) -> None:
        for name, adapter_newest in self.adapters.items():
            found = adapter_newest(self.adapter_versions.get(name, -1))
            if found is not None:
                version, path = found
                try:
                    with_adapters(engine).load_adapter(name, path, version)
                    self.adapter_versions[name] = version
                except Exception as e:  # noqa: BLE001  (keeps serving the version it has; tried again next time)
                    log.warning("adapter %s version %d from %s not loaded: %s", name, version, path, e)
        newest = self.newest
        if newest is None:
            return
        try:
            if load_newest_weights(engine, lambda: newest(engine.weights_version)) is not None:
                self.reloads += 1
        except Exception as e:  # noqa: BLE001  (keeps serving the weights it has; tried again next time)
            log.warning("weights not reloaded: %s: %s", type(e).__name__, e)

    def _generate(self, engine: Engine, jobs: list[_Job]) -> None:
        runnable: dict[tuple[SamplingSettings, str | None, bool], list[_Job]] = {}
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():  # cancelled while it waited (its deadline passed)
                continue
            if job.adapter is not None and job.adapter not in self.adapter_versions:
                job.future.set_exception(ApiError(
                    503, f"the model {job.adapter!r} has no adapter version yet (its weight store has none, or none "
                    "passed the checks); retry later", kind="server_error"))
                continue
            key = (job.sampling, job.adapter, isinstance(job.prompt, ImagePrompt))
            runnable.setdefault(key, []).append(job)
        started = time.monotonic()
        for (sampling, adapter, images), batch in runnable.items():
            try:
                if images:
                    generations = with_images(engine).generate_images([j.prompt for j in batch
                                                                       if isinstance(j.prompt, ImagePrompt)], sampling)
                else:
                    prompts = [j.prompt for j in batch if not isinstance(j.prompt, ImagePrompt)]
                    generations = (engine.generate(prompts, sampling) if adapter is None
                                   else with_adapters(engine).generate(prompts, sampling, adapter=adapter))
            except Exception as e:  # the engine failed: every request of the call gets a 500
                log.exception("generation failed")
                for job in batch:
                    job.future.set_exception(ApiError(500, f"generation failed: {e}", kind="server_error"))
                continue
            for job, generation in zip(batch, generations, strict=True):
                deltas = [text_deltas(engine, c) for c in generation.completions] if job.stream else []
                job.future.set_result(Served(list(generation.prompt_token_ids), generation, deltas))
        self.last_call_s = time.monotonic() - started


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that serves LoRA adapters beside its base weights (rft.engine.VLLMEngine)."""

    def load_adapter(self, name: str, path: str | os.PathLike, version: int) -> object: ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, *,
                 adapter: str | None = None) -> list[Generation]: ...


def with_adapters(engine: Engine) -> AdapterEngine:
    """`engine` as an engine that serves adapters; TypeError for one that cannot (serve.adapters needs vLLM)."""
    if not isinstance(engine, AdapterEngine):
        raise TypeError(f"{type(engine).__name__} serves no adapters (serve.adapters needs explorer.engine vllm)")
    return engine


@runtime_checkable
class ImageEngine(Protocol):
    """An engine that generates from image prompts (rft.engine.VisionEngine: both engines on a VLM)."""

    def generate_images(self, prompts: Sequence[ImagePrompt], sampling: SamplingSettings) -> list[Generation]: ...


def with_images(engine: Engine) -> ImageEngine:
    """`engine` as an engine that takes image prompts; TypeError for one that cannot."""
    if not isinstance(engine, ImageEngine):
        raise TypeError(f"{type(engine).__name__} generates from no image prompts")
    return engine


class Decodes(Protocol):
    """What `text_deltas` needs of an engine: token ids -> text (TokenizerMixin.decode)."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


CLEAN_WINDOW = 4  # tokens a decode window grows to before it restarts nearer its end (when it ends a character)
MAX_WINDOW = 8  # ... before it restarts CONTEXT tokens back even mid-character (or the rest goes as one piece)
CONTEXT = 4  # a UTF-8 character's bytes span at most 4 tokens
INCOMPLETE = "\ufffd"  # what a tokenizer decodes the bytes of a cut character to


def text_deltas(engine: Decodes, completion: Completion) -> list[str]:
    """Per-token text deltas that add up to the completion's text, decoded incrementally: each token decodes a
    window of at most MAX_WINDOW tokens whose first ones were sent before (the context that keeps a tokenizer's
    leading-space rule), so a T-token answer costs O(T) decoded tokens on the engine thread, not O(T^2). A character
    whose bytes are still coming (a trailing U+FFFD) waits for them. Where a piece would not continue the text (a
    stop string cut it, a tokenizer that decodes differently in windows), the rest of the text is one piece."""
    text, ids = completion.text, completion.token_ids
    pieces: list[str] = []
    sent = 0  # characters of `text` in `pieces`
    # the window is ids[start:k]; its text after `lead` garbage characters (the tail of a character cut at `start`)
    # begins with `done` characters already sent
    start = lead = done = 0
    for k in range(1, len(ids) + 1):
        if sent == len(text):
            break
        window = engine.decode(ids[start:k])[lead:]
        complete = window.rstrip(INCOMPLETE)
        if len(complete) > done:
            piece = complete[done:done + len(text) - sent]
            if not text.startswith(piece, sent):
                break
            pieces.append(piece)
            sent, done = sent + len(piece), len(complete)
        pending = len(complete) < len(window)  # a character whose bytes are still coming
        if k - start >= (MAX_WINDOW if pending else CLEAN_WINDOW):
            restarted = _restart(engine, ids, k, text[:sent], pending)
            if restarted is not None:
                start, lead, done = restarted
            elif k - start >= MAX_WINDOW:
                break
    if sent < len(text):
        pieces.append(text[sent:])
    return pieces


def _restart(engine: Decodes, ids: Sequence[int], k: int, sent: str, pending: bool) -> tuple[int, int, int] | None:
    """A shorter window ending at token k, as (start, lead, done) for text_deltas: its text after the leading garbage
    must be the end of what was `sent`; with a character `pending`, it starts CONTEXT tokens back, so that character's
    first bytes are in it. None: no such window."""
    for p in [k - CONTEXT] if pending else range(k - 1, k - CONTEXT - 1, -1):
        context = engine.decode(ids[max(0, p):k])
        lead = len(context) - len(context.lstrip(INCOMPLETE))
        body = context[lead:].rstrip(INCOMPLETE)
        if (body or not context) and sent.endswith(body):
            return max(0, p), lead, len(body)
    return None
