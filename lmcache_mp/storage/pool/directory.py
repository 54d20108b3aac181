"""The pool files of a directory: which daemon holds each, what each holds, and giving back the
memory of stopped daemons' files (`lmcache-mp pools`, and every daemon's start). Torch-free.

A pool file holds its memory (shared memory, on a tmpfs) until it is removed: a daemon that stops
leaves it for the next one started the same way, which adopts it (warm restart). One never started
that way again (moved to another endpoint, its container gone, a test run, a benchmark) leaves its
file until a reboot. So every daemon's start removes the files of its pool file directory that no
process holds and that no daemon used for `pool_file_ttl_s` (`remove_stale`), and a start refused
for memory names the stopped daemons' files it kept (`stopped_note`).

When a daemon last used a file is the file's modification time: a daemon sets it when it opens
the file, every minute while it runs, and when it closes it (`PoolFile.mark_used`); a daemon that
was killed set it at most a minute before it died. Only pool files are considered: regular files
of this user that begin as pool files do, in a directory of this user's alone.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from lmcache_mp.storage.pool.location import (
    PoolFileError,
    default_pool_directory,
    discard_pool_file,
    holder,
    is_held,
    is_pool_file,
)

logger = logging.getLogger(__name__)

_NAMED = 5  # files named in a one-line message; the rest are counted


@dataclass(frozen=True)
class PoolFileInfo:
    path: Path
    held_bytes: int  # the memory it holds: its allocated blocks (the file is sparse)
    unused_s: float  # since a daemon last used it
    holder: str  # the process that holds it ("pid N (command)"); "" if none: a stopped daemon's

    def describe(self) -> str:
        """`path (0.05 GiB, unused for 3 min)`"""
        return f"{self.path} ({self.held_bytes / 2**30:.2f} GiB, unused for {age(self.unused_s)})"


def age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def pool_files(directory: Path) -> list[PoolFileInfo]:
    """The pool files in `directory`, by name; [] if there is no such directory, or if it is not
    this user's alone (a file there could be anyone's)."""
    try:
        st = os.lstat(directory)
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        return []
    found = (_inspect(directory / name) for name in names)
    return [info for info in found if info is not None]


def _inspect(path: Path) -> PoolFileInfo | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not is_pool_file(fd):
            return None
        st = os.fstat(fd)
        return PoolFileInfo(path, st.st_blocks * 512, max(0.0, time.time() - st.st_mtime),
                            holder(st) if is_held(fd) else "")
    finally:
        os.close(fd)


def stopped_pool_files(directory: Path, keep: Path | None = None) -> list[PoolFileInfo]:
    """The pool files in `directory` that no process holds, but `keep`."""
    return [info for info in pool_files(directory) if not info.holder and info.path != keep]


def remove_stopped(directory: Path, unused_for_s: float = 0.0,
                   keep: Path | None = None) -> list[PoolFileInfo]:
    """Remove the pool files in `directory` that no process holds and no daemon used for
    `unused_for_s`, but `keep`; the ones removed."""
    removed = []
    for info in stopped_pool_files(directory, keep):
        if info.unused_s < unused_for_s:
            continue
        try:
            if discard_pool_file(info.path, wait_s=0, unused_for_s=unused_for_s):
                removed.append(info)
        except (PoolFileError, OSError) as err:  # taken by a daemon meanwhile, or gone
            logger.debug("pool file %s not removed: %s", info.path, err)
    return removed


def remove_stale(pool_path: Path, ttl_s: float) -> None:
    """At a daemon's start: remove the pool files of stopped daemons in the directory of its own
    (`pool_path`, kept: the daemon adopts it) unused for `ttl_s`, each logged."""
    for info in remove_stopped(pool_path.parent, ttl_s, keep=pool_path):
        logger.info("pool file %s of a stopped daemon removed: unused for %s (pool_file_ttl_s %g), it held "
                    "%.2f GiB", info.path, age(info.unused_s), ttl_s, info.held_bytes / 2**30)


def remove_command(directory: Path) -> str:
    """The command that removes the stopped daemons' pool files of `directory`."""
    where = "" if directory == default_pool_directory() else f" --dir {directory}"
    return f"lmcache-mp pools{where} --remove-stopped"


def stopped_note(files: list[PoolFileInfo], directory: Path) -> str:
    """What the pool files of stopped daemons in `directory` hold, and how to free it, for a
    message that memory is short ("" if there are none)."""
    if not files:
        return ""
    named = ", ".join(info.describe() for info in files[:_NAMED])
    more = f" and {len(files) - _NAMED} more" if len(files) > _NAMED else ""
    held = sum(info.held_bytes for info in files) / 2**30
    return (f"; stopped daemons' pool files hold {held:.2f} GiB more: {named}{more}; "
            f"`{remove_command(directory)}` removes them")
