"""The python tool's sandbox holds (explorer.python_sandbox: bwrap, the default). The attacks, each run as the model's
code through the real tool (ToolBox, as the tool_agent workflow calls it), most shown to work without the sandbox
(`none`, the explicit opt-out) and to fail inside it.
Issue 29, item 7:
- read the explorer's environment through /proc/<parent>/environ;
- write outside the working directory;
- connect to a local TCP listener (the broker, the object server);
- leave a process running after the call;
- start more processes than the limit.
Issue 54, item 1:
- replace the tool's output file by a symlink (to a secret, to the explorer's own environ), a FIFO, a directory or
  a hard link: the explorer reads what the code printed, from its own descriptor, in both modes;
- read a world-readable file of the host (a run directory, a home), list /home, /run, /etc;
- connect to a Unix socket of the host (a path, an abstract name);
- see the host's pid 1;
- fill the working directory past `workdir_mb`, fork without end, allocate past `memory_mb`.
And an explorer whose sandbox cannot work here refuses to start, saying what to do."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from rft.agent_tools import ToolBox, ToolCall, ToolError, ToolLimits
from rft.agent_tools import python as python_tool
from tests.waiting import wait_until

SECRET = f"rft-secret-{uuid.uuid4().hex}"


def run(code: str, sandbox: str, **limits) -> str:
    # 60 s: a call must not time out because the machine is busy (a loaded 2-core machine took over 10 s once)
    settings = {"timeout_s": 60.0, "memory_mb": 512, "output_chars": 4000, **limits}
    return ToolBox(["python"], ToolLimits(sandbox=sandbox, **settings)).run(ToolCall("python", {"code": code}))


def run_in_time(code: str, sandbox: str) -> str:
    """`run`, in a thread: a call that blocks the explorer's thread fails the test instead of hanging it."""
    answers: list[str] = []
    threading.Thread(target=lambda: answers.append(run(code, sandbox)), daemon=True).start()
    return wait_until(lambda: answers, timeout=90, what="the tool's answer (a blocked explorer thread gives none)")[0]


