"""The TCP sockets processes listen on, read from /proc (no `ss` needed): for the tests that check where a run's
listeners are bound (tests/security/; whole runs: tests/e2e/test_durable_run.py and tests/e2e/test_run_faults.py)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from tests.waiting import tail_of, wait_until

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class Listener:
    address: str  # "127.0.0.1", "::", ...
    port: int
    pid: int

    @property
    def wildcard(self) -> bool:
        """Listening on every interface (0.0.0.0 or ::)."""
        return ipaddress.ip_address(self.address).is_unspecified

    def __str__(self) -> str:
        return f"{self.address}:{self.port} (pid {self.pid})"


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s hex address (32-bit words in host byte order, little-endian here) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # gone, or not ours
        pass
    return inodes


def listeners(pids) -> list[Listener]:
    """Every TCP socket in LISTEN state held by one of `pids`. Reads /proc/<pid>/net (the pids' network namespace,
    which is this one's for the processes of a test)."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN and inode in owner:
                address, port = local.split(":")
                found.append(Listener(_address(address), int(port, 16), owner[inode]))
    return sorted(found, key=lambda item: (item.pid, item.port))


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (by parent pid, read from /proc), in no particular order."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        found.append(current)
        frontier += children.get(current, [])
    return found


def assert_no_wildcard_listener(process, log, *, ports: set[int], prometheus: int, parts: int) -> list[Listener]:
    """Once the run of `process` (an `rft run`, logging to `log`) listens on every port of `ports` and on a Prometheus
    port in prometheus..prometheus+63 (its parts start at different times), no socket of its process tree listens on
    every interface, and at least `parts` of its processes listen. The listeners found."""
    def all_listening():
        found = listeners(descendants(process.pid))
        held = {item.port for item in found}
        return found if ports <= held and any(prometheus <= p < prometheus + 64 for p in held) else None

    found = wait_until(all_listening, timeout=60, interval=1, alive=[process], context=tail_of(log),
                       what=f"ports {sorted(ports)} and a Prometheus endpoint listening")
    assert_none_wildcard(found)
    assert len({item.pid for item in found}) >= parts, [str(i) for i in found]
    return found


def assert_none_wildcard(found: list[Listener]) -> None:
    """No listener of `found` listens on every interface."""
    wildcard = [str(item) for item in found if item.wildcard]
    assert not wildcard, f"listening on every interface: {wildcard}; all: {[str(i) for i in found]}"
