"""Where a whole run listens: `rft run` (transformers explorer, the trainer under torchrun, weights over the push
path, Prometheus endpoints, the dashboard, the durable embedded broker with its object server) holds no socket in
LISTEN state on every interface (0.0.0.0 or ::): each binds where it is told, 127.0.0.1 by default (and the push
group's store on sync.push_host). The sockets are read from /proc for the run's whole process tree."""
from __future__ import annotations

import signal

import pytest
import yaml

from rft.bench.run_support import finish, rft_run, wait_for_step, write_config
from rft.processes import free_port
from tests.listeners import descendants, listeners
from tests.waiting import tail_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_no_part_of_a_run_listens_on_every_interface(tmp_path, tiny_model):
    prometheus, dashboard = free_port(), free_port()
    config = write_config(tmp_path, tiny_model, "listen", run={"max_steps": 500},
                          explorer={"engine": "transformers", "replicas": 1},
                          kafka={"bootstrap_servers": "embedded", "embedded_data_dir": "broker"},
                          sync={"method": "push", "push_transport": "rft", "timeout_s": 60},
                          monitor={"prometheus_port": prometheus, "dashboard_port": dashboard})
    run_dir, log = tmp_path / "runs" / "listen", tmp_path / "run.log"
    process = rft_run(config, log)
    try:
        wait_for_step(process, run_dir, 2, log)
        broker_port = int(yaml.safe_load((run_dir / "config.yaml").read_text())["kafka"]["bootstrap_servers"]
                          .rsplit(":", 1)[1])

        def all_listening():  # the parts start at different times: wait for the ones the run must have
            found = listeners(descendants(process.pid))
            ports = {item.port for item in found}
            wanted = {dashboard, broker_port} <= ports and any(prometheus <= p < prometheus + 64 for p in ports)
            return found if wanted else None

        found = wait_until(all_listening, timeout=60, interval=1, alive=[process], context=tail_of(log),
                           what="the dashboard, the broker and a Prometheus endpoint listening")
    finally:
        process.send_signal(signal.SIGTERM)
        finish(process, log)
    wildcard = [str(item) for item in found if item.wildcard]
    assert not wildcard, f"listening on every interface: {wildcard}; all: {[str(i) for i in found]}"
    assert len({item.pid for item in found}) >= 4, [str(i) for i in found]  # broker, objects, dashboard, parts
    assert "(pushed)" in (run_dir / "logs" / "explorer-0.log").read_text()  # the push group's store was up too
