"""The explorer side of weight synchronisation (ordering: rft/weights/__init__.py): `WeightUpdates` knows the
newest version (the store's LATEST or an announcement, never going back), `PushMembership` takes part in the
trainer's push group, `load_newest_weights` reloads an engine in place.

Trust (docs/operations.md, "Trust"): the control topic is not trusted. A `weights` announcement's path is loaded only if
it is the announced version's location in this explorer's own weight store (`local`: a directory store's directory once
symlinks are resolved, where a path that does not exist here names the same version in this store: the trainer's mount
point may differ; a bucket store's URL of that version), and only after the version matches its manifest (a directory
store: `verify_version`, sizes always, SHA-256 checksums with `sync.verify`; a bucket store: every file's size and
SHA-256 as this host's cache fetches it, rft.weights.cache), and only a version of the store's lineage (its manifest's,
and the announcement's when it names one: rft.weights.store, "Lineage"). A push-group announcement is joined only if
its address is allowed (`PushAllowList`: `sync.push_allow`, else `sync.push_host`, else this host). A refused
announcement or version is logged (one line), counted (`WeightUpdates.refused`, in the explorer's heartbeat and
metrics) and never tried again; the engine keeps its current weights."""
from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rft.transport.control import ControlView, PushGroup
from rft.weights.store import WeightStoreError

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.weights.config import SyncConfig
    from rft.weights.stores import VersionStore

log = logging.getLogger(__name__)

RELOAD_TRIES = 3


class ControlSource(Protocol):
    """Where announcements are read: a transport source assigned to the control topic, positioned where they
    should be read (rft.transport.RecordSource); `poll` returns records with `.value` and `.headers`."""

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> Iterable: ...
    def close(self) -> None: ...


class WeightUpdates:
    """The newest weights version this explorer knows of and trusts: the store's LATEST or a `weights` announcement
    on the control topic, whichever is newer (module docstring: trust); and, for the push path, what `view` (a
    ControlView) says of push groups. `verify`: check checksums too (sizes are always checked). `refused` counts
    the versions and announcements refused. Not thread-safe."""

    def __init__(self, store: VersionStore, control_source: ControlSource, *, verify: bool = True):
        self.store, self.control_source, self.verify = store, control_source, verify
        self.view = ControlView()
        self.refused = 0
        self._checked: dict[tuple[int, str], Path | None] = {}  # (version, path#lineage) -> resolved, None: refused

    def read_announcements(self) -> None:
        self.view.apply_records(self.control_source.poll(timeout_s=0))

    def newest(self, above: int = -1) -> tuple[int, Path] | None:
        """(version, path) of the newest version known that is newer than `above` and passes the checks (module
        docstring), or None. A candidate that fails them is refused (`refuse`) and the next older one is taken."""
        self.read_announcements()
        announced = self.view.announced
        known = [v for v in (self.store.latest(), announced and (announced.version, announced.path, announced.lineage))
                 if v]
        for version, path, *lineage in sorted(known, key=lambda v: v[0], reverse=True):
            if version <= above:
                break
            trusted = self._trusted(version, path, *lineage)
            if trusted is not None:
                return version, trusted
        return None

    def refuse(self, what: str, reason: object) -> None:
        """Log one line and count a refused version or announcement."""
        self.refused += 1
        log.warning("refused %s: %s (refused so far: %d)", what, reason, self.refused)

    def _trusted(self, version: int, location: Path | str, lineage: str = "") -> Path | None:
        """The local directory of `version` announced at `location` (for `lineage`, when the announcement names one)
        if the store trusts it (VersionStore.local) and it is of that lineage."""
        key = (version, f"{location}#{lineage}")
        if key in self._checked:
            return self._checked[key]
        try:
            resolved = self.store.local(version, location, checksums=self.verify)
            pinned = self.store.pin.lineage
            if lineage and pinned is not None and lineage != pinned.id:
                raise WeightStoreError(f"announced for lineage {lineage[:12]}, the store's is {pinned.describe()}")
        except FileNotFoundError:
            return None  # not there (yet, or any more: garbage-collected): not a refusal, looked at again
        except (WeightStoreError, TypeError, ValueError) as e:  # a version or path no store holds: never fatal
            self.refuse(f"weights version {version} at {location!s:.200}", e)
            resolved = None
        self._checked[key] = resolved
        return resolved

    def close(self) -> None:
        self.control_source.close()


class PushAllowList:
    """The push-group addresses an explorer may join: `hosts` (names or addresses, compared by every address they
    resolve to) and `port` (0: any). A host that does not resolve is no address at all."""

    def __init__(self, hosts: Iterable[str], port: int = 0):
        self.hosts, self.port = sorted(set(hosts)), port
        self.addresses = set().union(*(_addresses(h) for h in self.hosts)) if self.hosts else set()

    @classmethod
    def for_sync(cls, sync: SyncConfig) -> PushAllowList:
        """`sync.push_allow`, else `[sync.push_host]`, else this host (its name, its addresses and loopback: a
        one-machine run); the port must be `sync.push_port` when that is set."""
        hosts = list(sync.push_allow) or ([sync.push_host] if sync.push_host else _this_host_names())
        return cls(hosts, sync.push_port)

    def problem(self, spec: PushGroup) -> str | None:
        """Why `spec`'s address may not be joined (None: it may)."""
        if self.port and spec.port != self.port:
            return f"port {spec.port} is not sync.push_port {self.port}"
        if not 0 < spec.port < 65536:
            return f"port {spec.port} is not a TCP port"
        announced = _addresses(spec.host)
        if spec.host in self.hosts or (announced and announced <= self.addresses):
            return None
        return (f"host {spec.host!r} is not allowed (sync.push_allow / sync.push_host; allowed: "
                f"{', '.join(self.hosts)})")


