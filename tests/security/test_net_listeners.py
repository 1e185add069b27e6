"""Listeners bind where they are told (127.0.0.1 by default), never on every interface: the push group's TCPStore
(torch binds a master store to every interface whatever host it is given), the Prometheus endpoint, the local
object server and the broker's size-limit proxy, each checked against the sockets this process holds in LISTEN
state (/proc). A whole run's listeners: tests/e2e/test_run_faults.py."""
from __future__ import annotations

import datetime
import os

import torch

from rft.broker.limits import SizeLimitProxy
from rft.broker.objects import serve
from rft.observability.config import MonitorConfig
from rft.observability.prometheus import metrics_endpoint
from rft.processes import free_port
from rft.weights.push import PushSender
from tests.listeners import listeners


def mine(port: int) -> list:
    return [item for item in listeners([os.getpid()]) if item.port == port]


def test_the_push_groups_store_listens_on_its_host_only():
    sender = PushSender.host(host="127.0.0.1", world_size=2, group_id="bind", timeout_s=10)
    try:
        bound = mine(sender.spec.port)
        assert bound and all(item.address == "127.0.0.1" for item in bound), [str(b) for b in bound]
        member = torch.distributed.TCPStore("127.0.0.1", sender.spec.port, 2, is_master=False,
                                            timeout=datetime.timedelta(seconds=10))
        member.set("k", "v")  # the store still works through the socket it was given
        assert sender.store.get("k") == b"v"
    finally:
        sender.close()


def test_the_prometheus_endpoint_listens_where_told():
    default = metrics_endpoint(MonitorConfig(prometheus_port=free_port()), run="r", role="trainer", instance="0")
    try:
        bound = mine(default.port)
        assert bound and all(item.address == "127.0.0.1" for item in bound), [str(b) for b in bound]
    finally:
        default.close()


def test_the_object_server_listens_on_loopback(tmp_path):
    server = serve(tmp_path / "objects")
    try:
        bound = mine(server.server_address[1])
        assert [item.address for item in bound] == ["127.0.0.1"]
    finally:
        server.server_close()


def test_the_size_limit_proxy_listens_on_loopback():
    proxy = SizeLimitProxy(f"127.0.0.1:{free_port()}", 1000).start()  # it connects upstream only for a client
    try:
        assert [item.address for item in mine(proxy.port)] == ["127.0.0.1"]
    finally:
        proxy.stop()
    assert not proxy.alive() and mine(proxy.port) == []
