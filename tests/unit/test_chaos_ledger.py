"""The arithmetic of `rft chaos`'s ledger (benchmarks/chaos.py `build_ledger`, `longest_stall`) on crafted records: the
experiences topic as `Offered` records in log order, the trainer's consumed.jsonl as dicts, the final offset; how
scenarios combine into one run (`combined`); and the checks of forged-control and poisoned-cache on crafted faults
and logs (`forgery_problems`, `cache_removals`, `poisoned_cache_problems`)."""
import pytest

from benchmarks.chaos import (
    SCENARIOS,
    Offered,
    build_ledger,
    cache_removals,
    combined,
    forgery_problems,
    loaded_versions,
    longest_stall,
    poisoned_cache_problems,
)

RUN = "r"


def group(offset: int, name: str, version: int = 0, run: str = RUN) -> Offered:
    return Offered(offset, f"{run}/{name}/e0", run, version)


def took(step: int, name: str, version: int = 0) -> dict:
    return {"step": step, "group_id": f"{RUN}/{name}/e0", "policy_version": version, "staleness": step - 1 - version}


def test_a_clean_run_balances():
    records = [group(0, "a"), group(1, "b"), group(2, "c"), group(3, "d"), group(4, "e")]
    ledger = build_ledger(records, [took(1, "a"), took(1, "b"), took(2, "c"), took(2, "d")], 4, run_id=RUN, bound=2)
    assert (ledger.acknowledged, ledger.covered, ledger.pending, ledger.trained) == (5, 4, 1, 4)
    assert ledger.ok and ledger.lost == [] and ledger.skipped == {}


def test_an_acknowledged_group_the_trainer_passed_over_is_lost():
    records = [group(0, "a"), group(1, "b"), group(2, "c")]
    ledger = build_ledger(records, [took(1, "a"), took(1, "c")], 3, run_id=RUN, bound=2)
    assert ledger.lost == [f"{RUN}/b/e0"] and not ledger.ok


def test_a_group_after_the_final_offsets_is_pending_not_lost():
    ledger = build_ledger([group(0, "a"), group(1, "b")], [took(1, "a")], 1, run_id=RUN, bound=2)
    assert ledger.lost == [] and ledger.pending == 1


def test_a_group_trained_twice_is_duplicated():
    records = [group(0, "a"), group(1, "b"), group(2, "a")]
    ledger = build_ledger(records, [took(1, "a"), took(1, "b"), took(2, "a")], 3, run_id=RUN, bound=None)
    assert ledger.duplicated == [f"{RUN}/a/e0"] and not ledger.ok


def test_legitimate_skips_are_not_lost():
    records = [group(0, "a"), Offered(1, None), group(2, "a"), group(3, "x", run="other"),
               group(4, "old", version=0), group(5, "future", version=9), group(6, "b", version=4)]
    # step 6 (version 5 trains on data of versions >= 3 with bound 2): "old" is stale, "future" from a lost lineage
    ledger = build_ledger(records, [took(5, "a", 4), took(6, "b", 4)], 7, run_id=RUN, bound=2)
    assert ledger.ok, ledger
    assert ledger.skipped == {"dead_letter": 1, "duplicate": 1, "foreign": 1, "stale": 1, "future_version": 1}
    assert ledger.dead_letter_offsets == [1] and ledger.dup_records == 1


def test_without_a_bound_an_old_group_passed_over_is_lost():
    records = [group(0, "old", version=0), group(1, "b", version=9)]
    ledger = build_ledger(records, [took(11, "b", 9)], 2, run_id=RUN, bound=None)
    assert ledger.lost == [f"{RUN}/old/e0"]
    assert build_ledger(records, [took(11, "b", 9)], 2, run_id=RUN, bound=2).lost == []


def test_a_group_skipped_once_and_taken_at_a_later_record_is_not_lost():
    records = [group(0, "a", version=0), group(1, "b", version=5), group(2, "a", version=5)]
    ledger = build_ledger(records, [took(7, "b", 5), took(7, "a", 5)], 3, run_id=RUN, bound=2)
    assert ledger.ok and ledger.skipped == {"stale": 1}


def test_a_trained_group_not_on_the_topic_is_unmatched():
    ledger = build_ledger([group(0, "a")], [took(1, "a"), took(1, "ghost")], 1, run_id=RUN, bound=2)
    assert ledger.unmatched == [f"{RUN}/ghost/e0"] and not ledger.ok


def test_longest_stall_skips_gaps_across_restarts():
    times = [0.0, 1.0, 2.0, 50.0, 51.0, 58.0]
    assert longest_stall(times, restarts=[]) == 48.0
    assert longest_stall(times, restarts=[10.0]) == 7.0
    assert longest_stall([], restarts=[]) == 0.0


def test_a_whole_run_fault_combines_with_a_driving_scenario():
    both = combined("poison+producer-retries")
    assert both.name == "poison+producer-retries" and both.run == "poison-and-producer-retries"
    assert both.proxy and both.config == SCENARIOS["poison"].config and both.arm is None
    assert combined("trainer-kill") is SCENARIOS["trainer-kill"]
    alone = combined("producer-retries")  # armed around a plain run
    assert alone.run == "producer-retries" and alone.proxy and alone.arm is None
    with pytest.raises(ValueError, match="each drive their own run"):
        combined("poison+trainer-kill")
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        combined("poison+nope")


