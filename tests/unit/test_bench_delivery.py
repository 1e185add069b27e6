"""`rft bench delivery` (benchmarks/delivery.py): the delivery model's times, checked against the formulas worked by
hand for one case per path, and the per-host cache's saving equal to the explorers per host."""
from __future__ import annotations

import pytest

from benchmarks.delivery import FLEETS, MODELS, Links, deliver_s, table


def test_times_match_the_formulas_worked_by_hand():
    seven_b = MODELS[0]  # 7.6e9 bf16 parameters: 15.2 GB, 8 explorers per host, one publishing host
    links = Links(store_gbps=100, host_gbps=10, upload_gbps=10, verify_gbps=4, delta_fraction=0.05)
    full = deliver_s(seven_b, 1024, "full", links)  # 1024 downloads share 100 GB/s: 0.0977 GB/s each
    assert full["deliver_s"] == pytest.approx(15.2 / 10 + 15.2 / (100 / 1024), abs=0.1)
    cache = deliver_s(seven_b, 1024, "cache", links)  # 128 hosts share 100 GB/s: 0.78 GB/s each
    assert cache["deliver_s"] == pytest.approx(15.2 / 10 + 15.2 / (100 / 128), abs=0.1)
    delta = deliver_s(seven_b, 1024, "delta", links)  # 0.76 GB per host, then 15.2 GB rebuilt and hashed at 4 GB/s
    assert delta["deliver_s"] == pytest.approx((15.2 + 0.76) / 10 + 0.76 / (100 / 128) + 15.2 / 4, abs=0.1)
    assert (full["egress_gb"], cache["egress_gb"], delta["egress_gb"]) == pytest.approx((15564.8, 1945.6, 97.3))


def test_the_cache_saves_the_explorers_per_host_and_never_costs_time():
    rows = table(Links())
    for model in MODELS:
        for n in FLEETS:
            got = {r["path"]: r for r in rows if r["model"] == model.name and r["explorers"] == n}
            assert got["cache"]["deliver_s"] <= got["full"]["deliver_s"]
            hosts = -(-n // model.explorers_per_host)
            assert got["full"]["egress_gb"] == pytest.approx(got["cache"]["egress_gb"] * n / hosts, rel=1e-3)
