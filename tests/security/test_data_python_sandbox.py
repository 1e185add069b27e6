"""Issue 29, item 7: the python tool's sandbox holds (explorer.python_sandbox: bwrap, the default). The attacks of the
issue, each run as the model's code through the real tool (ToolBox, as the tool_agent workflow calls it), each
shown to work without the sandbox (`none`, the explicit opt-out) and to fail inside it:
- read the explorer's environment through /proc/<parent>/environ;
- write outside the working directory;
- connect to a local TCP listener (the broker, the object server);
- leave a process running after the call;
- start more processes than the limit.
And an explorer whose sandbox cannot work here refuses to start, saying what to do."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rft.agent_tools import ToolBox, ToolCall, ToolError, ToolLimits
from rft.agent_tools import python as python_tool
from tests.waiting import wait_until

SECRET = f"rft-secret-{uuid.uuid4().hex}"


def run(code: str, sandbox: str, **limits) -> str:
    box = ToolBox(["python"], ToolLimits(timeout_s=10.0, memory_mb=512, output_chars=4000, sandbox=sandbox, **limits))
    return box.run(ToolCall("python", {"code": code}))


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
    inside = run(code, "bwrap")
    assert "Read-only file system" in inside and not target.exists(), inside
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
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on the PATH
    try:
        with pytest.raises(ToolError, match=r"explorer.python_sandbox: bwrap is not installed here: install "
                                            r"bubblewrap .*or set explorer.python_sandbox: none"):
            ToolBox(["python"], ToolLimits(sandbox="bwrap"))
        ToolBox(["python"], ToolLimits(sandbox="none"))  # the explicit opt-out
    finally:
        python_tool.check_sandbox.cache_clear()