def test_a_claimed_record_the_trainer_skipped_is_a_dead_letter_it_must_have_diverted():
    claimed = Offered(1, f"{RUN}/b/e0", RUN, 0, claimed=True)  # its parts could not be fetched
    stub = Offered(3, f"{RUN}/d/e0", RUN, None, claimed=True)  # a whole-body stub: no version without resolving
    records = [group(0, "a"), claimed, group(2, "c"), stub, Offered(4, f"{RUN}/e/e0", RUN, 0, claimed=True)]
    ledger = build_ledger(records, [took(1, "a"), took(1, "c"), took(2, "e")], 5, run_id=RUN, bound=2)
    assert ledger.ok and ledger.lost == [] and ledger.skipped == {"claim_dead_letter": 2}
    assert ledger.dead_letter_offsets == [1, 3]  # run_scenario fails unless both are on the dead-letter topic
    stale = Offered(1, f"{RUN}/b/e0", RUN, 0, claimed=True)  # skipped as stale at step 5: not a dead letter
    ledger = build_ledger([group(0, "a", 4), stale, group(2, "c", 4)], [took(5, "a", 4), took(5, "c", 4)], 3,
                          run_id=RUN, bound=2)
    assert ledger.skipped == {"stale": 1} and ledger.dead_letter_offsets == []


def test_the_ledger_reads_claim_checked_records_without_their_store(tmp_path):
    from benchmarks.chaos import offer
    from rft.schema import encode
    from rft.transport import ClaimStore
    from rft.transport.claims import check_out
    from tests.records import make_group

    g = make_group(RUN, 0, n_samples=2, response_len=100)
    value, headers = encode(g)
    store = ClaimStore(tmp_path)
    parts, whole = (check_out(value, store, threshold=t, limit=lim) for t, lim in ((64, 1 << 20), (64, 200)))
    assert offer(7, parts, headers) == Offered(7, g.group_id, RUN, g.policy_version, claimed=True)
    assert offer(8, whole, headers) == Offered(8, g.group_id, RUN, None, claimed=True)
    assert offer(9, value, headers) == Offered(9, g.group_id, RUN, g.policy_version)
    assert offer(10, b"\x81\xa9rft-claim\x01", []) == Offered(10, None)


def test_a_group_of_a_version_the_trainer_never_published_is_never_a_legitimate_skip():
    # the trainer reached step 6 (newest version it can have published: 7); "far" was made with version 40, another
    # lineage's weights (a stale cache, a reused store): skipped as a future version it is not legitimate, and
    # trained it is not either
    records = [group(0, "a", 4), group(1, "far", 40), group(2, "b", 4), group(3, "near", 9)]
    trained = [took(6, "a", 4), took(6, "b", 4)]
    assert build_ledger(records, trained, 4, run_id=RUN, bound=2).ok  # without the check: "future_version" skips
    ledger = build_ledger(records, trained, 4, run_id=RUN, bound=2, newest_version=7)
    assert ledger.foreign_versions == [f"{RUN}/far/e0", f"{RUN}/near/e0"] and not ledger.ok
    assert ledger.skipped == {} and ledger.lost == []
    trained_foreign = build_ledger([group(0, "far", 40)], [took(6, "far", 40)], 1, run_id=RUN, bound=None,
                                   newest_version=7)
    assert trained_foreign.foreign_versions == [f"{RUN}/far/e0"] and not trained_foreign.ok
    legit = build_ledger([group(0, "a", 4), group(1, "lost-trajectory", 7), group(2, "b", 4)], trained, 3,
                         run_id=RUN, bound=2, newest_version=7)
    assert legit.ok and legit.skipped == {"future_version": 1}  # a version a killed trainer made before its resume


def test_forged_control_passes_only_when_every_forgery_was_ignored(tmp_path):
    faults = [{"kind": "forged", "what": "weights_outside_store", "version": 1004},
              {"kind": "forged", "what": "tasks_group_far_epoch", "version": None},
              {"kind": "forged", "what": "weights_huge_version", "version": 10**8}]
    log = tmp_path / "explorer-0.log"
    log.write_text("INFO loaded weights version 3 in 0.10 s\nINFO loaded weights version 4 in 0.09 s\n")
    assert forgery_problems(faults, loaded=loaded_versions([log]),
                            forged_group_committed={"r.tasks:0": None, "r.tasks:1": None}) == []
    loaded = forgery_problems(faults, loaded={3, 4, 1004}, forged_group_committed={})
    assert loaded == ["an explorer loaded the forged weights version 1004 (weights_outside_store)"]
    followed = forgery_problems(faults, loaded={3}, forged_group_committed={"r.tasks:0": 12, "r.tasks:1": None})
    assert len(followed) == 1 and "followed the forged tasks_group" in followed[0]
    assert forgery_problems([], loaded={1004}, forged_group_committed={"r.tasks:0": 3}) == []  # nothing forged


def test_poisoned_cache_passes_only_when_every_planted_version_was_removed(tmp_path):
    log = tmp_path / "explorer-0.log"
    log.write_text("INFO loaded weights version 6\n"
                   "WARNING weights cache: version 7 in /c/abc is of lineage 5f0e, not the store's 9a1b (another "
                   "run's, a stale cache): removed, fetched again from the store when needed\n"
                   "WARNING weights cache: version 8 in /c/abc is of lineage 5f0e, not the store's 9a1b\n")
    removed = cache_removals([log])
    assert removed == {7, 8}
    planted = [{"kind": "cache_planted", "version": v} for v in (7, 8)]
    assert poisoned_cache_problems(planted, removed) == []
    served = poisoned_cache_problems([*planted, {"kind": "cache_planted", "version": 9}], removed)
    assert served == ["planted version 9 was not removed from the host cache"]
    assert set(SCENARIOS) >= {"forged-control", "poisoned-cache"}
