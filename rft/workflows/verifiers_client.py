"""verifiers' env-server wire (0.4.0, v1), spoken from rft's venv without importing verifiers: ZMQ DEALER to the
server's ROUTER, msgpack payloads.

Request: frames [request_id, method, msgpack(payload)], method `health`, `run` or `cancel`. A `run` payload is
{task_data, client, model, sampling} (verifiers' RunRequest: the task's dumped TaskData, an OpenAI-compatible
ClientConfig, the model name, sampling). Replies: frames [request_id, kind, data]; `delta` frames stream a run's
traces as they grow (verifiers/v1/serve/delta.py: a trace is opened once with its header, then list fields are
appended and scalar fields replaced), and one `reply` ends the request: {success, error, head, traces}, `head` the
episode without traces, `traces` the finished traces' ids and node / call counts that the assembly must match.

`run_episodes` sends every run at once and waits for all of them under one deadline; each outcome is an episode
(a dict shaped like verifiers' WireEpisode) or an `EpisodeFailure` naming its class: `timeout` (no reply by the
deadline: the run is cancelled on the server), `environment` (the server failed the request, stopped answering
its health checks, or its process exited). Frames are size-bounded (ZMQ_MAXMSGSIZE) and malformed ones are
counted and dropped, never raised into the caller.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

MAX_FRAME_BYTES = 256 << 20
LIST_FIELDS = ("nodes", "calls", "errors", "extra_usage", "request_rewrites", "response_rewrites")


@dataclass(frozen=True)
class EpisodeFailure:
    """Why a run has no episode: `kind` one of rft.schema.FAILURE_CLASSES (`environment`, `timeout`)."""
    kind: str
    reason: str


@dataclass
class _Run:
    request_id: str
    traces: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcome: dict[str, Any] | EpisodeFailure | None = None


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def apply_delta(traces: dict[str, dict[str, Any]], delta: Any) -> None:
    """Apply one streamed trace delta to the assembly `traces` (trace id -> the trace as a dict); ValueError for a
    delta that does not fit it."""
    if not isinstance(delta, dict) or not isinstance(delta.get("trace"), str):
        raise ValueError("a delta without its trace id")
    trace_id = delta["trace"]
    if delta.get("discard"):  # a retried attempt's trace
        traces.pop(trace_id, None)
        return
    trace = traces.get(trace_id)
    if trace is None:
        if not isinstance(delta.get("open"), dict):
            raise ValueError(f"trace {trace_id}: its first delta has no header")
        trace = traces[trace_id] = {**delta["open"], **{name: [] for name in LIST_FIELDS}}
    for index, links in (delta.get("links") or {}).items():
        trace["nodes"][int(index)].setdefault("semantic_parents", []).extend(links)
    for name in LIST_FIELDS:
        items = delta.get(name)
        if items is not None:
            if not isinstance(items, list):
                raise ValueError(f"trace {trace_id}: {name} is not a list")
            trace[name].extend(items)
    scalars = delta.get("set") or {}
    if not isinstance(scalars, dict):
        raise ValueError(f"trace {trace_id}: `set` is not a mapping")
    trace.update({k: v for k, v in scalars.items() if k not in LIST_FIELDS})


def finish_episode(traces: dict[str, dict[str, Any]], reply: dict[str, Any]) -> dict[str, Any]:
    """The episode a successful reply ends: its head with the assembled traces in the server's order; ValueError
    when the assembly does not match the reply's counts (a lost delta)."""
    head = reply.get("head")
    if not isinstance(head, dict):
        raise ValueError("the reply has no episode head")
    ordered = []
    for summary in reply.get("traces") or []:
        trace = traces.get(str(summary.get("id"))) if isinstance(summary, dict) else None
        if trace is None:
            raise ValueError(f"the episode is missing trace {summary!r}")
        if len(trace["nodes"]) != summary.get("nodes") or len(trace["calls"]) != summary.get("calls"):
            raise ValueError(f"trace {summary['id']}: assembled {len(trace['nodes'])} nodes / {len(trace['calls'])} "
                             f"calls, the server reports {summary.get('nodes')} / {summary.get('calls')}")
        ordered.append(trace)
    return {**head, "traces": ordered}


