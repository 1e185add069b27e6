"""Listeners bind where they are told (127.0.0.1 by default), never on every interface: the push group's TCPStore
(torch binds a master store to every interface whatever host it is given) and its gloo data plane (gloo's default
device takes the host name's address whatever sync.push_host says), the Prometheus endpoint, the local
object server and the broker's size-limit proxy, each checked against the sockets this process holds in LISTEN
state (/proc). A whole run's listeners: tests/e2e/test_run_faults.py."""
from __future__ import annotations

import datetime
import ipaddress
import os
import threading

import torch

from rft.broker.limits import SizeLimitProxy
from rft.broker.objects import serve
from rft.observability.config import MonitorConfig
from rft.observability.prometheus import metrics_endpoint
from rft.processes import free_port
from rft.weights.push import PushReceiver, PushSender
from tests.listeners import listeners
from tests.waiting import wait_until


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


def test_the_push_groups_gloo_data_plane_listens_on_its_host():
    """Rank 0's gloo socket listens on the group's host, here 127.0.0.2 (loopback, which no default picks); a member's
    on the address its route to that host leaves from (loopback here)."""
    before = {(item.address, item.port) for item in listeners([os.getpid()])}
    sender = PushSender.host(host="127.0.0.2", world_size=2, group_id="gloo-bind", timeout_s=10)
    members: list[PushReceiver] = []
    joining = threading.Thread(target=lambda: members.append(PushReceiver.join(sender.spec)))
    joining.start()
    try:
        wait_until(lambda: sender.members_joined() >= 1, timeout=30, interval=0.02, what="the member to join")
        sender.connect()
        joining.join(timeout=30)
        assert members, "the member did not connect"
        opened = [item for item in listeners([os.getpid()])
                  if (item.address, item.port) not in before and item.port != sender.spec.port]
        assert len(opened) == 2, [str(item) for item in opened]  # one gloo listener per member
        assert [item.address for item in opened].count("127.0.0.2") == 1, [str(item) for item in opened]
        assert all(ipaddress.ip_address(item.address).is_loopback for item in opened), [str(i) for i in opened]
    finally:
        sender.close()
        for member in members:
            member.close()


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