@pytest.fixture
def explorer():
    """A process holding a credential in its environment, as an explorer does (KAFKA_PASSWORD, AWS keys...)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                               env={**os.environ, "RFT_TEST_SECRET": SECRET})
    yield process.pid
    process.kill()
    process.wait()


def test_reading_the_explorers_environment(explorer):
    code = f"print(open('/proc/{explorer}/environ', 'rb').read().decode(errors='replace'))"
    assert SECRET in run(code, "none")
    inside = run(code, "bwrap")
    assert SECRET not in inside and "No such file or directory" in inside, inside
    listing = run("import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", "bwrap")
    assert json.loads(listing) == [1, 2], listing  # bwrap (the namespace's init) and the code: nothing else in view


@pytest.fixture
def open_dir():
    """A directory anyone may write to (mode 0777, under /tmp): only the sandbox stands in the way."""
    path = Path(tempfile.mkdtemp(prefix="rft-sandbox-open-", dir="/tmp"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


def test_writing_outside_the_working_directory(open_dir):
    target = open_dir / "planted.txt"
    code = f"open({str(target)!r}, 'w').write('x'); open('here.txt', 'w').write('y'); print('wrote')"
    inside = run(code, "bwrap")  # the host's /tmp is not there: the sandbox's /tmp is its own
    assert "No such file or directory" in inside and not target.exists(), inside
    assert "Read-only file system" in run("open('/usr/planted.txt', 'w')", "bwrap")
    assert run("open('here.txt', 'w').write('y'); print(open('here.txt').read())", "bwrap") == "y\n"  # its own dir
    assert run(code, "none") == "wrote\n" and target.exists()


def test_connecting_to_a_local_listener():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
    try:
        inside = run(code, "bwrap")
        assert "connected" not in inside and ("Connection refused" in inside or "unreachable" in inside), inside
        assert not accepted
        assert run(code, "none") == "connected\n"
        wait_until(lambda: accepted, timeout=10, what="the unsandboxed connection accepted")
    finally:
        listener.close()


def test_no_process_outlives_the_call(tmp_path):
    marker = f"rft-sandbox-sleeper-{uuid.uuid4().hex}"
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(300)', {marker!r}], start_new_session=True); print('started')")

    def sleepers() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                continue
        return found

    assert run(code, "bwrap") == "started\n"
    wait_until(lambda: not sleepers(), timeout=10, what="the sandboxed background process gone")
    assert run(code, "none") == "started\n"  # without the sandbox, a new session escapes the group kill
    try:
        assert sleepers()
    finally:
        for pid in sleepers():
            os.kill(pid, 9)


def test_the_process_limit_holds():
    code = ("import os\nn = 0\ntry:\n    for _ in range(64):\n        if os.fork() == 0:\n            import time\n"
            "            time.sleep(20)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
            "    print('refused after', n, type(e).__name__)\n")
    inside = run(code, "bwrap", max_processes=8)
    assert inside.startswith("refused after ") and int(inside.split()[2]) < 8, inside


def test_an_explorer_refuses_to_start_when_the_sandbox_cannot_work(monkeypatch, tmp_path):
    python_tool.check_sandbox.cache_clear()
    for name in ("prlimit", "setpriv", "env"):  # all the sandbox runs but bwrap
        (tmp_path / name).symlink_to(shutil.which(name))
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        with pytest.raises(ToolError, match=r"explorer.python_sandbox: bwrap is not installed here: install "
                                            r"bubblewrap .*or set explorer.python_sandbox: none"):
            ToolBox(["python"], ToolLimits(sandbox="bwrap"))
        ToolBox(["python"], ToolLimits(sandbox="none"))  # the explicit opt-out
        python_tool.check_sandbox.cache_clear()
        (tmp_path / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        (tmp_path / "bwrap").chmod(0o755)  # a container that forbids namespaces
        with pytest.raises(ToolError, match=r"explorer.python_sandbox: bwrap cannot create its sandbox here \(bwrap: "
                                            r"No permissions to create new namespace\): install bubblewrap"):
            ToolBox(["python"], ToolLimits(sandbox="bwrap"))
    finally:
        python_tool.check_sandbox.cache_clear()


# Issue 54, item 1: the output is read from the explorer's own descriptor. The code prints, then puts something else
# where a tool writing to a file named `output` in its working directory would look (the tool before the fix did).
REPLACE_OUTPUT = """import os
print('real output', flush=True)
try:
    os.remove('output')
except OSError:
    pass
{replace}
print('replaced', flush=True)
"""


@pytest.fixture
def secret_file(tmp_path):
    """A file only the explorer's user may read."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
@pytest.mark.parametrize("replace", [
    "os.symlink({secret!r}, 'output')",
    "os.symlink('/proc/self/environ', 'output')",  # the explorer's own environment, keys and credentials
    "os.mkfifo('output')",  # reopening it would block the explorer's thread for good
    "os.mkdir('output')",
    "open('decoy', 'w').write('decoy'); os.link('decoy', 'output')",
], ids=["symlink-to-a-secret", "symlink-to-the-explorers-environ", "fifo", "directory", "hard-link"])
def test_the_output_cannot_be_swapped(secret_file, sandbox, replace):
    answer = run_in_time(REPLACE_OUTPUT.format(replace=replace.format(secret=str(secret_file))), sandbox)
    assert answer == "real output\nreplaced\n", answer


