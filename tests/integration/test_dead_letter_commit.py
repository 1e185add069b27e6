"""A trainer killed right after a checkpoint commits loses no dead letter (rft/trainer/main.py: the dead letters are
flushed and checked before the checkpoint commits; rft.transport.DeadLetter.flush).

A real trainer loop (the stand-in policy of tests/unit/test_trainer_loop.py) in a child process, on the session's
broker, takes a malformed record and a step's groups, commits its checkpoint past them, and is SIGKILLed at once (the
commit is wrapped: the real one, then the kill). Its dead-letter producer lingers 60 s, as a slow broker would make it:
without the flush the dead letter is still in the producer's buffer at the kill, and the record, consumed by the
checkpoint, is gone for good. With it, the dead letter is on the topic before `latest` moves. And a dead letter
whose send failed stops the checkpoint (the trainer's loop over the in-memory transport): the record is read again.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import pytest

from rft.run.config import config_from_dict
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport import TransportError, connect
from rft.transport.base import HEADER_ORIGIN
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import RunTopics, create_run_topics
from tests.records import make_group, read_topic, send_groups
from tests.unit.test_trainer_loop import StandInPolicy, fill, make_config

CHILD = """
import json, os, signal, sys
from rft.run.config import config_from_dict
from rft.trainer.checkpoint import CheckpointDir
from rft.trainer.main import Trainer, open_trainer_io
from rft.transport import connect
from tests.unit.test_trainer_loop import StandInPolicy

cfg = config_from_dict(json.loads(sys.argv[1]))
transport = connect(cfg.kafka)
sink = transport.sink
transport.sink = lambda client_id="rft", linger_ms=5: sink(
    client_id=client_id, linger_ms=60_000 if client_id.endswith("-dlq") else linger_ms)
commit = CheckpointDir.commit

def commit_then_die(self, step):
    commit(self, step)
    os.kill(os.getpid(), signal.SIGKILL)

CheckpointDir.commit = commit_then_die
trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                  run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=StandInPolicy([]),
                  open_io=lambda feed_state, replay_state: open_trainer_io(
                      cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
trainer.run()
"""


def test_a_trainer_killed_after_its_checkpoint_commits_loses_no_dead_letter(tmp_path, bootstrap):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 128}))
    name = f"dlq-commit-{uuid.uuid4().hex[:8]}"
    raw = {"run": {"name": name, "mode": "off_policy", "max_staleness": 1, "max_steps": 1,
                   "output_dir": str(tmp_path), "groups_per_step": 2},
           "model": {"path": str(model)}, "kafka": {"bootstrap_servers": bootstrap},
           "trainer": {"micro_batch_size": 4, "checkpoint_every": 1, "poll_timeout_s": 30.0},
           "monitor": {"progress": False}}
    cfg = config_from_dict(raw)
    transport = connect(cfg.kafka)
    create_run_topics(RunTopics.of(cfg), cfg.kafka, transport)
    sink = transport.sink()
    send_groups(sink, cfg.topic("experiences"), [b"\x93garbage", make_group(name, 0), make_group(name, 1)])
    sink.flush()
    sink.close()

    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw)], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    state = json.loads((cfg.run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["feed"]["offsets"][f"{cfg.topic('experiences')}:0"] == 3  # the malformed record is consumed

    dead = read_topic(transport, cfg.topic("dead_letter"), timeout_s=5.0)
    origins = [dict(m.headers).get(HEADER_ORIGIN) for m in dead]
    assert origins == [f"{cfg.topic('experiences')}:0@0".encode()], origins


class FailingSends:
    """A sink whose sends fail after they return (a broker that refuses the record: the producer's IO thread calls
    the future's errback), as the Kafka sink's do; everything else is the wrapped in-memory sink's."""

    def __init__(self, sink):
        self.sink = sink

    def send(self, *args, **kwargs):
        class Failed:
            def get(self, timeout=None):
                raise TransportError("refused by the broker")

            def add_errback(self, callback) -> None:
                callback(TransportError("refused by the broker"))
        return Failed()

    def __getattr__(self, name):
        return getattr(self.sink, name)


def test_a_dead_letter_that_failed_stops_the_checkpoint_that_would_consume_its_record(tmp_path):
    cfg = make_config(tmp_path)
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, [b"\x93garbage", make_group("run", 0), make_group("run", 1)])
    sink = transport.sink
    transport.sink = lambda client_id="rft", linger_ms=5: (  # type: ignore[method-assign]
        FailingSends(sink(client_id=client_id)) if client_id.endswith("-dlq") else sink(client_id=client_id))
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=StandInPolicy([]),
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))
    try:
        with pytest.raises(TransportError, match=r"dead letter of run.experiences:0@0 did not reach"):
            trainer.run()
    finally:
        trainer.close()
    assert not (cfg.run_dir / "checkpoints" / "latest").exists()  # the record stays unconsumed: read again
