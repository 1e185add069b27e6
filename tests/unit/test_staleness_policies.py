"""Staleness policies (rft/experience/staleness_policies.py): each built-in's pick and keep, a plugin by import path
(and one without the protocol refused), and the configurations that cannot make progress refused when the config
is checked (`rft validate` runs the same check), with the reason. The feed that uses them is tested on the broker
(tests/integration/test_staleness_policies_feed.py)."""
from __future__ import annotations

import pytest

from rft.config import ConfigError
from rft.experience.staleness_policies import build_staleness_policy
from rft.run.config import config_from_dict
from rft.run.loading import run_config_from_dict
from tests.records import make_group


class FreshestFirst:
    """A plugin: the newest policy version first."""

    def keep(self, group, *, version):
        return True

    def pick(self, pool, *, version):
        return max(range(len(pool)), key=lambda i: (pool[i].policy_version, -i))


class NoPick:
    def keep(self, group, *, version):
        return True


def pool(*versions):
    return [make_group("r", i, policy_version=v, n_samples=1) for i, v in enumerate(versions)]


def test_built_in_policies_and_a_plugin_pick_and_keep():
    groups = pool(2, 0, 1, 0)
    assert build_staleness_policy("in_order", window=1).pick(groups, version=2) == 0
    assert build_staleness_policy("oldest_version_first", window=1).pick(groups, version=2) == 1  # the first v0
    windowed = build_staleness_policy("windowed", window=1)
    assert [windowed.keep(g, version=2) for g in groups] == [True, False, True, False]
    plugin = build_staleness_policy(f"{__name__}:FreshestFirst", window=1)
    assert plugin.pick(groups, version=2) == 0
    with pytest.raises(ConfigError, match="NoPick lacks pick"):
        build_staleness_policy(f"{__name__}:NoPick", window=1)
    with pytest.raises(ConfigError, match="trainer.staleness_policy.*or one of in_order"):
        build_staleness_policy("weight_fifo", window=1)


def config(**trainer):
    return {"model": {"path": "m"}, "run": {"mode": "off_policy", "max_staleness": 1, "groups_per_step": 4},
            "trainer": trainer}


@pytest.mark.parametrize("trainer, key, reason", [
    ({"staleness_policy": "oldest_version_first", "staleness_pool": 3}, "trainer.staleness_pool",
     r"must hold a step's run.groups_per_step \(4\)"),
    # off_policy k = 1: explorers run at most (1 + 1) x 4 = 8 groups ahead
    ({"staleness_policy": "oldest_version_first", "staleness_pool": 9}, "trainer.staleness_pool",
     "a pool of 9 never fills"),
    ({"staleness_policy": "windowed", "staleness_pool": 8, "staleness_window": 0}, "trainer.staleness_window",
     "waits up to 1 steps for its turn, so staleness_window must be >= 1"),
    ({"staleness_pool": 8}, "trainer.staleness_pool", "in_order takes groups as they arrive"),
])
def test_a_configuration_that_cannot_make_progress_is_refused(trainer, key, reason):
    with pytest.raises(ConfigError, match=f"{key}: cannot make progress: .*{reason}"):
        config_from_dict(config(**trainer))


def test_configurations_that_make_progress_load():
    loaded = config_from_dict(config(staleness_policy="oldest_version_first", staleness_pool=8))
    assert loaded.trainer.staleness_pool == 8
    assert config_from_dict(config(staleness_policy="windowed", staleness_pool=8, staleness_window=1))
    # explorers that never wait (admission all) or no explorers (train mode): the pool is not limited by admission
    assert config_from_dict({**config(staleness_policy="windowed", staleness_pool=40, staleness_window=9),
                             "explorer": {"admission": "all"}})
    unbounded = config(staleness_policy="oldest_version_first", staleness_pool=40)
    assert config_from_dict({**unbounded, "run": {**unbounded["run"], "mode": "train"}})
    with pytest.raises(ConfigError, match="trainer.staleness_policy"):  # a plugin is resolved when a run's config loads
        run_config_from_dict(config(staleness_policy="no_such_module:Policy", staleness_pool=8))
