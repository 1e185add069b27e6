"""`rft bench transport --sizes --quick` (benchmarks/transport_sizes.py) on a local broker that refuses batches over
1,000,000 bytes: groups over the limit are refused inline and all go through claim-checked, every record on the
topic under the limit, the store's puts and gets counted where parts were claimed and nowhere else."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_size_study_refuses_inline_what_is_over_the_limit_and_claim_checks_it():
    result = subprocess.run([sys.executable, "-m", "rft.cli", "bench", "transport", "--sizes", "--quick", "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    limit = report["broker_limit"]
    cells = {(c["tokens"], c["routing"], c["path"]): c for c in report["cells"]}
    assert set(cells) == {(t, r, p) for t in (1024, 16384) for r in (False, True) for p in ("inline", "claim-check")}
    for (_, _, path), c in cells.items():
        if path == "inline" and c["group_bytes"] > limit:
            assert c["refused"].startswith(f"refused: over {limit} bytes") and c["groups"] == 0
            continue
        assert not c["refused"] and c["groups"] >= 1 and 0 < c["record_bytes"] <= limit
        assert c["produce_groups_s"] > 0 and c["consume_groups_s"] > 0
        claimed = path == "claim-check" and c["group_bytes"] > c["record_bytes"]
        assert (c["puts"] > 0 and c["gets"] > 0) == claimed, c
    assert not cells[(1024, False, "inline")]["refused"]  # 91 KB groups, 20 of them: batches kept under the limit
    assert cells[(1024, True, "claim-check")]["gets"] == 8 * cells[(1024, True, "claim-check")]["groups"]
    assert cells[(16384, False, "claim-check")]["record_bytes"] < 1000  # a whole-body stub
