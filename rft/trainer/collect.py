"""Who collects a run's claim-checked parts, and up to where (`records.collect`; the mechanics are
rft/transport/collect.py; docs/operations.md, "Collecting claim-checked parts").

- `retention`: a sweep of the claim store (`collect_retention`).
- `committed`: the records of the run's experiences topic that every reader has passed. The trainer's position is
  what its checkpoints say it will never read again: per partition, the lowest of each kept checkpoint's feed
  offset, the offset of each group its staleness pool holds, and of each replay-buffer candidate (both are re-read
  by offset after a restart); no checkpoint: nothing is passed. Each group of `records.readers` has passed its
  committed offset (none committed: nothing). Collection starts where the last one stopped, kept in
  `<run dir>/records_collected.json` (written after the deletions; without it, at the topic's beginning: records
  read twice, never an object deleted early). The demonstrations and served topics, when they exist, are read whole
  and protect what they name (payloads are shared by content).
`collect_run(cfg, transport)` does one collection; `Collector` runs them off the trainer's critical path: after a
checkpoint commit, in a background thread (one at a time; a retention sweep at most every RETENTION_SWEEP_S). An
offline trainer (run.mode offline) never collects: the topic it replays is not its own run's."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from rft.processes import write_durably
from rft.run.config import Config
from rft.run.records import claim_store
from rft.transport import Transport, parse_offset_key
from rft.transport.collect import RECENT_S, CollectReport, collect_committed, collect_retention

log = logging.getLogger(__name__)

STATE_FILE = "records_collected.json"
RETENTION_SWEEP_S = 600.0  # the trainer sweeps a retention store at most this often


def trainer_position(run_dir: str | os.PathLike, topic: str) -> dict[str, int] | None:
    """Per partition of `topic`, the lowest offset the trainer may still read after a restart from any checkpoint it
    keeps (the module docstring); None without a complete checkpoint."""
    floor: dict[str, int] | None = None
    for state_file in sorted((Path(run_dir) / "checkpoints").glob("step_*/trainer_state.json")):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as e:  # being replaced, or pruned while read: the others still bound it
            log.warning("collect: %s unreadable (%s); skipped", state_file, e)
            continue
        feed = state.get("feed", {})
        needed = {k: int(v) for k, v in feed.get("offsets", {}).items()}
        again = [(h["position"], h["offset"]) for h in feed.get("held", [])]
        again += [(c["position"], c["offset"]) for c in state.get("replay_buffer", {}).get("candidates", [])]
        for position, offset in again:
            needed[position] = min(needed.get(position, int(offset)), int(offset))
        mine = {k: v for k, v in needed.items() if parse_offset_key(k).topic == topic}
        floor = mine if floor is None else {k: min(v, mine.get(k, 0)) for k, v in floor.items()}
    return floor


def readers_position(transport: Transport, topic: str, groups: list[str], partitions: list[str]) -> dict[str, int]:
    """Per partition, the lowest committed offset of `groups` (0 where a group committed nothing)."""
    floor: dict[str, int] = {}
    if not groups:
        return floor
    admin = transport.admin()
    try:
        for group in groups:
            committed = admin.group_offsets(group)
            for p in partitions:
                floor[p] = min(floor.get(p, committed.get(p, 0)), committed.get(p, 0))
    finally:
        admin.close()
    return floor


def _load_start(path: Path, topic: str) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
        return {str(k): int(v) for k, v in data["offsets"].items()} if data.get("topic") == topic else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("collect: %s unreadable (%s); starting at the topic's beginning", path, e)
        return {}


def _save_start(path: Path, topic: str, offsets: dict[str, int]) -> None:
    write_durably(path, json.dumps({"topic": topic, "offsets": offsets}))


def collect_run(cfg: Config, transport: Transport | None, *, dry_run: bool = False,
                recent_s: float = RECENT_S) -> CollectReport:
    """One collection of the run's claim store as `records.collect` says (the module docstring); `transport` (the
    run's broker) is needed by `committed` only; `recent_s`: rule 3 of rft/transport/collect.py."""
    store = claim_store(cfg)
    if cfg.records.collect == "retention":
        return collect_retention(store, retention_s=cfg.records.retention_hours * 3600, dry_run=dry_run)
    if transport is None:
        raise ValueError("records.collect committed reads the experiences topic: it needs the run's transport")
    topic = cfg.topic("experiences")
    source = transport.source(client_id=f"{cfg.run.name}-records-collect")
    try:
        partitions = source.partitions(topic)
        passed = trainer_position(cfg.run_dir, topic) or {}
        passed = {p: passed.get(p, 0) for p in partitions}
        for p, offset in readers_position(transport, topic, list(cfg.records.readers), partitions).items():
            passed[p] = min(passed[p], offset)
        state = Path(cfg.run_dir) / STATE_FILE
        start = _load_start(state, topic)
        admin = transport.admin()
        try:
            existing = set(admin.list_topics())
        finally:
            admin.close()
        protect = [t for t in (cfg.topic("demonstrations"), cfg.topic("served")) if t in existing]
        report = collect_committed(store, source, topic, passed=passed, start=start, protect=protect,
                                   recent_s=recent_s, dry_run=dry_run)
    finally:
        source.close()
    if not dry_run and report.collected_to != start:
        _save_start(state, topic, report.collected_to)
    return report


def collection_warnings(cfg: Config) -> list[str]:
    """What `rft validate` says about `records.collect` in `cfg`: committed collection and a later offline replay of
    the topic do not go together."""
    if cfg.records.collect != "committed" or cfg.records.claim_threshold_bytes == 0:
        return []
    readers = f" and {', '.join(cfg.records.readers)}" if cfg.records.readers else ""
    return [f"records.collect committed deletes a claim-checked part once the trainer{readers} committed past "
            f"every record naming it: an offline replay of {cfg.topic('experiences')} afterwards (rft replay, "
            "run.mode offline) dead-letters those groups; keep records.collect retention (records.retention_hours "
            "at least the topic's retention) to replay it, or name the replay's consumer group in records.readers"]


class Collector:
    """The trainer's collections, off its critical path: `after_checkpoint()` starts one in a background thread
    unless one is running (or, for retention, one ran less than RETENTION_SWEEP_S ago); a failure is logged, never
    raised (the next checkpoint tries again). `close()` waits for the one running."""

    def __init__(self, cfg: Config, transport: Transport):
        self.cfg, self.transport = cfg, transport
        self.enabled = cfg.run.mode != "offline" and cfg.records.claim_threshold_bytes > 0
        self.last: CollectReport | None = None
        self.failures = 0
        self._thread: threading.Thread | None = None
        self._last_start = -float("inf")

    def after_checkpoint(self) -> bool:
        """Start a collection if one is due; whether it started."""
        if not self.enabled or (self._thread is not None and self._thread.is_alive()):
            return False
        if self.cfg.records.collect == "retention" and time.monotonic() - self._last_start < RETENTION_SWEEP_S:
            return False
        self._last_start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rft-records-collect", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        try:
            self.last = collect_run(self.cfg, self.transport)
            log.info("%s", self.last.summary())
        except Exception as e:  # a store or broker failure: logged; the next checkpoint's collection tries again
            self.failures += 1
            log.warning("records.collect %s failed: %s: %s", self.cfg.records.collect, type(e).__name__, e)

    def close(self, timeout_s: float = 60.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

