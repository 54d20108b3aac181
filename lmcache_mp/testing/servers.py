"""Real servers for the tests and benchmarks: Valkey/Redis (a standalone server and a 3-master
cluster, on free loopback ports, in a temporary directory, with no persistence) and the v1
remote server (`lmcache-mp remote-server`); each stopped at the end."""

from __future__ import annotations

import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_mp.v1remote.client import V1Connection

REDIS_SERVER = shutil.which("redis-server")  # None where it is not installed (scripts/setup.sh test)
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT_S = 20.0


@dataclass
class RedisServer:
    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--logfile", str(self.workdir / "log"),
             *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.cli("PING", check=False).strip() not in ("PONG", "NOAUTH Authentication required."):
            assert self.proc.poll() is None, (self.workdir / "log").read_text()
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cli(self, *args: str, check: bool = True) -> str:
        out = subprocess.run([REDIS_CLI, "-p", str(self.port), "--no-auth-warning", *args],
                             capture_output=True, text=True, timeout=30)
        if check:
            assert out.returncode == 0, out.stderr
        return out.stdout

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port: port + 10000)."""
    for _ in range(200):
        port = random.randrange(20000, 55000)
        if all(_is_free(p) for p in ((port, port + 10000) if cluster_bus else (port,))):
            return port
    raise RuntimeError("no free port")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def redis_server(workdir: Path, *extra: str) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), workdir, extra).start()
    try:
        yield server
    finally:
        server.kill()


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[list[RedisServer]]:
    """`masters` nodes, no replicas, made into a cluster with `redis-cli --cluster create`.
    `cluster-require-full-coverage no`: when a node dies, the others go on serving their slots
    (the setting docs/deployment.md recommends for a cache)."""
    nodes: list[RedisServer] = []
    try:
        for i in range(masters):
            port = free_port(cluster_bus=True)
            nodes.append(RedisServer(port, workdir / f"node{i}", (
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no")).start())
        nodes[0].cli("--cluster", "create", *(n.address for n in nodes), "--cluster-replicas", "0",
                     "--cluster-yes")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in nodes):
            assert time.monotonic() < deadline, "the cluster did not form"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.kill()


LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
CLOSED = re.compile(r": closed$", re.MULTILINE)  # a connection's end, at DEBUG


@contextmanager
def redis_url(tmp: Path) -> Iterator[str]:
    """A standalone server, as a tier URL."""
    with redis_server(tmp / "redis") as server:
        yield f"redis://{server.address}/0"


@contextmanager
def redis_cluster_url(tmp: Path) -> Iterator[str]:
    """A 3-master cluster, as a tier URL naming two of its nodes as seeds."""
    with redis_cluster(tmp / "cluster") as nodes:
        yield "redis+cluster://" + ",".join(n.address for n in nodes[:2])


def command() -> list[str]:
    """How to run `lmcache-mp` from this venv."""
    script = Path(sys.executable).with_name("lmcache-mp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_mp.cli"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def connect(self, timeout: float = 5.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def client(self) -> V1Connection:
        return V1Connection("127.0.0.1", self.port, timeout_s=5.0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise


def start_v1_server(tmp: Path, *args: str, size_gb: str = "0.05") -> ServerProcess:
    """`lmcache-mp remote-server` on port 0; its port is read from its "listening" log line (no
    race for a free port), then it must accept a connection."""
    log_path = tmp / f"remote-server-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*command(), "remote-server", "--listen", "tcp://127.0.0.1:0",
                                 "--size-gb", size_gb, "--log-level", "DEBUG", *args],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (match := LISTENING.search(log_path.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"remote-server did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.02)
    server = ServerProcess(proc, int(match.group(1)), log_path)
    server.connect().close()
    # Wait until the server has seen this probe close: a test that counts connections (the
    # --max-connections limit) must start from none.
    deadline = time.monotonic() + 10
    while not CLOSED.search(server.log()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"remote-server never saw its probe close:\n{server.log()}")
        time.sleep(0.01)
    return server
