"""The Ray fleet launcher on a local Ray cluster (ray.init(num_cpus=2)): one explorer actor produces groups from
the run's tasks, shows up in the fleet's status, and leaves cleanly when the fleet is scaled to 0."""
from __future__ import annotations

import os

import pytest

from rft.data.tasks import publish_tasks
from rft.transport.run_topics import RunTopics
from tests.integration.explorer_support import REPO, Control, Experiences, create_topics, load, log_tail, write_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture
def local_ray():
    import ray

    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{previous or ''}"  # Ray's workers import rft and launch
    ray.init(num_cpus=2, include_dashboard=False, namespace="rft", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


def test_one_explorer_actor_produces_groups_and_scales_to_zero(broker, tiny_model, tmp_path, topic_prefix, local_ray):
    from launch.ray.fleet import fleet_name, get_fleet, start_fleet

    ray = local_ray
    logs = tmp_path / "logs"
    cfg = load(write_config(tmp_path / "run.yaml", run=topic_prefix, bootstrap=broker.bootstrap_servers,
                            model=tiny_model, store=tmp_path / "store"))
    create_topics(cfg)
    publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka, progress=False)
    experiences, control = Experiences(cfg, cfg.topic("experiences")), Control(cfg, cfg.topic("control"))
    fleet = start_fleet(cfg.to_yaml(), cfg.run.name, 1, cpus_per_explorer=1, log_dir=str(logs))
    try:
        explorer_id = f"{cfg.run.name}-ray-0"
        assert get_fleet(cfg.run.name)._actor_id == fleet._actor_id  # reachable by name: `fleet scale RUN N`
        experiences.wait_for(lambda: experiences.by(explorer_id), timeout_s=180, what="a group from the Ray explorer",
                             log_dir=logs)
        [status] = ray.get(fleet.status.remote())
        assert status["explorer_id"] == explorer_id and status["returncode"] is None
        assert ray.get(fleet.scale.remote(0)) == []
        control.wait_for(lambda: control.messages("explorer_leave", explorer_id), timeout_s=30,
                         what="the explorer to leave", log_dir=logs)
    finally:
        ray.get(fleet.stop.remote())
        experiences.close()
        control.close()
    group = experiences.by(explorer_id)[0]
    assert group.run_id == cfg.run.name and len(group.samples) == 4
    assert control.messages("explorer_leave", explorer_id)[0].body["reason"] == "stopped", log_tail(logs)
    assert fleet_name(cfg.run.name) == f"rft-fleet-{cfg.run.name}"
