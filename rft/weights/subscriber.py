"""The explorer side of weight synchronisation (ordering: rft/weights/__init__.py): `WeightUpdates` knows the
newest version (the store's LATEST or an announcement, never going back), `PushMembership` takes part in the
trainer's push group, `load_newest_weights` reloads an engine in place."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from rft.control import ControlView, PushGroup

if TYPE_CHECKING:
    from rft.explorer.engine import Engine
    from rft.weights.store import WeightStore

log = logging.getLogger(__name__)

RELOAD_TRIES = 3


class ControlSource(Protocol):
    """Where announcements are read: a transport source assigned to the control topic, positioned where they
    should be read (rft.transport.RecordSource); `poll` returns records with `.value` and `.headers`."""

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> Iterable: ...
    def close(self) -> None: ...


class WeightUpdates:
    """The newest weights version this explorer knows of: the store's LATEST or a `weights` announcement on the
    control topic, whichever is newer; and, for the push path, what `view` (a ControlView) says of push groups.
    Not thread-safe."""

    def __init__(self, store: "WeightStore", control_source: ControlSource):
        self.store, self.control_source = store, control_source
        self.view = ControlView()

    def read_announcements(self) -> None:
        self.view.apply_records(self.control_source.poll(timeout_s=0))

    def newest(self) -> tuple[int, Path] | None:
        """(version, readable path) of the newest version known, or None before the first."""
        self.read_announcements()
        known = [v for v in (self.store.latest(), self._announced_here()) if v is not None]
        return max(known, key=lambda v: v[0]) if known else None

    def _announced_here(self) -> tuple[int, Path] | None:
        """The announced version where this host can read it: the announced path, else the same version
        in this explorer's own store (the announcer's filesystem may be mounted elsewhere)."""
        announced = self.view.announced
        if announced is None:
            return None
        for candidate in (Path(announced.path), self.store.path(announced.version)):
            if candidate.is_dir():
                return announced.version, candidate
        return None

    def close(self) -> None:
        self.control_source.close()


class PushMembership:
    """This explorer's part in the trainer's push group (rft.weights, push contract): join a newly announced
    group, take part in every version pushed in it, leave it when the trainer abandons it. Any failure here
    makes the explorer give the group up and fall back to pulling from the weight store."""

    def __init__(self, engine: "Engine", updates: WeightUpdates):
        self.engine, self.updates = engine, updates
        self.group_id: str | None = None
        self.received = 0  # versions received in the current group
        self.given_up: set[str] = set()  # groups this explorer left or could not join

    def sync(self) -> list[int]:
        """Join / receive as the announcements say; returns the versions received now, in order."""
        self.updates.read_announcements()
        view = self.updates.view
        if self.group_id is not None and self.group_id in view.abandoned:
            self._leave("the trainer abandoned the push group")
        announced = view.push_group
        if announced and announced.group_id not in (self.group_id, *view.abandoned, *self.given_up):
            self._join(announced)
        if self.group_id is None:
            return []
        received = []
        for expected in view.pushed.get(self.group_id, [])[self.received:]:
            try:
                version = self.engine.receive_pushed_weights()
            except Exception as e:  # gloo / NCCL / vLLM errors: fall back to the pull path
                self._leave(f"receiving version {expected} failed: {e}")
                break
            self.received += 1
            if version != expected:
                self._leave(f"received version {version}, the trainer announced {expected}")
                break
            received.append(version)
        return received

    def _join(self, spec: PushGroup) -> None:
        if self.group_id is not None:
            self._leave("a new push group was announced")
        try:
            self.engine.join_push_group(spec.body())
        except Exception as e:
            log.warning("could not join push group %s (pulling instead): %s", spec.group_id, e)
            self.given_up.add(spec.group_id)
            return
        self.group_id, self.received = spec.group_id, 0
        log.info("joined push group %s", self.group_id)

    def _leave(self, reason: str) -> None:
        log.warning("leaving push group %s: %s", self.group_id, reason)
        self.given_up.add(str(self.group_id))
        self.group_id = None
        try:
            self.engine.leave_push_group()
        except Exception:
            pass


def load_newest_weights(engine: "Engine", newest: Callable[[], tuple[int, Path] | None], *,
                        tries: int = RELOAD_TRIES) -> tuple[int, float] | None:
    """Reload `engine` in place with the version `newest()` names when it is newer than the engine's; returns
    (version, seconds) after a reload, None when the engine is current. Retries, reading `newest()` again (a version
    can be garbage-collected between reading LATEST and loading it); RuntimeError when all tries fail."""
    for attempt in range(tries):
        found = newest()
        if found is None or found[0] <= engine.weights_version:
            return None
        version, path = found
        started = time.monotonic()
        try:
            engine.load_weights(path, version)
        except Exception as e:  # vLLM wraps worker errors in its own types
            log.warning("loading weights version %d from %s failed (try %d/%d): %s", version, path, attempt + 1,
                        tries, e)
            time.sleep(0.5)
            continue
        seconds = round(time.monotonic() - started, 3)
        log.info("loaded weights version %d in %.2f s", version, seconds)
        return version, seconds
    raise RuntimeError(f"could not load weights version {found[0]} from {found[1]} after {tries} tries")
