"""Daemon settings, default locations, and the checks that keep endpoints private and free."""

from __future__ import annotations

import errno
import fcntl
import grp
import ipaddress
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lmcache_mp.curve import ServerCurve
from lmcache_mp.settings import check as check_settings
from lmcache_mp.settings import setting

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


@dataclass(frozen=True)
class SocketAccess:
    """Who may use the daemon's Unix sockets: its own user only (0600 in a 0700 directory), or
    also one group (0660 in a 0750 directory), for a vLLM that runs as another user."""

    group: str | None = None

    @property
    def directory_mode(self) -> int:
        return 0o700 if self.group is None else 0o750

    def check_directory(self, path: Path) -> None:
        """Refuse (ValueError) an existing `path` that `make_directory` would refuse, changing
        nothing: the check made before anything starts."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # made by make_directory; check_free checks that it can be
        _check_is_directory(path, st)
        self._check_private(path, st)

    def make_directory(self, path: Path) -> None:
        """Create `path` (and parents) for sockets, mode 0700 (0750 and the group's with a group),
        or take an existing one that nobody else controls (see `_check_private`). A directory found
        in a shared place (/tmp/lmcache-mp-$UID) may have been made by another user, to put their
        own socket where the workers hand over their KV caches: it is checked through a descriptor
        opened without following a symbolic link, and that descriptor is what gets the mode."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            created = False
        fd = _open_directory(path)
        try:
            st = os.fstat(fd)
            if not created:
                self._check_private(path, st)
            if self.group is not None:
                os.fchown(fd, -1, grp.getgrnam(self.group).gr_gid)
                os.fchmod(fd, 0o750)
            elif created or _beyond(st, 0o700):
                os.fchmod(fd, 0o700)  # the umask may have left less; a runtime directory more
        finally:
            os.close(fd)

    def _check_private(self, path: Path, st: os.stat_result) -> None:
        """An existing socket directory must be ours, and nobody else's to write in. One others
        may only read or pass through is taken if it is the runtime directory, the daemon's own,
        which make_directory then narrows (a container volume starts 0755); any other directory
        may be shared (--listen ipc:///run/x.sock): narrowing it would lock its other users out,
        so it is refused."""
        where = f"the socket directory {path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
        if st.st_uid != os.geteuid():
            raise ValueError(f"{where} is not owned by this user (uid {os.geteuid()}): another user may "
                             "have made it first, to be handed the workers' KV caches; remove it or "
                             "choose another directory")
        beyond = _beyond(st, self.directory_mode)
        if beyond & 0o022:
            raise ValueError(f"{where} is writable by others: they could put their own sockets in it; "
                             "choose a directory only this user may write in "
                             f"(mode {self.directory_mode:04o})")
        if beyond and not _is_runtime_dir(path):
            raise ValueError(f"{where} is open to others: make it mode {self.directory_mode:04o} "
                             "or choose another directory")

    def secure(self, socket_path: Path) -> None:
        """Set a freshly bound socket's mode (and group)."""
        if self.group is None:
            os.chmod(socket_path, 0o600)
        else:
            os.chown(socket_path, -1, grp.getgrnam(self.group).gr_gid)
            os.chmod(socket_path, 0o660)


def _beyond(st: os.stat_result, allowed: int) -> int:
    """The permission bits of `st` beyond `allowed`."""
    return stat.S_IMODE(st.st_mode) & 0o777 & ~allowed


def _is_runtime_dir(path: Path) -> bool:
    return os.path.abspath(path) == os.path.abspath(runtime_dir())


def _check_is_directory(path: Path, st: os.stat_result) -> None:
    """`st` (from lstat) is a directory itself, not a symbolic link to one: whoever may change
    the link could move the sockets, and where the workers look for them, elsewhere."""
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"the socket directory {path} is a symbolic link (owner uid {st.st_uid}): "
                         "give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"the socket directory {path} (owner uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):04o}) is not a directory")


