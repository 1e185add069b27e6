"""Run in a subprocess by test_explorer_continuous.py (vLLM's LLM must be built under __main__): one explorer with
`explorer.continuous: true` on a real vLLM engine explores the run's tasks topic while this script publishes new
weights versions into the store mid-run, and stops it once it has delivered GROUPS groups and one dead letter (a
watcher thread reads the explorer's counters; the stop finishes whatever is in flight, delivered and committed). It
records, independently of the explorer's bookkeeping: every engine request's weights version at submission and at
completion, vLLM's own count of unfinished requests at each reload, every task-offset commit with the
experience/dead-letter records sent before it. Prints one `PROBE-RESULT {json}` line.

Each version is published from the engine's step (never from a timer: a paced engine and a watching thread raced on
a fast machine), once enough groups were produced and the version before it is loaded; the loop looks for weights
at every turn. Draining, the next turn stops admitting and loads it once nothing is in flight; with
`explorer.inflight_updates: true` it is published only after a step that left requests unfinished (so they have
sampled tokens and will sample more), and the next turn loads it in flight, before any other engine step. With
`max_inflight` tasks at most in the engine and versions due at 4 and 10 groups of 16, tasks remain to be submitted
under each new version.

The stop is the event, not an idle window: the first poll joins the consumer group, and a Tansu rebalance beside a
full suite's runs has taken longer than a 4 s idle window (CI: "idle after 0 of 16 groups"). `exit_when_idle_s` stays
as the failure path: an explorer that stops producing ends "idle" after IDLE_FAILURE_S, and the test names it.

argv: CONFIG_PATH GROUPS
"""
from __future__ import annotations

import json
import sys
import threading

IDLE_FAILURE_S = 120.0


def main(config_path: str, groups_expected: int) -> dict:
    import torch

    import rft.explorer.continuous as continuous
    from rft.engine import build_engine
    from rft.explorer.main import build_explorer
    from rft.rewards import build_reward
    from rft.run.config import load_config
    from rft.weights.store import WeightStore, iter_safetensors
    from rft.workflows import build_workflow

    cfg = load_config(config_path)
    in_flight = cfg.explorer.inflight_updates
    continuous.WEIGHTS_CHECK_S = 0.0  # the version published after a step is seen at the next turn
    engine = build_engine(cfg.explorer, cfg.model, seed=0)
    out: dict = {"submitted": {}, "finished": {}, "loads": [], "commits": [], "sent": [], "warm_up": []}
    submit, step, load = engine.submit, engine.step, engine.load_weights

    def recorded_submit(request_id, prompt, sampling, **kwargs):
        if request_id.startswith("generate-"):  # `generate` (the explorer's warm-up), not a task
            out["warm_up"].append(request_id)
        else:
            out["submitted"][request_id] = engine.weights_version
        submit(request_id, prompt, sampling, **kwargs)

    def recorded_step():
        done = step()
        for request_id, generation in done:
            if request_id.startswith("generate-"):
                continue
            out["finished"][request_id] = [engine.weights_version, [c.weights_version for c in generation.completions],
                                           [c.token_versions for c in generation.completions]]
        if (schedule and explorer.stats.groups >= schedule[0][0] and engine.weights_version == schedule[0][1] - 1
                and (engine.unfinished() or not in_flight)):
            publish(*schedule.pop(0))
        return done

    def recorded_load(path, version):
        out["loads"].append([version, engine.unfinished()])  # vLLM's own count of unfinished sequences
        load(path, version)

    def recorded_load_in_flight(path, version, *, recompute):
        out["loads"].append([version, engine.unfinished()])
        load_in_flight(path, version, recompute=recompute)

    load_in_flight = engine.load_weights_in_flight
    engine.submit, engine.step, engine.load_weights = recorded_submit, recorded_step, recorded_load
    engine.load_weights_in_flight = recorded_load_in_flight
    explorer = build_explorer(cfg, explorer_id="cont", engine=engine,
                              workflow=build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)))
    send = explorer.sink.send_record

    def recorded_send(topic, record, *, key=None):
        if topic in (cfg.topic("experiences"), cfg.topic("dead_letter")):
            out["sent"].append([topic, key])
        return send(topic, record, key=key)

    explorer.sink.send_record = recorded_send
    store = WeightStore(cfg.sync.weight_store)
    base = dict(iter_safetensors(cfg.model.path))
    schedule = [(4, 1), (10, 2)]  # (groups produced, version published then)

    def publish(groups: int, version: int) -> None:
        store.publish(version, [{k: v + 0.01 * version * torch.ones_like(v) for k, v in base.items()}],
                      cfg.model.path)
        out.setdefault("published_at_groups", []).append([version, explorer.stats.groups])

    def watcher(stop: threading.Event, over: threading.Event) -> None:
        while ((explorer.stats.groups < groups_expected or explorer.stats.dead_letters < 1)
               and not over.wait(0.05)):
            pass
        stop.set()

    stop, over = threading.Event(), threading.Event()
    threading.Thread(target=watcher, args=(stop, over), daemon=True).start()
    try:
        explorer.refresh_weights()
        explorer.join()
        commit = explorer.tasks.commit

        def recorded_commit(offsets):
            out["commits"].append([dict(offsets), len(out["sent"])])
            return commit(offsets)

        explorer.tasks.commit = recorded_commit
        out["reason"] = explorer.run_continuous(stop, exit_when_idle_s=IDLE_FAILURE_S)
        out["reloads"] = explorer.reloads
        out["committed"] = explorer.tasks.committed(cfg.topic("tasks"))
        out["stats"] = explorer._stats()
    finally:
        over.set()
        explorer.close("probe over")
        engine.close()
    return out


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
