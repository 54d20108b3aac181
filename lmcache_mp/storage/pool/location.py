"""Where a daemon's pool file lives (warm restart: `pool/file.py`), who holds one, and how
one is discarded. Torch-free, for the settings, the CLI (`lmcache-mp clear --pool-file`,
`lmcache-mp pools`) and the launcher.

A daemon holds its pool file with an exclusive flock for as long as it runs. Whoever removes or
replaces a pool file takes that lock first and then checks that the path still names the file it
locked: a file a daemon holds is never removed, and one a daemon is about to take is removed only
before it takes it (the daemon then finds its lock on a file that is gone, and starts over).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import time
from pathlib import Path

from lmcache_mp.sockets import runtime_dir

POOL_MAGIC = b"LMPOOL"  # how every pool file begins (its superblock: `pool/file.py`)
# A `lmcache-mp pools` listing or another daemon's start holds an unheld pool file for an instant
# (to see whether anyone holds it, or to remove it): a daemon taking it waits that long for it.
LOCK_WAIT_S = 1.0
_LOCK_RETRY_S = 0.02


class PoolFileError(Exception):
    """The pool file cannot be used at all (another daemon holds it, its directory is unsafe)."""


def default_pool_directory() -> Path:
    """/dev/shm/lmcache-mp-$UID: where daemons keep their pool files unless told otherwise."""
    return Path(f"/dev/shm/lmcache-mp-{os.getuid()}")


def default_pool_file(listen: list[str], runtime: Path | None = None, directory: Path | None = None) -> Path:
    """`directory` (the default one: `default_pool_directory`)/pool-<digest of the runtime directory
    and first endpoint>: a daemon started again as before finds its pool; two daemons never share one."""
    name = f"{os.path.abspath(runtime or runtime_dir())}\0{listen[0] if listen else ''}"
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return (directory or default_pool_directory()) / f"pool-{digest}"


def lock_pool_file(fd: int, path: Path, wait_s: float = LOCK_WAIT_S) -> None:
    """Hold the pool file for this process (released when `fd` closes); PoolFileError if a daemon
    holds it (anything holding it longer than `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise PoolFileError(f"pool file {path} is in use by another daemon, "
                                    f"{holder(os.fstat(fd))}") from None
        time.sleep(_LOCK_RETRY_S)


def is_held(fd: int) -> bool:
    """Whether a process holds the pool file open on `fd` (asked without keeping it from one)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def still_names(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open on `fd` (nobody removed or replaced it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def holder(st: os.stat_result) -> str:
    """Who holds a lock on the file of `st`: "pid N (its command line)", from /proc/locks; "a
    process this one cannot see" if none is listed (another pid namespace)."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4] != "0":
            return f"pid {fields[4]} ({_command_line(int(fields[4]))})"
    return "a process this one cannot see"


def _command_line(pid: int, limit: int = 120) -> str:
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "gone"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def is_pool_file(fd: int) -> bool:
    """Whether the file open on `fd` is a regular file of this user that begins as pool files do."""
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()):
        return False
    return os.pread(fd, len(POOL_MAGIC), 0) == POOL_MAGIC


def discard_pool_file(path: Path, wait_s: float = LOCK_WAIT_S, unused_for_s: float = 0.0) -> bool:
    """Remove a pool file no daemon uses, and the memory it holds; False if there was none, or if
    a daemon used it within the last `unused_for_s` (its modification time: `PoolFile.mark_used`).
    Raises PoolFileError if a daemon holds it, or if it is not a pool file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        os.unlink(path)  # a symbolic link in its place: the link goes, never its target
        return True
    try:
        if not is_pool_file(fd):
            raise PoolFileError(f"{path} is not a pool file: not removed")
        lock_pool_file(fd, path, wait_s)
        if not still_names(fd, path):
            return False  # removed, or replaced by a daemon's new file, meanwhile
        if time.time() - os.fstat(fd).st_mtime < unused_for_s:
            return False  # a daemon used it since it was judged stale
        os.unlink(path)
    finally:
        os.close(fd)
    return True
