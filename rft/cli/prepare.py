"""What `rft run` does before it starts a part: refuse HTTP endpoints that may not start (`endpoints_refused`), make
the run directory private (`make_private_dir`), write the config the parts read with its secrets redacted
(`write_run_config`), and fill the run's topics (`prepare_topics`): create them, publish the task set unless the
online publisher part does (a resumed run's topic gets only the tasks it lacks), start a restarted run's explorers
in a fresh consumer group, and publish the demonstrations an offline replay or the algorithm reads. Each step that
can fail prints why and returns a value the launcher turns into exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from rft.algorithms import build_algorithm
from rft.config.secrets import REDACTED
from rft.data.demonstrations import prompt_tools, publish_demonstrations
from rft.data.tasks import DatasetError, build_picker, publish_tasks, published_groups
from rft.explorer.membership import fresh_group_for_restart
from rft.run.config import Config
from rft.run.records import claim_store
from rft.transport import connect
from rft.transport.run_topics import RunTopics, create_run_topics


def endpoints_refused(cfg: Config, roles: tuple[str, ...]) -> str | None:
    """Why an HTTP endpoint this run would start (`rft dashboard`, `rft serve`) must not: a key that cannot be read,
    or one listening beyond loopback without a key (rft/observability/access.py); None when they may start."""
    serving = "serve" in roles
    if not (cfg.monitor.dashboard_port or serving):
        return None
    from rft.observability.access import (  # heavy: fastapi (the web extra)
        AccessConfigError,
        dashboard_access,
        serve_access,
    )
    try:
        if cfg.monitor.dashboard_port:
            dashboard_access(cfg.monitor, cfg.monitor.dashboard_host)
        if serving:
            serve_access(cfg.serve, cfg.serve.host)
    except AccessConfigError as e:
        return str(e)
    return None


def make_private_dir(path: Path) -> None:
    """`path` and its missing parents created 0700; the run directory (its parent) made 0700 if it was not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)


def write_run_config(cfg: Config, path: Path) -> None:
    """`cfg` as the parts read it, at `path` (mode 0600): secrets redacted (rft.config.secrets: `${ENV}`
    references as written); a secret written in the config itself reaches the parts through this process's
    environment, which they inherit, as `${RFT_SECRET_<KEY>:-<redacted>}` (a reader without it sees REDACTED)."""
    refs = dict(cfg.env_refs)
    for key, value in cfg.secret_values().items():
        name = "RFT_SECRET_" + re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_").upper()
        os.environ[name] = json.dumps(value)  # YAML reads it back with its type ("123" stays a string)
        refs[key] = f"${{{name}:-{REDACTED}}}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(dataclasses.replace(cfg, env_refs=refs).to_yaml())
    os.chmod(path, 0o600)  # a file from an earlier run keeps its mode otherwise


def prepare_topics(cfg: Config, roles: tuple[str, ...], *, online: bool) -> bool:
    """The run's topics created and filled before its parts start (module docstring); `online`: the `publisher` part
    publishes the tasks as rewards come in. False (the error printed) when a dataset is not usable."""
    create_run_topics(RunTopics.of(cfg), cfg.kafka)
    if "explorers" in roles and not online:
        publish_run_tasks(cfg)
    if "explorers" in roles:
        fresh_explorers_group(cfg)
    if cfg.replay.from_data and not publish_run_demonstrations(cfg, cfg.replay.topic or cfg.topic("experiences")):
        return False
    demonstrations = build_algorithm(cfg.algorithm).needs.demonstrations if "trainer" in roles else None
    demonstrations_topic = demonstrations.topic_of(cfg.topic("demonstrations")) if demonstrations else ""
    if demonstrations is not None and not publish_run_demonstrations(cfg, demonstrations_topic):
        return False  # the demonstrations the algorithm mixes into its steps
    return True


def publish_run_tasks(cfg: Config) -> None:
    """Publish the task set. A tasks topic that holds it already (a resumed run on a durable broker) is left as it
    is; one that holds part of it (a publish cut short, by Ctrl-C or a crash, before the broker acknowledged every
    task) gets the tasks it lacks, else the run would wait for groups that can never come."""
    topics = RunTopics.of(cfg)
    source = connect(cfg.kafka).source()
    try:
        existing = sum(source.end_offsets(topics.tasks).values())
    finally:
        source.close()
    if existing and existing >= build_picker(cfg.data, run_id=topics.run).remaining:
        print(f"[rft] {topics.tasks} already holds {existing} tasks: not publishing again", flush=True)
        return
    present = published_groups(topics, cfg.kafka) if existing else set()
    count = publish_tasks(cfg.data, topics, cfg.kafka, progress=cfg.monitor.progress, skip=present)
    if present:
        print(f"[rft] {topics.tasks} held {len(present)} of its tasks (a publish cut short): published the {count} "
              "it lacked", flush=True)
    else:
        print(f"[rft] published {count} tasks to {topics.tasks}", flush=True)


def fresh_explorers_group(cfg: Config) -> None:
    """A restarted run (its explorers' group committed offsets before) starts its explorers in a fresh consumer
    group, so that a group wedged by the fleet's last stop cannot hold them up (rft/explorer/membership.py)."""
    topics = RunTopics.of(cfg)
    group = fresh_group_for_restart(connect(cfg.kafka), topics, by="rft-run")
    if group is not None:
        print(f"[rft] {topics.tasks} was consumed before: the explorers start in a fresh consumer group, {group} "
              "(seeded with the old group's positions)", flush=True)


def publish_run_demonstrations(cfg: Config, topic: str) -> bool:
    """Fill `topic` (the offline replay's, or the demonstrations topic the algorithm reads) from the dataset, unless
    it already holds records (a resumed stage, or demonstrations published beforehand). False (the error printed)
    when the dataset is not usable."""
    try:
        count = publish_demonstrations(cfg.data, cfg.model, cfg.kafka, topic=topic, run_id=cfg.run.name,
                                       tools=prompt_tools(cfg.explorer), claims=claim_store(cfg))
    except DatasetError as e:
        print(f"[rft] demonstrations: {e}", file=sys.stderr)
        return False
    print(f"[rft] {topic}: " + (f"published {count} demonstrations" if count else "holds records already: not "
                                "publishing demonstrations again"), flush=True)
    return True

