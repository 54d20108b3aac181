"""Where a daemon's pool file lives (warm restart: `storage/pool_file.py`), and how one is
discarded. Torch-free, for the settings, the CLI (`lmcache-mp clear --pool-file`) and the launcher."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from pathlib import Path

from lmcache_mp.sockets import runtime_dir


class PoolFileError(Exception):
    """The pool file cannot be used at all (another daemon holds it, its directory is unsafe)."""


def default_pool_file(listen: list[str], runtime: Path | None = None) -> Path:
    """/dev/shm/lmcache-mp-$UID/pool-<digest of the runtime directory and first endpoint>: a daemon
    started again as before finds its pool; two daemons never share one."""
    name = f"{os.path.abspath(runtime or runtime_dir())}\0{listen[0] if listen else ''}"
    return Path(f"/dev/shm/lmcache-mp-{os.getuid()}/pool-{hashlib.sha256(name.encode()).hexdigest()[:12]}")


def lock_pool_file(fd: int, path: Path) -> None:
    """Hold the pool file for this process (released when `fd` closes); PoolFileError if a daemon
    holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PoolFileError(f"pool file {path} is in use by another daemon: give this one its own "
                            "--pool-file") from None


def discard_pool_file(path: Path) -> bool:
    """Remove a pool file no daemon uses, and the memory it holds; False if there was none.
    Raises PoolFileError if a daemon holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        os.unlink(path)  # a symbolic link in its place: the link goes, never its target
        return True
    try:
        lock_pool_file(fd, path)
        os.unlink(path)
    finally:
        os.close(fd)
    return True
