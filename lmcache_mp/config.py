"""The daemon's settings (`ServerConfig`), each declared once, and the checks made on them
before anything starts. Where the sockets live and the checks that keep them private and free
are `sockets.py`'s; this module applies them to the settings.
"""

from __future__ import annotations

import contextlib
import grp
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lmcache_mp.curve import ServerCurve
from lmcache_mp.kv_events.log import DEFAULT_LOG_RECORDS, MIN_LOG_RECORDS
from lmcache_mp.kv_events.publisher import replay_endpoint
from lmcache_mp.settings import SettingError, positive, setting
from lmcache_mp.settings import check as check_settings
from lmcache_mp.sockets import (
    SocketAccess,
    check_authenticated,
    check_endpoint,
    check_free,
    check_writable_directory,
    default_url,
    ipc_path,
    runtime_dir,
)
from lmcache_mp.storage.pool.directory import stopped_note, stopped_pool_files
from lmcache_mp.storage.pool.location import default_pool_file

DEFAULT_CHUNK_SIZE = 256
DEFAULT_L1_SIZE_GB = 1.0
DEFAULT_LEASE_TTL_S = 60.0
DEFAULT_MAX_WORKERS = 2
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# A queued request not started within this is refused. Clients time out later (the adapters
# wait 30 s), so a request they gave up on is never carried out behind their back.
DEFAULT_QUEUE_DEADLINE_S = 10.0
# A stopped daemon's pool file is removed by another daemon's start after this long unused: a
# restart within it (a crash, an upgrade) still finds its pool.
DEFAULT_POOL_FILE_TTL_S = 600.0


def check_tier_directory(url: str) -> None:
    """A disk tier's directory must be writable; other tiers are checked when they connect."""
    parts = urlsplit(url)
    if parts.scheme == "disk" and parts.path.startswith("/"):
        check_writable_directory(Path(parts.path), f"the disk tier's directory of {url}")


def _chunk_size(value: int) -> str | None:
    if value > 0 and value % 16 == 0:
        return None
    return "must be a positive multiple of 16 (vLLM's block sizes are)"


def _pool_size(value: float) -> str | None:
    return None if value > 0 else "must be positive"


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _known_group(value: str) -> str | None:
    try:
        grp.getgrnam(value)
    except KeyError:
        return "no such group on this machine"
    return None


def _existing_file(value: str) -> str | None:
    return None if Path(value).is_file() else "no such file"


def _existing_directory(value: str) -> str | None:
    return None if Path(value).is_dir() else "no such directory"


def _log_records(value: int) -> str | None:
    return None if value >= MIN_LOG_RECORDS else f"must be at least {MIN_LOG_RECORDS}"


