"""A real Slurm cluster on localhost for the launcher tests: munged with its own key and socket, slurmctld and
two slurmd in the foreground, every config, state and log file in one scratch directory, free ports. Jobs run as
the current user (root here) with the submitting environment (`sbatch --export=ALL`).

Two nodes on one machine, so that a multi-node trainer job really rendezvous across Slurm nodes: one slurmd per
node name, each with its own port and spool directory. The names are this host's name and `localhost`, both of
which resolve to this machine (the trainer's rendezvous address is the first node's name).

The settings are the ones that worked in a container without systemd (see the project's FEASIBILITY notes):
proctrack/linuxproc and task/none (no cgroup confinement), cgroup.conf with IgnoreSystemd=yes (slurmd refuses
to start without it), MpiDefault=none (the pmix plugin does not load). The node declares more CPUs than the
machine has (SlurmdParameters=config_overrides) so that a trainer job and an explorer array run side by side."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

from rft.processes import free_port
from tests.waiting import WaitTimeout, wait_until

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
NODE_CPUS = 8
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


class SlurmError(RuntimeError):
    pass


def search_path() -> str:
    return f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"  # the daemons live in sbin, not always on a user's PATH


def missing_programs() -> list[str]:
    return [p for p in DAEMONS + CLIENTS if shutil.which(p, path=search_path()) is None]


def slurm_conf(root: Path, host: str, ctld_port: int, nodes: dict[str, int]) -> str:
    """`nodes`: node name -> its slurmd port."""
    node_lines = "\n".join(f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={NODE_CPUS} State=UNKNOWN"
                           for name, port in nodes.items())
    return f"""\
ClusterName=rfttest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
KillWait=15
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


CGROUP_CONF = "CgroupPlugin=autodetect\nIgnoreSystemd=yes\n"


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]  # slurmctld only runs on the host named in SlurmctldHost
        self.nodes = [self.host, "localhost"]
        if len(set(self.nodes)) < 2:
            raise SlurmError(f"local Slurm: the host name {self.host!r} is taken by the second node's name")
        self.conf = root / "etc" / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=search_path())
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- lifecycle
    def start(self, timeout_s: float = 60.0) -> None:
        for d in ("etc", "state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (self.root / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(self.root, self.host, free_port(), {n: free_port() for n in self.nodes}))
        (self.conf.parent / "cgroup.conf").write_text(CGROUP_CONF)
        self._start_munge()
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(lambda: self.node_states() == ["idle"] * len(self.nodes), timeout_s, "the nodes to be idle in sinfo")

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o400)
        sock = self.root / "munge" / "munge.sock"
        # --force: munged refuses a socket directory that is not world-executable (a private scratch dir)
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                                f"--pid-file={self.root}/munge/munged.pid", f"--seed-file={self.root}/munge/seed",
                                f"--log-file={self.root}/log/munged.log"])
        self._wait(lambda: subprocess.run(["munge", "-n", "-S", str(sock)], capture_output=True).returncode == 0,
                   10.0, "munged to answer")

    def _daemon(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                              start_new_session=True)

    def _wait(self, condition, timeout_s: float, what: str) -> None:
        """Until `condition()`; WaitTimeout (with the daemons' logs) on timeout or when a daemon exited first."""
        wait_until(condition, timeout=timeout_s, what=f"local Slurm: {what}", interval=0.2,
                   alive=self.daemons.values(), context=self.logs)

    def stop(self) -> None:
        """Cancel every job and wait for them to end (their processes outlive slurmd otherwise), then stop
        the daemons."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            self._run(["scancel", "--user", str(os.getuid())], check=False)
            try:
                self._wait(lambda: not self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip(), 60.0,
                           "cancelled jobs to end")
            except WaitTimeout:
                pass
        for process in reversed(self.daemons.values()):  # slurmd, slurmctld, munged
            if process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self, lines: int = 40) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- clients
    def _run(self, command: list[str], *, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, env=kwargs.pop("env", self.env),
                                timeout=30, **kwargs)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def node_states(self) -> list[str]:
        return self._run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()

    def sbatch(self, script: Path, *args: str, options: list[str], env: dict[str, str], cwd: Path) -> str:
        """Submit; returns the job id (for an array, the array's job id)."""
        env = dict(env, SLURM_CONF=self.env["SLURM_CONF"], PATH=self.env["PATH"])
        out = self._run(["sbatch", "--parsable", *options, str(script), *args], env=env, cwd=cwd).stdout
        return out.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job` of a job, or of every task of an array, as key -> value."""
        out = self._run(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait_for(self, job_id: str, states: set[str], timeout_s: float) -> list[dict[str, str]]:
        """Wait until every job (array task) of `job_id` is in one of `states`; WaitTimeout on timeout (naming the
        states last seen)."""
        seen: list[dict[str, str]] = []

        def settled() -> list[dict[str, str]]:
            seen[:] = self.jobs(job_id)
            return list(seen) if seen and all(j["JobState"] in states for j in seen) else []

        return wait_until(settled, timeout=timeout_s, what=f"job {job_id} to be {sorted(states)}", interval=1.0,
                          context=lambda: f"states: {[(j['JobId'], j['JobState']) for j in seen]}")

    def scancel(self, job_id: str) -> None:
        self._run(["scancel", job_id])