@pytest.fixture
def host_dir():
    """A directory of the host anyone may read (mode 0755 under /tmp, as a run directory or a home can be) with a
    readable file and a Unix socket anyone may connect to (a daemon's: D-Bus, docker.sock, vLLM's IPC); and a
    listening abstract Unix socket. Yields (directory, abstract name)."""
    path = Path(tempfile.mkdtemp(prefix="rft-sandbox-host-", dir="/tmp"))
    path.chmod(0o755)
    (path / "credentials").write_text(SECRET)
    (path / "credentials").chmod(0o644)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path / "daemon.sock"))
    (path / "daemon.sock").chmod(0o777)
    listener.listen()
    abstract_name = f"rft-sandbox-{uuid.uuid4().hex}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + abstract_name)
    abstract.listen()
    yield path, abstract_name
    listener.close()
    abstract.close()
    shutil.rmtree(path)


LOOK = """import json, os
def look(path):
    try:
        return sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as e:
        return type(e).__name__
print(json.dumps({{p: look(p) for p in {paths!r}}}))
"""


def test_no_file_of_the_host_beyond_the_interpreter(host_dir):
    directory, _ = host_dir
    home = os.path.expanduser("~")
    paths = [str(directory / "credentials"), str(directory), "/home", "/run", "/var", "/etc/passwd", "/etc", home]
    code = LOOK.format(paths=paths)
    assert SECRET in run(code, "none")
    seen = json.loads(run(code, "bwrap"))
    assert all(seen[p] == "FileNotFoundError" for p in paths[:6]), seen
    assert seen["/etc"] == ["ld.so.cache", "ld.so.conf", "ld.so.conf.d"], seen  # the dynamic loader's files only
    interpreter = {Path(p).relative_to(home).parts[0] for p in python_tool.interpreter_paths()
                   if Path(p).is_relative_to(home)}
    assert seen[home] in ("FileNotFoundError", sorted(interpreter)), seen  # at most the way to the interpreter


def test_no_unix_socket_of_the_host(host_dir):
    directory, abstract_name = host_dir
    code = ("import socket\nfor address in ({path!r}, '\\0' + {name!r}):\n    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(address)\n        print('connected')\n    except OSError as e:\n"
            "        print(type(e).__name__)\n").format(path=str(directory / "daemon.sock"), name=abstract_name)
    assert run(code, "none") == "connected\nconnected\n"
    assert run(code, "bwrap") == "FileNotFoundError\nConnectionRefusedError\n"


def test_pid_1_is_the_sandboxs_own():
    code = ("print(open('/proc/1/cmdline').read().split('\\0')[0])\ntry:\n    print(open('/proc/1/environ').read())\n"
            "except OSError as e:\n    print(type(e).__name__)")
    init, environ = run(code, "bwrap").splitlines()[:2]
    assert init.endswith("bwrap"), init  # the namespace's init, not the host's
    assert environ == "PermissionError" if os.geteuid() == 0 else "RFT" not in environ, environ


def test_the_working_directory_is_capped():
    code = ("import errno\nfor place in ('/tmp', '/dev/shm'):\n    n = 0\n    try:\n        while n < 16:\n"
            "            open(f'{place}/f{n}', 'wb').write(b'x' * (1 << 20))\n            n += 1\n"
            "    except OSError as e:\n        print(place, n, errno.errorcode[e.errno])\n")
    lines = run(code, "bwrap", workdir_mb=2).splitlines()
    assert [line.split()[0] for line in lines] == ["/tmp", "/dev/shm"], lines
    assert all(line.endswith("ENOSPC") and int(line.split()[1]) <= 2 for line in lines), lines


def test_a_fork_bomb_is_contained():
    code = ("import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    started = time.monotonic()
    answer = run(code, "bwrap", timeout_s=1.0, max_processes=8)
    assert answer.startswith("error: timed out after 1 s") and time.monotonic() - started < 6, answer
    uid = int(answer.splitlines()[1])

    def of_uid() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    found.append(pid)
        return found

    wait_until(lambda: not of_uid(), timeout=10, what=f"every process of the call's user {uid} gone")


def test_memory_is_capped():
    answer = run("x = bytearray(1 << 30)", "bwrap", memory_mb=256)  # 1 GiB against 256 MiB of address space
    assert answer.startswith("error: exit status 1") and answer.rstrip().endswith("MemoryError"), answer