def _port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a TCP port (1-65535), or 0 for none"


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class ServerConfig:
    """The daemon's settings: each declared once here (see settings.py for the flags, the
    environment variables and the config file derived from these declarations)."""

    listen: list[str] = setting(
        lambda: [default_url()],
        "endpoint to bind; repeat for several. ipc://PATH (a Unix socket, created mode 0600) or "
        "tcp://127.0.0.1:PORT (only with CURVE keys or allow_unauthenticated_tcp)", metavar="URL",
        default_text="ipc://$XDG_RUNTIME_DIR/lmcache-mp/daemon.sock (or /tmp/lmcache-mp-$UID/)")
    socket_group: str | None = setting(
        None, "a group whose members may use the daemon's Unix sockets (mode 0660 in a 0750 "
        "directory), for a vLLM running as another user; by default only the daemon's own user",
        check=_known_group, metavar="GROUP", default_text="none (0600 sockets, 0700 directory)")
    curve_secret_key: str | None = setting(
        None, "the daemon's CURVE secret key file (NAME.key_secret, from `lmcache-mp keygen`): "
        "clients must then authenticate, on every endpoint, and TCP may listen, beyond loopback too",
        check=_existing_file, metavar="PATH", default_text="none (no authentication)")
    curve_allowed_keys: str | None = setting(
        None, "directory of the public key files (*.key) of the clients allowed to connect; "
        "needed with curve_secret_key", check=_existing_directory, metavar="DIR")
    allow_unauthenticated_tcp: bool = setting(
        False, "allow tcp:// endpoints, loopback ones included, WITHOUT authentication (CURVE): "
        "any local user, and any process in any container sharing the network namespace, can then "
        "read, overwrite and clear the cache and unregister workers. Off, tcp:// needs CURVE keys; "
        "ipc:// (a Unix socket only this user may open) or CURVE are the secure options")
    insecure_remote: bool = setting(
        False, "allow TCP endpoints beyond loopback WITHOUT authentication (implies "
        "allow_unauthenticated_tcp): anyone who reaches the port can read and write the cache. "
        "Only on a trusted network; prefer CURVE")
    lmcache_listen: list[str] = setting(
        list, "also serve LMCache's own vLLM connector on this endpoint (lmcache 0.5.6's multiprocess "
        "wire: LMCacheMPConnector, lmcache_driven transfers, CPU shared-memory caches), from the same "
        "pool; repeat for several. tcp://127.0.0.1:5555 is where that connector looks by default; "
        "that connector cannot authenticate, so tcp:// needs allow_unauthenticated_tcp whatever the "
        "CURVE keys (ipc://PATH, a Unix socket only this user may open, does not)", metavar="URL",
        default_text="none")
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE, "tokens per stored chunk; a multiple of vLLM's block size", check=_chunk_size)
    l1_size_gb: float = setting(
        DEFAULT_L1_SIZE_GB, "CPU memory pool in GiB, prepared (faulted in; pinned with "
        "cudaHostRegister when CUDA is present) in 1 GiB pieces in the background: the daemon "
        "answers at once, STOREs find NO_SPACE beyond what is ready", check=_pool_size)
    pool_file: str = setting(
        "auto", "the file the CPU pool lives in, so that the next daemon adopts every "
        "chunk it holds (warm restart: a crash, an upgrade or `systemctl restart` loses nothing). "
        "On a tmpfs (/dev/shm; mounted huge=advise for huge pages: copies 3-4 percent faster); "
        "created 0600 in a 0700 directory; adopted only if it is this user's, 0600, and of this "
        "l1_size_gb. Its memory stays allocated (shared memory) while no daemon runs, until the next "
        "daemon adopts it, `lmcache-mp clear --pool-file`, the start of another daemon in its directory "
        "once unused for pool_file_ttl_s, or a reboot. Empty: anonymous memory, lost at every restart",
        metavar="PATH", default_text="auto: /dev/shm/lmcache-mp-$UID/pool-<digest of the runtime directory "
        "and the first endpoint>")
    fresh_pool: bool = setting(
        False, "discard what the pool file holds and start with an empty pool")
    pool_file_ttl_s: float = setting(
        DEFAULT_POOL_FILE_TTL_S, "at start, remove the pool files of stopped daemons in the pool file's "
        "directory that no process holds and that no daemon used for this many seconds (each holds its "
        "memory until removed, a tmpfs until a reboot; a daemon restarted within it adopts its own); 0: "
        "every stopped daemon's. `lmcache-mp pools` lists them", check=_not_negative)
    l2: list[str] = setting(
        list, "a storage tier below the CPU pool; repeat for several, fastest first. "
        "disk:///ABS/PATH?size_gb=N: a local (NVMe) directory, kept across restarts, LRU-evicted "
        "beyond N GiB, locked against a second daemon. redis://[:PASSWORD@]HOST:PORT/DB (rediss:// "
        "for TLS), redis+cluster://HOST:PORT[,HOST:PORT...]: Valkey/Redis, shared by a fleet "
        "(?prefix=NAME namespaces keys, ?ttl_s=S expires them). lmcache://HOST:PORT: a v1 remote "
        "server. s3://BUCKET[/PREFIX]?endpoint_url=URL&region=NAME: an S3-compatible bucket shared "
        "by a fleet (the [s3] extra; credentials from the standard AWS chain, never the URL). "
        "Network tiers take ?timeout_s=T (default 1; 2 for S3) and turn failures into misses, retried "
        "in the background. Chunks are written behind STOREs and read back (verified) by LOOKUPs",
        metavar="URL")
    l2_queue_gb: float | None = setting(
        None, "write-behind queue per lower tier: chunks waiting to be written stay pinned in the "
        "CPU pool up to this size; past it, new chunks are not written to that tier (counted as "
        "skipped)", check=positive, default_text="a quarter of l1_size_gb")
    lease_ttl_s: float = setting(
        DEFAULT_LEASE_TTL_S, "seconds a LOOKUP keeps its hits leased for the RETRIEVE that follows, "
        "if the client never retrieves or ends the session", check=positive)
    max_workers: int = setting(
        DEFAULT_MAX_WORKERS, "threads that run STOREs and registrations, and as many again for "
        "RETRIEVEs (a load never queues behind a store); a RETRIEVE of several chunks is split "
        "over the idle ones", check=positive)
    max_queued_requests: int = setting(
        DEFAULT_MAX_QUEUED_REQUESTS, "requests waiting for a worker thread before new ones are "
        "refused with OVERLOADED", check=positive)
    queue_deadline_s: float = setting(
        DEFAULT_QUEUE_DEADLINE_S, "a queued request not started within this many seconds is "
        "refused with OVERLOADED instead of run late; keep it below the clients' timeout",
        check=positive)
    kv_events_listen: str | None = setting(
        None, "publish KV events for KV-aware routers (llm-d, Dynamo) on this ZeroMQ PUB endpoint: "
        "every chunk each tier gains and loses, in vLLM's KV event format (BlockStored, "
        "BlockRemoved, AllBlocksCleared; medium CPU for the pool, STORAGE for lower tiers), for "
        "every engine and model the daemon serves. ipc://PATH or tcp:// under the same rules as "
        "--listen (CURVE keys apply here too)", metavar="URL", default_text="none (not published)")
    kv_events_replay: str | None = setting(
        None, "the ROUTER endpoint where a subscriber that missed batches asks for them again "
        "(vLLM's replay protocol)", metavar="URL",
        default_text="beside kv_events_listen: PATH.replay for ipc://PATH, the next port for tcp://")
    kv_events_log_records: int = setting(
        DEFAULT_LOG_RECORDS, "KV events the daemon's log keeps for its readers (the PUB endpoint's "
        "publisher, connectors' KV_EVENTS), ~150 bytes each: a reader further behind loses events "
        "and resyncs", check=_log_records)
    metrics_port: int = setting(
        0, "serve Prometheus metrics over HTTP on this port; 0: off", check=_port)
    metrics_host: str = setting(
        "127.0.0.1", "address for the metrics endpoint (counters only: no KV, no secrets); "
        "0.0.0.0 in a container, for Prometheus to scrape it")
    log_level: str = setting("INFO", "log verbosity", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = setting(
        "text", "log lines as text, or one JSON object per line for log shippers",
        choices=("text", "json"))

    @property
    def socket_access(self) -> SocketAccess:
        return SocketAccess(self.socket_group)

    @property
    def server_curve(self) -> ServerCurve | None:
        """The CURVE keys clients must authenticate against; None without them."""
        if (self.curve_secret_key is None) != (self.curve_allowed_keys is None):
            raise ValueError("CURVE needs both --curve-secret-key and --curve-allowed-keys")
        if self.curve_secret_key is None or self.curve_allowed_keys is None:
            return None
        return ServerCurve(Path(self.curve_secret_key), Path(self.curve_allowed_keys))

    @property
    def write_queue_gb(self) -> float:
        return self.l2_queue_gb if self.l2_queue_gb is not None else self.l1_size_gb / 4

    def validate(self) -> None:
        """Every check that can be made before anything starts; ValueError (one line saying
        what to change) on the first that fails."""
        check_settings(self)
        self._check_pool_memory()
        if not self.listen:
            raise ValueError("at least one --listen endpoint is needed")
        curve = self.server_curve
        if curve is not None:
            curve.check()
        for url in self.listen:
            check_endpoint(url, self.insecure_remote or curve is not None)
            check_authenticated(url, curve is not None,
                                self.allow_unauthenticated_tcp or self.insecure_remote)
            path = ipc_path(url)
            if path is not None:  # before check_free, which probes it by writing a file there
                self.socket_access.check_directory(path.parent)
            check_free(url)
        self.socket_access.check_directory(self.attach_socket.parent)
        self._check_lmcache_listen()
        for url in self.kv_events_urls:
            check_endpoint(url, self.insecure_remote or curve is not None)
            check_authenticated(url, curve is not None,
                                self.allow_unauthenticated_tcp or self.insecure_remote)
            if url in self.listen:
                raise ValueError(f"{url} is both a --listen and a KV events endpoint")
            check_free(url)
        if self.metrics_port:
            check_free(f"tcp://{self.metrics_host}:{self.metrics_port}")
        for url in self.l2:
            check_tier_directory(url)

    def _check_lmcache_listen(self) -> None:
        """The lmcache door's endpoints: as --listen's, except that CURVE cannot cover them (LMCache's
        connector does not authenticate), so TCP always needs allow_unauthenticated_tcp."""
        for url in self.lmcache_listen:
            check_endpoint(url, self.insecure_remote)
            if url.startswith("tcp://") and not (self.allow_unauthenticated_tcp or self.insecure_remote):
                raise ValueError(
                    f"refusing to serve LMCache's connector on {url} without --allow-unauthenticated-tcp: "
                    "that connector cannot authenticate, so any local user (and any process in a container "
                    "sharing this network namespace) could read, overwrite and clear the cache. Use "
                    "ipc://PATH (the connector's lmcache.mp.server_urls takes it), or pass the flag to "
                    "accept that risk")
            if url in self.listen or self.lmcache_listen.count(url) > 1:
                raise ValueError(f"{url} is given twice (--listen and --lmcache-listen, or twice the latter)")
            path = ipc_path(url)
            if path is not None:
                self.socket_access.check_directory(path.parent)
            check_free(url)

    @property
    def kv_events_urls(self) -> list[str]:
        """The KV event PUB endpoint and its replay endpoint; [] when events are not published."""
        if not self.kv_events_listen:
            return []
        return [self.kv_events_listen, self.kv_events_replay or replay_endpoint(self.kv_events_listen)]

    @property
    def pool_path(self) -> Path | None:
        """The pool file (`pool/file.py`, "auto" resolved); None for a pool in anonymous memory."""
        if not self.pool_file:
            return None
        return default_pool_file(self.listen) if self.pool_file == "auto" else Path(self.pool_file)

    def _check_pool_memory(self) -> None:
        """The pool is allocated in full. What the pool file at its path holds goes to it (adopted,
        or replaced), and so does what the stale files its start removes hold (`pool/directory.py`); the
        stopped daemons' files it keeps are named if memory is short."""
        available = available_memory_bytes()
        if available is None:
            return
        path = self.pool_path
        if path is not None:
            with contextlib.suppress(OSError):  # what it holds, not its (sparse) size
                available += os.stat(path).st_blocks * 512
        directory = (path or default_pool_file(self.listen)).parent
        stopped = stopped_pool_files(directory, keep=path)
        removed = [info for info in stopped if path is not None and info.unused_s >= self.pool_file_ttl_s]
        available += sum(info.held_bytes for info in removed)
        if self.l1_size_gb * 2**30 > available:
            kept = [info for info in stopped if info not in removed]
            raise SettingError(f"l1_size_gb (--l1-size-gb) is {self.l1_size_gb}: the machine has only "
                               f"{available / 2**30:.1f} GiB available: lower it (the pool is allocated "
                               f"in full){stopped_note(kept, directory)}")

    @property
    def attach_socket(self) -> Path:
        """The Unix socket on which CPU workers hand over shared-memory descriptors:
        beside the first ipc:// endpoint, else in the runtime directory."""
        for url in self.listen:
            path = ipc_path(url)
            if path is not None:
                return path.with_name(path.name + ".attach")
        return runtime_dir() / f"attach-{os.getpid()}.sock"
