"""The pool's memory as a file that outlives the daemon: what a restart adopts (warm restart).

Why a file in /dev/shm (tmpfs) by default: it survives the daemon (a crash, an upgrade,
`systemctl restart`) and dies with the machine, like the KV it holds; it works wherever the daemon
runs, under systemd or not (a memfd in systemd's file-descriptor store survives only what systemd
restarts, and nothing started by hand). Its cost is the pages: this VM backs anonymous memory
with transparent huge pages (`madvise`), but a tmpfs with 4 KiB pages unless it is mounted
`huge=advise` (the pool asks for them: MADV_HUGEPAGE) or `huge=within_size`/`always`; the sysfs
`shmem_enabled` knob governs only the kernel's internal mount (memfds), not /dev/shm. Measured
(docs/benchmarks.md section 13): 4 KiB pages cost copies 3-4%, huge pages nothing.

The file is ours alone: created 0600 (O_EXCL, O_NOFOLLOW) in a 0700 directory, locked (flock)
while a daemon uses it, and adopted only if it is a regular file of this user, mode 0600, of the
exact size and format the configuration asks for (`open_pool_file` says why not, in one line, and
starts it afresh). A file another process holds is never removed nor replaced (`pool/location.py`):
the second daemon does not start. A new file is made whole under a name of its own, then linked
to the path: the path only ever names a file its daemon holds.

Layout: page 0 is the superblock; then the slab table, one u64 per base slab (the size class of
the slab starting there); then the record table; then, page-aligned, the pool's memory, carved
into slabs as `pool/slabs.py` says, exactly as an anonymous pool's (the records take none of it). The
record table has a RECORD_BYTES slot for every `align` bytes of the pool's memory: the record of
the object whose data starts at offset `o` is number `o // align`. The table is sparse: a page of
it takes memory once a record is written there (allocated first, so that a full tmpfs fails the
allocation, and the chunk is just not kept, rather than killing the daemon with SIGBUS); objects
of 32 KiB and more take one page of records each, smaller ones share. A record:

    u64 state   EMPTY, COMMITTED or SEALED; written last and alone (one aligned 8-byte store)
    u64 seq     the pool's commit counter when it was committed (recency, on adoption)
    u16 parent_len, u16 head_len
    parent      the chunk hash of the chunk before it in its chain (empty: none known)
    head        `chunk_format`'s header of the object (key, format, length), then its checksum,
                which is 0 until the chunk is SEALED (computed off the request path)

Crash consistency rests on one order, kept by the pool: a slot's record is EMPTY before the slot
is handed out, its payload and record are written before its state becomes COMMITTED (before the
STORE is answered), and the state goes back to EMPTY before the slot can be reused. A process
killed at any instant leaves its stores in the page cache, so what a restart finds COMMITTED or
SEALED is a chunk whose STORE completed. A machine that dies takes a tmpfs with it; a file on a
disk file system survives it with its pages written back in any order, so there a COMMITTED record
vouches for nothing and only SEALED chunks are adopted, each once its checksum passed
(`pool/mount.py`). The states share their upper 32 bits: a state write torn into halves reads as
EMPTY-or-invalid (never adopted) or as one of the two whole states.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage import chunk_format
from lmcache_mp.storage.pool.location import POOL_MAGIC, PoolFileError, lock_pool_file, still_names
from lmcache_mp.storage.pool.mount import free_bytes, log_pages, mount_of, rename_no_replace
from lmcache_mp.storage.pool.seal_process import ChecksumProcess, start_checksum_process

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MAGIC = POOL_MAGIC + b"\x00\x01"
VERSION = 1
# magic, version, page size, file bytes, data offset, capacity, align, record table offset and
# record size, slab table entries
_SUPER = struct.Struct("<8sIIQQQQQQQ")
_SLAB_BYTES_AT = 128  # u64, 0 until the pool fixes its slab size (at its first reserve)

EMPTY = 0
_STATE_HIGH = 0x4C4D5053 << 32  # "SPML": shared by both live states (see the module docstring)
COMMITTED = _STATE_HIGH | 0x544D4F43
SEALED = _STATE_HIGH | 0x4C414553
_RECORD = struct.Struct("<QQHH")  # state, seq, parent_len, head_len
_SLICE_BYTES = 8 << 20  # checksummed at once, between calls of the pacer
RECORD_BYTES = 512  # room for a record: a model name of ~250 characters fits


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True)
class _Layout:
    entries: int  # of the slab table: every base slab holds an object of at least `align` bytes
    records_at: int
    data_offset: int
    file_bytes: int


def _layout(capacity: int, align: int) -> _Layout:
    entries = capacity // align + 1
    records_at = PAGE + _pages(entries * 8)
    data_offset = records_at + _pages(entries * RECORD_BYTES)
    return _Layout(entries, records_at, data_offset, data_offset + capacity)


def _superblock(capacity: int, align: int) -> tuple:
    layout = _layout(capacity, align)
    return (MAGIC, VERSION, PAGE, layout.file_bytes, layout.data_offset, capacity, align, layout.records_at,
            RECORD_BYTES, layout.entries)


def _superblock_mismatch(fd: int, capacity: int, align: int) -> str:
    """Why the superblock of the file open on `fd` is not one this configuration writes ("" if it is)."""
    found = _SUPER.unpack(os.pread(fd, _SUPER.size, 0))
    names = ("magic", "format version", "page size", "size", "data offset", "capacity",
             "alignment", "record table", "record size", "slab table")
    for name, have, want in zip(names, found, _superblock(capacity, align), strict=True):
        if have != want:
            return f"its {name} is {have!r}, this daemon's is {want!r}"
    return ""


@dataclass(frozen=True)
class Record:
    """A live record found in a slot on adoption."""

    state: int
    seq: int
    key: ChunkKey
    parent: bytes  # the parent's chunk hash, b"" if none
    head: bytes  # the chunk header, checksum included


class PoolFile:
    """An open, locked pool file and its mapping: `data` is the pool's memory."""

    def __init__(self, path: Path, fd: int, capacity: int, align: int, adopted: bool):
        self.path = path
        self.fd = fd
        self.capacity = capacity
        self.align = align
        layout = _layout(capacity, align)
        self.entries, self.records_at = layout.entries, layout.records_at
        self.data_offset, self.file_bytes = layout.data_offset, layout.file_bytes
        self.adopted = adopted  # the file held a pool that this daemon now serves
        self.mount = mount_of(fd)
        # False: the file may outlive the machine, and its chunks' bytes be older than their records
        # (`pool/mount.py`): only sealed chunks are adopted from it.
        self.in_memory = self.mount.in_memory
        self._record_pages: set[int] = set()  # pages of the record table allocated by this process
        # Mapped through a second open file description of the same inode: the mapping keeps a
        # duplicate of the descriptor it was made from, and the lock (on `fd`) must end at `close`.
        map_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(map_fd, self.file_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(map_fd)
        self._mapping = mapping
        self.data = torch.frombuffer(mapping, dtype=torch.uint8, offset=self.data_offset,
                                     count=capacity)
        # Every aligned u64 of the file, for stores that must be one instruction (states).
        self._words = np.frombuffer(mapping, dtype=np.uint64, count=self.file_bytes // 8)
        self._view = memoryview(mapping)

    # ---- superblock and slab table ---------------------------------------------------------------

    def write_superblock(self) -> None:
        _SUPER.pack_into(self._view, 0, *_superblock(self.capacity, self.align))

    @property
    def slab_bytes(self) -> int:
        return int(self._words[_SLAB_BYTES_AT // 8])

    @slab_bytes.setter
    def slab_bytes(self, value: int) -> None:
        self._words[_SLAB_BYTES_AT // 8] = value

    def slab_entry(self, first: int) -> tuple[int, int]:
        """(object bytes, span) of the slab starting at base slab `first`; (0, 0) for none."""
        word = int(self._words[PAGE // 8 + first])
        return word >> 20, word & 0xFFFFF

    def set_slab_entry(self, first: int, nbytes: int, span: int) -> None:
        if span >= 1 << 20 or nbytes >= 1 << 44:
            raise ValueError(f"slab of span {span} for {nbytes}-byte objects does not fit the slab table")
        self._words[PAGE // 8 + first] = nbytes << 20 | span

    def clear_slab_entry(self, first: int) -> None:
        self._words[PAGE // 8 + first] = 0

    # ---- records (each named by its object's data offset in the pool) ---------------------------

    def _record_at(self, offset: int) -> int:
        return self.records_at + offset // self.align * RECORD_BYTES

    def set_state(self, offset: int, state: int) -> None:
        """One aligned 8-byte store, on a record written before (its page is allocated)."""
        self._words[self._record_at(offset) // 8] = state

    def clear_state(self, offset: int) -> None:
        """EMPTY, without allocating a record page that was never written (it reads as zeros)."""
        at = self._record_at(offset) // 8
        if self._words[at]:
            self._words[at] = EMPTY

    def write_record(self, offset: int, seq: int, parent: bytes, head: bytes) -> bool:
        """Write a record's body (state untouched): `head` is `chunk_format.encode_head`'s, its
        checksum (0 until sealed) is appended. False if it does not fit a record, or its page
        cannot be allocated (a full file system): the object is then not kept."""
        head += bytes(chunk_format.CHECKSUM_SIZE)
        if _RECORD.size + len(parent) + len(head) > RECORD_BYTES:
            return False
        at = self._record_at(offset)
        page = at // PAGE
        if page not in self._record_pages:
            try:
                os.posix_fallocate(self.fd, page * PAGE, PAGE)
            except OSError:
                return False
            self._record_pages.add(page)
        view = self._view
        _RECORD.pack_into(view, at, int(self._words[at // 8]), seq, len(parent), len(head))
        body = at + _RECORD.size
        view[body:body + len(parent)] = parent
        view[body + len(parent):body + len(parent) + len(head)] = head
        return True

    def read_record(self, offset: int, payload_len: int) -> Record | None:
        """The live record of the object at `offset`, of `payload_len` bytes, or None (empty, or
        anything that does not parse as one: never adopted). Its page counts as allocated."""
        at = self._record_at(offset)
        state, seq, parent_len, head_len = _RECORD.unpack_from(self._view, at)
        if state not in (COMMITTED, SEALED) or _RECORD.size + parent_len + head_len > RECORD_BYTES:
            return None
        self._record_pages.add(at // PAGE)
        body = at + _RECORD.size
        parent = bytes(self._view[body:body + parent_len])
        head = bytes(self._view[body + parent_len:body + parent_len + head_len])
        try:
            key, length = chunk_format.read_key(head)
        except chunk_format.CorruptChunk:
            return None
        if length != payload_len:
            return None
        return Record(state, seq, key, parent, head)

    def seal(self, offset: int, payload: torch.Tensor, pace: Callable[[], None] | None,
             hasher: ChecksumProcess | None = None) -> None:
        """Checksum a COMMITTED record's payload into its head, then mark it SEALED. `pace` is
        called between slices (before the whole payload, with `hasher`): the request path's copies
        go first. `hasher`: computed by that child process (`pool/seal_process.py`), else here."""
        at = self._record_at(offset)
        _, _, parent_len, head_len = _RECORD.unpack_from(self._view, at)
        head_at = at + _RECORD.size + parent_len
        head = self._view[head_at:head_at + head_len - chunk_format.CHECKSUM_SIZE]
        if hasher is None:
            digest = chunk_format.checksum(head, payload, _SLICE_BYTES, pace)
        else:
            if pace is not None:
                pace()
            digest = hasher.digest(bytes(head), self.data_offset + offset, payload.nbytes)
        struct.pack_into("<Q", self._view, head_at + head_len - chunk_format.CHECKSUM_SIZE, digest)
        self.set_state(offset, SEALED)

    def checksum_process(self) -> ChecksumProcess | None:
        """A child that checksums this file's bytes at the lowest priority (`pool/seal_process.py`); None
        if it cannot start."""
        return start_checksum_process(self.fd, self.file_bytes)

    def mark_used(self) -> None:
        """Set the file's modification time to now. It says when a daemon last used the file: the
        start of another daemon removes a stopped daemon's file only once that is long enough ago
        (`pool/directory.py`), so the daemon using it marks it now and then (`pool/integrity.py`)."""
        with contextlib.suppress(OSError):  # closed meanwhile
            os.utime(self.fd)

    def close(self) -> None:
        """Release the lock (the mapping goes with the last view of it)."""
        if self.fd >= 0:
            self.mark_used()
            os.close(self.fd)
            self.fd = -1


def verify(record: Record, payload: torch.Tensor, pace: Callable[[], None] | None = None) -> bool:
    """Whether a SEALED record's payload is exactly what was sealed (`pace`: see `seal`)."""
    head = record.head[:-chunk_format.CHECKSUM_SIZE]
    (stored,) = struct.unpack_from("<Q", record.head, len(head))
    return chunk_format.checksum(head, payload, _SLICE_BYTES, pace) == stored


# ---- opening --------------------------------------------------------------------------------------


class _Moved(Exception):
    """The file at the path changed while this daemon took it (another process removed or replaced
    it): look again."""


_OPEN_ATTEMPTS = 5


def open_pool_file(path: Path, capacity: int, align: int, *, fresh: bool) -> PoolFile | None:
    """The pool file at `path`: the existing one when it can be adopted (unless `fresh`), else a
    new one; None (after one warning) when no new one can be made there (no room, no such file
    system, a read-only one): the pool then lives in anonymous memory, without warm restart.
    A directory that others could write in is not used either (same warning, anonymous memory):
    they could swap the file. Raises PoolFileError if another process holds the file: it is then
    never removed nor replaced, `fresh` or not (the module docstring of `pool/location.py`)."""
    try:
        _private_directory(path.parent)
    except (OSError, _UnsafeDirectory) as err:
        logger.warning("pool file %s: %s; the pool lives in anonymous memory and is lost at a restart",
                       path, err)
        return None
    for _ in range(_OPEN_ATTEMPTS):
        try:
            pool_file = _adopt_or_replace(path, capacity, align, fresh)
        except _Moved:
            continue
        if pool_file is not None:
            pool_file.mark_used()
            log_pages(path, pool_file.mount)
        return pool_file
    raise PoolFileError(f"pool file {path} was replaced {_OPEN_ATTEMPTS} times while this daemon took it: "
                        "another process keeps replacing it")


def _adopt_or_replace(path: Path, capacity: int, align: int, fresh: bool) -> PoolFile | None:
    layout = _layout(capacity, align)
    fd, reason = _hold(path)
    if fd is None:
        if reason:  # nothing a daemon could hold: a link, another user's file
            logger.warning("pool file %s not adopted: %s; starting with an empty pool", path, reason)
            if not _unlink(path):
                return None
        return _create(path, capacity, align, layout)
    adopted = False
    try:
        if fresh:
            logger.info("pool file %s: discarded (--fresh-pool)", path)
        else:
            reason = _unadoptable(fd, layout.file_bytes) or _superblock_mismatch(fd, capacity, align)
            if not reason:
                pool_file = PoolFile(path, fd, capacity, align, adopted=True)
                adopted = True
                logger.info("pool file %s: adopting the pool it holds", path)
                return pool_file
            logger.warning("pool file %s not adopted: %s; starting with an empty pool", path, reason)
        if not _unlink(path):  # this daemon holds it and the path still names it: nobody else's
            return None
    finally:
        if not adopted:
            os.close(fd)
    return _create(path, capacity, align, layout)


def _hold(path: Path) -> tuple[int | None, str]:
    """The file at `path`, open and locked by this daemon; else (None, why it can't be opened), or
    (None, "") if there is none. PoolFileError if another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None, "it is a symbolic link"
        return None, f"it cannot be opened ({err.strerror})"
    try:
        lock_pool_file(fd, path)
        if not still_names(fd, path):
            raise _Moved
    except PoolFileError as err:
        os.close(fd)
        raise PoolFileError(f"{err}: give this daemon a --pool-file of its own") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, ""


def _unadoptable(fd: int, file_bytes: int) -> str:
    """Why the file open on `fd` is not one to adopt ("" if it may be, its superblock permitting)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
    if st.st_size != file_bytes:
        return f"it is {st.st_size} bytes, a pool of this size takes {file_bytes}"
    return ""


def _unlink(path: Path) -> bool:
    """Remove the link at `path` (never a link's target); False, after a warning, if it can't be."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        logger.warning("pool file %s: cannot be replaced (%s); the pool lives in anonymous memory and is "
                       "lost at a restart", path, err.strerror)
        return False
    return True


def _create(path: Path, capacity: int, align: int, layout: _Layout) -> PoolFile | None:
    """A new pool file at `path`, made whole (locked, sized, its superblock written) under a name of
    its own and only then renamed to `path`: what the path names is always a file its daemon holds.
    _Moved if another daemon's file got there first."""
    # The pool's memory and the slab table, and some room for records (sparse: see the module
    # docstring); what is not there when a record is written only loses that record.
    needed = capacity + layout.records_at + capacity // 64
    free = free_bytes(path.parent)
    if free is not None and free < needed:
        logger.warning("pool file %s: its file system has %.2f GiB free, the pool needs %.2f GiB; the pool "
                       "lives in anonymous memory and is lost at a restart (give --pool-file a larger "
                       "tmpfs, or a container a larger /dev/shm)", path, free / 2**30, needed / 2**30)
        return None
    staging = path.with_name(f".{path.name}.new-{os.getpid()}")  # a dead process's of this pid: gone
    try:
        _unlink_missing_ok(staging)
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        logger.warning("pool file %s: cannot be created (%s); the pool lives in anonymous memory and is "
                       "lost at a restart", path, err)
        return None
    try:
        lock_pool_file(fd, staging, wait_s=0)
        os.ftruncate(fd, layout.file_bytes)
        os.posix_fallocate(fd, 0, layout.records_at)  # the superblock and the slab table
        pool_file = PoolFile(path, fd, capacity, align, adopted=False)
        pool_file.write_superblock()
        rename_no_replace(staging, path)
    except FileExistsError:
        os.close(fd)
        raise _Moved from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        _unlink_missing_ok(staging)
    logger.info("pool file %s: created (%.2f GiB)", path, capacity / 2**30)
    return pool_file


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _UnsafeDirectory(Exception):
    pass


def _private_directory(directory: Path) -> None:
    """Make `directory` (0700), or take an existing one that is ours and nobody else may write in;
    OSError if it can't be made, _UnsafeDirectory if it is not safe."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(err.errno, f"cannot make its directory: {err.strerror}") from None
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise _UnsafeDirectory(f"its directory {directory} is not a directory (a symbolic link?)")
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise _UnsafeDirectory(f"its directory {directory} (uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):04o}) is not this user's alone to write in: "
                               "remove it or choose another --pool-file")
