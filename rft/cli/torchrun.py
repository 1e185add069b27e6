"""`python -m rft.cli.torchrun ARGS`: torchrun (`torch.distributed.run`, same arguments) whose TCPStore servers
listen only on the address each is created for. torch's TCPStore(host, is_master=True) listens on every interface
whatever `host` says (torch 2.13), so torchrun's rendezvous and agent stores would be reachable from the network even
for `--standalone` (host `localhost`). Here every master store created without a socket of its own is handed one
bound to its host (rft.processes.listening_socket, as `master_listen_fd`); a multi-tenant store whose port this
process already serves is left to torch (it reuses that server). `rft run` starts its trainer with this
(rft/cli/launcher.py); the workers connect to the stores as before.

A stop by signal (`rft run` stopping its parts) ends with one line and the shell's status for the signal (128 + its
number: 143 for SIGTERM) instead of torch's traceback: torchrun's agent has already stopped its workers when its
`SignalException` reaches `main`.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from rft.processes import listening_socket

_TCPStore = dist.TCPStore


class BoundTCPStore(_TCPStore):
    """torch's TCPStore; a master listens on `host_name` only (module docstring). Same arguments as TCPStore."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), wait_for_workers: bool = True,
                 multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True):
        fd = None
        if is_master and master_listen_fd is None and use_libuv:
            try:
                listener = listening_socket(host_name, port)
            except OSError:
                if not multi_tenant:
                    raise
                listener = None  # this process serves that port already: torch reuses its server
            if listener is not None:
                port, fd = listener.getsockname()[1], listener.detach()
        try:
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                             master_listen_fd if fd is None else fd, use_libuv)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise


def install() -> None:
    """Make `torch.distributed.TCPStore`, and every name already imported from it, the bound store."""
    # setattr: the patch replaces a class torch's modules hold by name (mypy sees the assignment of a type)
    setattr(dist, "TCPStore", BoundTCPStore)  # noqa: B010
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("torch") and getattr(module, "TCPStore", None) is _TCPStore:
            setattr(module, "TCPStore", BoundTCPStore)  # noqa: B010


def main() -> None:
    install()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun  # after install(): its modules take the bound store

    try:
        torchrun()
    except SignalException as e:  # raised by the agent's handler after it stopped the workers (module docstring)
        print(f"[torchrun] stopped by {e.sigval.name}; its workers were stopped first", file=sys.stderr, flush=True)
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