class EnvServerClient:
    """One DEALER connection to a verifiers env server at `address` (tcp://host:port)."""

    def __init__(self, address: str):
        self.address = address
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.socket.connect(address)
        self.malformed = 0  # frames dropped: not 3 frames, not msgpack, or not fitting their run
        self._health: dict[str, bool] = {}
        self._runs: dict[str, _Run] = {}  # the runs in flight, by request id

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def _send(self, method: str, payload: dict[str, Any]) -> str:
        request_id = uuid.uuid4().hex
        self.socket.send_multipart([request_id.encode(), method.encode(),
                                    msgpack.packb(payload, use_bin_type=True)])
        return request_id

    def health(self, timeout_s: float) -> bool:
        """Whether the server answers a health request within `timeout_s`."""
        request_id = self._send("health", {})
        self._health[request_id] = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._health.get(request_id):
            self._receive(min(0.1, max(0.0, deadline - time.monotonic())))
        return bool(self._health.pop(request_id, False))

    def _receive(self, timeout_s: float) -> bool:
        """Handle the frames that arrive within `timeout_s`; True when any did."""
        got = False
        while self.socket.poll(int(timeout_s * 1000) if not got else 0):
            got = True
            frames = self.socket.recv_multipart()
            try:
                self._handle(frames)
            except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException):
                self.malformed += 1
        return got

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"{len(frames)} frames")
        request_id, kind, data = frames[0].decode(), frames[1], frames[2]
        if request_id in self._health:
            self._health[request_id] = kind == b"reply" and bool(_unpack(data).get("success"))
            return
        run = self._runs.get(request_id)
        if run is None or run.outcome is not None:
            return  # a cancelled run's late frames
        if kind == b"delta":
            apply_delta(run.traces, _unpack(data))
            return
        reply = _unpack(data)
        if not isinstance(reply, dict):
            raise ValueError("the reply is not a mapping")
        if not reply.get("success"):
            run.outcome = EpisodeFailure("environment", f"the env server failed the run: {reply.get('error')}")
            return
        try:
            run.outcome = finish_episode(run.traces, reply)
        except ValueError as e:
            run.outcome = EpisodeFailure("environment", f"the episode does not assemble: {e}")

    def run_episodes(self, requests: Sequence[dict[str, Any]], *, timeout_s: float, health_every_s: float = 5.0,
                     health_timeout_s: float = 5.0, alive: Callable[[], bool] = lambda: True,
                     ) -> list[dict[str, Any] | EpisodeFailure]:
        """Run every request (a RunRequest payload) at once; their outcomes in request order (module doc). While
        nothing arrives for `health_every_s`, the server must answer a health check within `health_timeout_s` and
        `alive()` must hold (e.g. its process runs), else every run still open fails as `environment`."""
        runs = {(rid := self._send("run", request)): _Run(rid) for request in requests}
        self._runs = runs
        order = list(runs)
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while any(r.outcome is None for r in runs.values()):
            now = time.monotonic()
            if now >= deadline:
                for run in runs.values():
                    if run.outcome is None:
                        run.outcome = EpisodeFailure("timeout", f"no episode within {timeout_s:g} s")
                        self._send("cancel", {"request_id": run.request_id})
                break
            if self._receive(min(0.2, deadline - now)):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= health_every_s:
                down = None if alive() else "its process exited"
                if down is None and not self.health(health_timeout_s):
                    down = f"it did not answer a health check within {health_timeout_s:g} s"
                if down:
                    for run in runs.values():
                        if run.outcome is None:
                            run.outcome = EpisodeFailure("environment", f"the env server at {self.address} is down: "
                                                         f"{down}")
                quiet_since = time.monotonic()
        self._runs = {}
        return [outcome for rid in order if (outcome := runs[rid].outcome) is not None]  # all set above