def _open_directory(path: Path) -> int:
    """A descriptor of the directory `path` itself, never of a symbolic link's target."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        _check_is_directory(path, os.lstat(path))
        raise  # a directory again: changed meanwhile, refused all the same


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


def check_endpoint(url: str, remote_ok: bool) -> None:
    """Refuse endpoints that would expose the daemon beyond this machine, unless `remote_ok`
    (its clients authenticate with CURVE, or the operator said the network is trusted)."""
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
    if remote_ok or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to listen on {url}: it is not a loopback address. Give the daemon CURVE keys "
            "(--curve-secret-key and --curve-allowed-keys; `lmcache-mp keygen` makes them) so that "
            "clients must authenticate, or pass --insecure-remote on a trusted network."
        )


def check_authenticated(url: str, curve: bool, allow_unauthenticated: bool) -> None:
    """Refuse a tcp:// endpoint without CURVE unless the operator accepted that: a TCP port,
    loopback too, is open to every user of this machine (and every container sharing its
    network namespace), whereas a Unix socket is the daemon's user's alone."""
    if not url.startswith("tcp://") or curve or allow_unauthenticated:
        return
    raise ValueError(
        f"refusing to listen on {url} without authentication: any local user (and any process in "
        "a container sharing this network namespace) could read, overwrite and clear the cache and "
        "unregister workers. Use ipc://PATH (a Unix socket only this user may open), or give the "
        "daemon CURVE keys (--curve-secret-key and --curve-allowed-keys; `lmcache-mp keygen` makes "
        "them), or pass --allow-unauthenticated-tcp to accept that risk."
    )


def check_free(url: str) -> None:
    """Refuse, before anything starts, a TCP port another process holds, or an ipc:// path in
    a directory we may not create sockets in. (A live daemon on the same ipc:// path is found
    later, by `claim_socket_path`, which can tell it from a stale socket.)"""
    path = ipc_path(url)
    if path is not None:
        check_writable_directory(path.parent, f"the socket directory of {url}")
        return
    parts = urlsplit(url)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the listeners themselves do (ZeroMQ and the metrics' HTTP server): without it, the
        # connections of the last daemon on this port that linger in TIME_WAIT (60 s after any
        # use, one /metrics scrape is enough) would refuse its restart. A port some process still
        # listens on is refused all the same.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts.hostname, parts.port))
        except OSError as err:
            raise ValueError(f"cannot listen on {url}: {err.strerror}; choose another port or stop "
                             "the process that holds it") from None


def check_writable_directory(path: Path, what: str) -> None:
    """`path` exists as a writable directory, or can be created (its nearest existing ancestor
    is a writable directory)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:  # by trying, not by os.access: root passes access checks on read-only mounts (/proc)
        if not existing.is_dir():
            raise NotADirectoryError
        fd, probe = tempfile.mkstemp(prefix=".lmcache-mp-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError:
        raise ValueError(f"{what} ({path}) is not writable by this user: fix its permissions or "
                         "choose another path") from None


def check_tier_directory(url: str) -> None:
    """A disk tier's directory must be writable; other tiers are checked when they connect."""
    parts = urlsplit(url)
    if parts.scheme == "disk" and parts.path.startswith("/"):
        check_writable_directory(Path(parts.path), f"the disk tier's directory of {url}")


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be positive"


def _chunk_size(value: int) -> str | None:
    if value > 0 and value % 16 == 0:
        return None
    return "must be a positive multiple of 16 (vLLM's block sizes are)"


def _pool_size(value: float) -> str | None:
    if value <= 0:
        return "must be positive"
    available = available_memory_bytes()
    if available is not None and value * 2**30 > available:
        return (f"the machine has only {available / 2**30:.1f} GiB available: lower it "
                "(the pool is allocated in full)")
    return None


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
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE, "tokens per stored chunk; a multiple of vLLM's block size", check=_chunk_size)
    l1_size_gb: float = setting(
        DEFAULT_L1_SIZE_GB, "CPU memory pool in GiB, prepared (faulted in; pinned with "
        "cudaHostRegister when CUDA is present) in 1 GiB pieces in the background: the daemon "
        "answers at once, STOREs find NO_SPACE beyond what is ready", check=_pool_size)
    l2: list[str] = setting(
        list, "a storage tier below the CPU pool; repeat for several, fastest first. "
        "disk:///ABS/PATH?size_gb=N: a local (NVMe) directory, kept across restarts, LRU-evicted "
        "beyond N GiB, locked against a second daemon. redis://[:PASSWORD@]HOST:PORT/DB (rediss:// "
        "for TLS), redis+cluster://HOST:PORT[,HOST:PORT...]: Valkey/Redis, shared by a fleet "
        "(?prefix=NAME namespaces keys, ?ttl_s=S expires them). lmcache://HOST:PORT: a v1 remote "
        "server. Network tiers take ?timeout_s=T (default 1) and turn failures into misses, retried "
        "in the background. Chunks are written behind STOREs and read back (verified) by LOOKUPs",
        metavar="URL")
    l2_queue_gb: float | None = setting(
        None, "write-behind queue per lower tier: chunks waiting to be written stay pinned in the "
        "CPU pool up to this size; past it, new chunks are not written to that tier (counted as "
        "skipped)", check=_positive, default_text="a quarter of l1_size_gb")
    lease_ttl_s: float = setting(
        DEFAULT_LEASE_TTL_S, "seconds a LOOKUP keeps its hits leased for the RETRIEVE that follows, "
        "if the client never retrieves or ends the session", check=_positive)
    max_workers: int = setting(
        DEFAULT_MAX_WORKERS, "threads that run STOREs and registrations, and as many again for "
        "RETRIEVEs (a load never queues behind a store); a RETRIEVE of several chunks is split "
        "over the idle ones", check=_positive)
    max_queued_requests: int = setting(
        DEFAULT_MAX_QUEUED_REQUESTS, "requests waiting for a worker thread before new ones are "
        "refused with OVERLOADED", check=_positive)
    queue_deadline_s: float = setting(
        DEFAULT_QUEUE_DEADLINE_S, "a queued request not started within this many seconds is "
        "refused with OVERLOADED instead of run late; keep it below the clients' timeout",
        check=_positive)
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
        if self.metrics_port:
            check_free(f"tcp://{self.metrics_host}:{self.metrics_port}")
        for url in self.l2:
            check_tier_directory(url)

    @property
    def attach_socket(self) -> Path:
        """The Unix socket on which CPU workers hand over shared-memory descriptors:
        beside the first ipc:// endpoint, else in the runtime directory."""
        for url in self.listen:
            path = ipc_path(url)
            if path is not None:
                return path.with_name(path.name + ".attach")
        return runtime_dir() / f"attach-{os.getpid()}.sock"
