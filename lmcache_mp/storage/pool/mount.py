"""What the file system under a pool file gives it (`pool/file.py`): which mount holds the file, and so
whether the file can outlive the machine, and which pages its memory gets.

A file on a memory file system (tmpfs, as /dev/shm) dies with the machine, like the KV it holds:
what a restart finds there is what the last daemon's stores left in memory, in the order the pool
made them (`pool/file.py`'s crash consistency). A file on a disk file system outlives a machine crash
with whatever pages the kernel had written back by then, in writeback order, not the pool's: a
record may have reached the disk and its chunk's payload not. There, only a chunk whose checksum was
written can be trusted, once checked (`pool/restart.py`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# File systems whose files are gone with the machine (never written to a device).
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


@dataclass(frozen=True)
class Mount:
    point: str  # "" when unknown
    fstype: str
    options: str

    @property
    def in_memory(self) -> bool:
        """Whether files here die with the machine (unknown: no, which trusts less)."""
        return self.fstype in _MEMORY_FILE_SYSTEMS


def mount_of(fd: int) -> Mount:
    """The mount that holds the file open on `fd` (the kernel's own answer: its mount id in
    /proc/self/fdinfo, looked up in /proc/self/mountinfo); an unknown one if that cannot be read."""
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return Mount("", "", "")
    mount_id = next((line.split()[1] for line in info if line.startswith("mnt_id:")), None)
    for line in mounts:
        mount, separator, source = line.partition(" - ")
        fields = mount.split()
        if separator and len(fields) > 4 and fields[0] == mount_id:
            fstype, _, options = [*source.split(), "", ""][:3]
            return Mount(fields[4], fstype, options)
    return Mount("", "", "")


def log_pages(path: Path, mount: Mount) -> None:
    """Say which pages the pool file gets (its file system's type and `huge=` option), and what a
    file that can outlive the machine costs."""
    huge = next((o.partition("=")[2] for o in mount.options.split(",") if o.startswith("huge=")), "never")
    if mount.fstype == "tmpfs" and huge == "never":
        logger.info("pool file %s: on a tmpfs (%s) without huge pages: 4 KiB pages, copies measured 3-4%% "
                    "slower than with huge pages (mount -o remount,huge=advise %s)", path, mount.point,
                    mount.point)
    elif mount.fstype == "tmpfs":
        logger.info("pool file %s: on a tmpfs (%s) with huge=%s", path, mount.point, huge)
    elif not mount.in_memory:
        logger.warning("pool file %s: on a %s (%s), not a tmpfs: the kernel writes the pool's pages back "
                       "to that device, and a restart adopts only the chunks whose checksum was written "
                       "(a machine crash may leave any other one's bytes unwritten); give --pool-file a "
                       "path on a tmpfs (/dev/shm)", path, mount.fstype or "file system of unknown type",
                       mount.point or "?")


def free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_no_replace(source: Path, target: Path) -> None:
    """Rename `source` to `target`, FileExistsError if `target` exists (never replacing it).

    A rename, not a link: the file keeps one name, so the daemon's mapping of it is listed under
    `target` in /proc/PID/maps (a link would leave it listed under the removed `source`, "(deleted)",
    like a worker's memfd). Where the kernel has no RENAME_NOREPLACE, `target` is linked instead
    and `source` is left for the caller to remove."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(code, os.strerror(code), str(target))
    os.link(source, target)
