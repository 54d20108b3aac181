"""Daemon settings, default locations, and the checks that keep endpoints private."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_CHUNK_SIZE = 256
DEFAULT_L1_SIZE_GB = 1.0
DEFAULT_LEASE_TTL_S = 60.0
DEFAULT_MAX_WORKERS = 2
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# A queued request not started within this is refused. Clients time out later (the adapters
# wait 30 s), so a request they gave up on is never carried out behind their back.
DEFAULT_QUEUE_DEADLINE_S = 10.0


def runtime_dir() -> Path:
    """Where the daemon's Unix sockets live: private to this user (mode 0700)."""
    override = os.environ.get("LMCACHE_MP_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "lmcache-mp"
    return Path(f"/tmp/lmcache-mp-{os.getuid()}")


def default_url() -> str:
    return f"ipc://{runtime_dir() / 'daemon.sock'}"


def ipc_path(url: str) -> Path | None:
    return Path(url.removeprefix("ipc://")) if url.startswith("ipc://") else None


class SocketInUseError(OSError):
    """A live process (another daemon) accepts connections on a Unix socket path we want."""


class SocketClaim:
    """The right to serve one Unix socket path: an exclusive `flock` on PATH.lock, held for as
    long as the daemon serves. The kernel drops it when the process dies, so a crashed daemon
    never blocks its successor; two daemons started at the same moment cannot both pass the
    liveness probe below and bind the same path. The lock file itself stays: unlinking it
    would let a third process lock a fresh file while the second still holds the old one."""

    def __init__(self, path: Path, what: str):
        self._fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise _in_use(path, what) from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def claim_socket_path(path: Path, what: str) -> SocketClaim:
    """Make way for a new Unix socket at `path`, and hold it (release the claim after the socket
    is gone). A socket left by a daemon that died (nothing accepts on it) is removed; one that
    still accepts belongs to a live daemon and is never touched: binding over it would orphan
    that daemon, and our exit would delete its socket."""
    claim = SocketClaim(path, what)
    try:
        _remove_if_stale(path, what)
    except BaseException:
        claim.release()
        raise
    return claim


def _remove_if_stale(path: Path, what: str) -> None:
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)  # a live daemon with a full backlog does not answer in time
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # stale: its daemon is gone
        return
    except TimeoutError:
        pass
    finally:
        probe.close()
    raise _in_use(path, what)  # a daemon of a version without the lock file


def _in_use(path: Path, what: str) -> SocketInUseError:
    return SocketInUseError(f"{what} is in use: another lmcache-mp daemon is serving {path}; "
                            "stop that daemon first or choose another --listen path")


def check_endpoint(url: str, allow_remote: bool) -> None:
    """Refuse endpoints that would expose the daemon beyond this machine, unless asked."""
    if url.startswith("ipc://"):
        if not url.removeprefix("ipc://"):
            raise ValueError("an ipc:// endpoint needs a path")
        return
    if not url.startswith("tcp://"):
        raise ValueError(f"unsupported endpoint {url!r}: use ipc://PATH or tcp://HOST:PORT")
    parts = urlsplit(url)
    host = parts.hostname
    if host is None or parts.port is None:
        raise ValueError(f"tcp endpoint {url!r} needs a host and a port")
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to listen on {url}: it is not a loopback address. The daemon has no "
            "authentication; pass --allow-remote to bind it beyond this machine anyway."
        )


@dataclass
class ServerConfig:
    listen: list[str] = field(default_factory=lambda: [default_url()])
    chunk_size: int = DEFAULT_CHUNK_SIZE
    l1_size_gb: float = DEFAULT_L1_SIZE_GB
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    max_workers: int = DEFAULT_MAX_WORKERS
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    queue_deadline_s: float = DEFAULT_QUEUE_DEADLINE_S
    allow_remote: bool = False
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no metrics endpoint
    l2: list[str] = field(default_factory=list)  # lower storage tiers, in order (storage/tiers.py)
    l2_queue_gb: float | None = None  # write-behind queue per tier; None: a quarter of L1

    @property
    def write_queue_gb(self) -> float:
        return self.l2_queue_gb if self.l2_queue_gb is not None else self.l1_size_gb / 4

    def validate(self) -> None:
        if not self.listen:
            raise ValueError("at least one --listen endpoint is needed")
        for url in self.listen:
            check_endpoint(url, self.allow_remote)
        if self.chunk_size <= 0:
            raise ValueError("--chunk-size must be positive")
        if self.l1_size_gb <= 0:
            raise ValueError("--l1-size-gb must be positive")
        if self.lease_ttl_s <= 0:
            raise ValueError("--lease-ttl-s must be positive")
        if self.metrics_port:
            check_endpoint(f"tcp://{self.metrics_host}:{self.metrics_port}", self.allow_remote)
        if self.l2_queue_gb is not None and self.l2_queue_gb <= 0:
            raise ValueError("--l2-queue-gb must be positive")
        if self.max_workers <= 0 or self.max_queued_requests <= 0 or self.queue_deadline_s <= 0:
            raise ValueError("--max-workers, --max-queued-requests and --queue-deadline-s must be positive")

    @property
    def attach_socket(self) -> Path:
        """The Unix socket on which CPU workers hand over shared-memory descriptors:
        beside the first ipc:// endpoint, else in the runtime directory."""
        for url in self.listen:
            path = ipc_path(url)
            if path is not None:
                return path.with_name(path.name + ".attach")
        return runtime_dir() / f"attach-{os.getpid()}.sock"
