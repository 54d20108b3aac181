"""The daemon's endpoints and socket files: where they live, who may use them, who serves them,
and the checks that keep them private and free.

Invariants:
- The daemon's Unix sockets live in a directory only its user may use (0700, sockets 0600), or
  also one group (0750, sockets 0660; `SocketAccess`). An existing directory is taken only if
  this user owns it and nobody else may write in it; a symbolic link is refused, and the
  directory is checked and narrowed through a descriptor opened without following one.
- One daemon per socket path: it holds a claim (`SocketClaim`, a lock the kernel drops when the
  process dies) for as long as it serves. A stale socket is removed; one that still accepts
  belongs to a live daemon and is never touched.
- No endpoint reaches beyond this machine, and no tcp:// one goes unauthenticated, unless
  the operator said so (CURVE keys, or an explicit opt-in).
- The checks (`check_*`, `SocketAccess.check_directory`) change nothing and raise ValueError
  with one line saying what to change, before anything starts; `make_directory`,
  `claim_socket_path` and `prepare_ipc_endpoints` act.
- The daemon's settings (`config.py`) import this module, never the other way round.
"""

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


def prepare_ipc_endpoints(listen: list[str], access: SocketAccess) -> list[SocketClaim]:
    """Create the private directories of the ipc:// endpoints, claim their paths and remove stale
    sockets there; raises SocketInUseError where another daemon serves (or claimed) one. Release
    the claims once the server has stopped."""
    claims: list[SocketClaim] = []
    try:
        for url in listen:
            path = ipc_path(url)
            if path is not None:
                access.make_directory(path.parent)
                claims.append(claim_socket_path(path, url))
    except BaseException:
        for claim in claims:
            claim.release()
        raise
    return claims


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