def _addresses(host: str) -> set[str]:
    """Every IP address `host` names (itself when it is one); empty when it does not resolve."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None) if isinstance(info[4][0], str)}
    except (OSError, UnicodeError):
        return set()


def _this_host_names() -> list[str]:
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    try:
        names.append(socket.gethostbyname(socket.gethostname()))  # what the trainer announces by default
    except OSError:
        pass
    return names


class PushMembership:
    """This explorer's part in the trainer's push group (rft.weights, push contract): join a newly announced
    group, take part in every version pushed in it, leave it when the trainer abandons it. Any failure here
    makes the explorer give the group up and fall back to pulling from the weight store. `allowed`: which
    announced addresses may be joined (None: any; the explorer passes `PushAllowList.for_sync`); a group at any
    other address, or for another lineage than the weight store's, is refused (`updates.refuse`) and never joined."""

    def __init__(self, engine: Engine, updates: WeightUpdates, *, allowed: PushAllowList | None = None):
        self.engine, self.updates, self.allowed = engine, updates, allowed
        self.group_id: str | None = None
        self.received = 0  # versions received in the current group
        self.given_up: set[str] = set()  # groups this explorer left or could not join
        # False after a receive failed part-way: the engine may hold part of that version (vLLM's layer-wise
        # reload leaves the layers it had not reached on the meta device), so it must not generate until a whole
        # version is loaded again (`loaded`): the trainer redoes the failed version by pull, or pushes a new one
        self.engine_whole = True

    def sync(self) -> list[int]:
        """Join / receive as the announcements say; returns the versions received now, in order."""
        self.updates.read_announcements()
        view = self.updates.view
        if self.group_id is not None and self.group_id in view.abandoned:
            self._leave("the trainer abandoned the push group")
        announced = view.push_group
        if announced and announced.group_id not in (self.group_id, *view.abandoned, *self.given_up):
            problem = self.allowed.problem(announced) if self.allowed is not None else None
            problem = problem or self._lineage_problem(announced)
            if problem is None:
                self._join(announced)
            else:
                self.given_up.add(announced.group_id)
                self.updates.refuse(f"push group {announced.group_id} at {announced.host}:{announced.port}", problem)
        if self.group_id is None:
            return []
        received = []
        for expected in view.pushed.get(self.group_id, [])[self.received:]:
            try:
                version = self.engine.receive_pushed_weights()
            except Exception as e:  # gloo / NCCL / vLLM errors: fall back to the pull path
                self.engine_whole = False
                self._leave(f"receiving version {expected} failed: {e}; generating again once a whole version "
                            "is loaded")
                break
            self.engine_whole = True
            self.received += 1
            if version != expected:
                self._leave(f"received version {version}, the trainer announced {expected}")
                break
            received.append(version)
        return received

    def _lineage_problem(self, spec: PushGroup) -> str | None:
        """Why a push group announced for another lineage than the weight store's may not be joined (None: it may;
        an announcement that names none, or a store without one, is not checked)."""
        store = self.updates.store
        try:
            expected = store.pin.expect(store.read_lineage(), str(store.root))
        except WeightStoreError as e:
            return str(e)
        if spec.lineage and expected and spec.lineage != expected:
            return f"announced for lineage {spec.lineage[:12]}, the weight store's is {expected[:12]}"
        return None

    def loaded(self) -> None:
        """A whole version was loaded by pull: the engine is usable again."""
        self.engine_whole = True

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


def load_newest_weights(engine: Engine, newest: Callable[[], tuple[int, Path] | None], *,
                        tries: int = RELOAD_TRIES,
                        load: Callable[[Path, int], None] | None = None) -> tuple[int, float] | None:
    """Reload `engine` in place with the version `newest()` names when it is newer than the engine's; returns
    (version, seconds) after a reload, None when the engine is current. Retries, reading `newest()` again (a version
    can be garbage-collected between reading LATEST and loading it); RuntimeError when all tries fail. `load(path,
    version)` loads (default `engine.load_weights`; the continuous explorer's in-flight updates pass their own)."""
    load = load or engine.load_weights
    for attempt in range(tries):
        found = newest()
        if found is None or found[0] <= engine.weights_version:
            return None
        version, path = found
        started = time.monotonic()
        try:
            load(path, version)
        except Exception as e:  # vLLM wraps worker errors in its own types
            log.warning("loading weights version %d from %s failed (try %d/%d): %s", version, path, attempt + 1,
                        tries, e)
            time.sleep(0.5)
            continue
        seconds = round(time.monotonic() - started, 3)
        log.info("loaded weights version %d in %.2f s", version, seconds)
        return version, seconds
    raise RuntimeError(f"could not load weights version {version} from {path} after {tries} tries")
