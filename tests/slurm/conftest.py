"""`slurm`: a real single-node Slurm cluster on localhost for the whole session (tests/slurm/cluster.py).
`make test` installs Slurm (`make system-deps`), so a missing install fails the tests instead of skipping them."""
from __future__ import annotations

import pytest

from tests.slurm.cluster import LocalSlurm, missing_programs


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_programs()
    if missing:
        pytest.fail(f"Slurm is not installed (missing {', '.join(missing)}): run `make system-deps` "
                    "(apt-get install slurm-wlm munge)", pytrace=False)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
