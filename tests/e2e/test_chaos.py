"""`rft chaos`'s CI subset: a trainer SIGKILLed while it writes a checkpoint with `rft run` restarted (`--quick`
kills once, at the first of the four phases in the seed's order: seed 4 puts the checkpoint first), and a poison
stream with producer retries through the proxy in one run (`poison+producer-retries`), `--quick`, through the tool as
a user runs it, and its ledger: every run finished, 0 groups lost, 0 trained twice, faults actually injected, poison
dead-lettered. The trainer-kill scenario is also the suite's test of a SIGKILLed trainer: the dead trainer ends
`rft run` with 1, none of its processes outlives the kill, and `rft run` again resumes from the checkpoint with
nothing lost or trained twice (the other phases: `rft chaos --scenario trainer-kill`, all four), its explorers in a
fresh consumer group that no watchdog has to rescue.
The whole set is `rft chaos --all` (docs/operations.md, "Chaos"); the ledger's arithmetic is
tests/unit/test_chaos_ledger.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.runs import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

SCENARIOS = ("trainer-kill", "poison+producer-retries")
POISON = SCENARIOS[1]


def test_chaos_subset_loses_nothing_and_trains_nothing_twice(tmp_path):
    command = [sys.executable, "-m", "rft.cli", "chaos", "--quick", "--seed", "4", "--out", str(tmp_path)]
    for name in SCENARIOS:
        command += ["--scenario", name]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "chaos.json").read_text())
    rows = {r["scenario"]: r for r in report["scenarios"]}
    assert set(rows) == set(SCENARIOS), done.stdout[-3000:]
    for name, row in rows.items():
        assert "error" not in row, f"{name}: {row.get('error')}\n{done.stdout[-3000:]}"
        assert row["finished"] and row["final_step"] == 16, (name, row)
        assert row["lost"] == 0 and row["duplicated"] == 0 and row["unmatched"] == 0, (name, row)
        assert row["faults"] > 0 and row["trained"] >= 16 * 4, (name, row)
        assert row["staleness_held"] and row["longest_stall_s"] <= row["stall_bound_s"], (name, row)
        assert row["passed"], (name, row)
    assert done.returncode == 0, done.stdout[-3000:]
    faults = {name: json.loads((tmp_path / name.replace("+", "-and-") / "ledger.json").read_text())["faults_injected"]
              for name in rows}
    kills = [f for f in faults["trainer-kill"] if f["kind"] == "trainer_sigkill"]
    assert [k["phase"] for k in kills] == ["checkpoint"] and rows["trainer-kill"]["restarts"] == 1, kills
    assert done.stdout.count("[chaos] rft run ended with 1\n") == 1, done.stdout[-3000:]  # a dead trainer ends it
    assert not [f for f in faults["trainer-kill"] if f["kind"] == "trainer_survived_kill"], faults["trainer-kill"]
    # the restarted run's explorers start in a fresh consumer group (rft/explorer/membership.py), so the group the
    # fleet's stop left behind holds nobody up: the membership watchdog never has to rejoin or move
    assert "the explorers start in a fresh consumer group" in (tmp_path / "trainer-kill" / "run.log").read_text()
    for log in (tmp_path / "trainer-kill" / "runs" / "trainer-kill" / "logs").glob("explorer-*.log"):
        text = log.read_text()
        assert "rejoining the consumer group" not in text and "moving the explorers" not in text, log
    assert rows[POISON]["dead_letters"] >= 5 and rows[POISON]["dead_letters_missing"] == 0
    assert rows[POISON]["skipped"].get("foreign") == 1  # the other run's well-formed group
    assert {"poison", "produce_response_dropped"} <= {f["kind"] for f in faults[POISON]}
    assert "lost" in done.stdout and "trainer-kill" in done.stdout  # the table
