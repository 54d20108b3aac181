"""A lower tier in a local directory (an NVMe drive): one file per chunk, kept across restarts.

Files. Each chunk is one file holding the object of `chunk_format.py`: its checksummed header,
zero padding to a 4 KiB block, then the chunk's bytes. It is named by a digest of the key's
ident and sharded by its first two hex digits:
`ROOT/ab/ab12...(40 hex).kv`. A digest collision is harmless: reads verify the header against the
key, so a file can only ever be served for the key it was written for. Other entries of the
directory: `lock` (the owning daemon's pid, flock'ed while it runs: one daemon per directory) and
`tmp/` (files being written; whatever is there at start is a leftover and is removed).

Symlinks. No path under the directory is ever followed: whoever can plant one there must not get
the tier to write, truncate, list or delete anything elsewhere. The tier opens the directory once
and works relative to that descriptor and to one of `tmp/`; every shard and file is opened with
O_NOFOLLOW (shards with O_DIRECTORY too). A symlink, or anything of the wrong type, at `lock`,
`tmp` or a shard refuses the start with an error naming it (so does a `lock` with other hard
links: it is truncated and written). One at an object's name is foreign:
never indexed, read, written through or evicted (a get of it is a miss that leaves it there; a
put renames its file over the link itself, which rename never follows). The directory's own path
is the operator's to choose, symlinks included.

Writes go to a temp file in `tmp/` (same filesystem) and are renamed into place, so a name never
shows a half-written file to a running daemon. The whole blocks of a page-aligned payload (the
pool's objects are) are written with O_DIRECT, straight from pool memory: a buffered write costs
the writer thread kernel time that the request path needs; a filesystem that refuses O_DIRECT
(tmpfs, some network filesystems) gets buffered writes. Reads go through the page cache. There
is no fsync: after a power loss a file may be torn or empty, and the checksum catches it on its
first read, which then deletes it. A write that fails (ENOSPC, EIO, EDQUOT, ...) removes its
temp file, is counted, logged at a limited rate and otherwise ignored: the disk is a cache, and
the daemon serves on without it.

Index. In memory: file name -> (size, sequence number), in LRU order (least recently read or
written first), and the sum of the sizes. At start it is rebuilt from the directory listing and
stat results alone (no file is opened), ordered by mtime; a hit sets the file's mtime, so the LRU
order survives restarts. Capacity counts whole files (headers included); a put evicts LRU files
until the new one fits, and the start evicts down to the capacity. A file larger than the whole
capacity is no object of this tier (a put refuses one) and is removed at start, uncounted: one such
file, say a sparse one, would otherwise evict every real object and then itself.

Concurrency. One lock guards the index, the counters and `_busy` (names with a write or an
unlink in flight); all file I/O happens outside it. A put skips a name that is indexed or busy,
and a file is unlinked only after its entry has left the index, so a name is never written and
unlinked at once. A reader that finds its file gone, or damaged, drops the entry only if it is
still the one it looked up (same sequence number), so it never drops a newer object's entry. A
read that races an eviction either misses or reads the unlinked file through its open
descriptor, whose bytes are still verified. The worst a race can leave is an entry whose file
is gone, which the next get of that key turns into a miss.

Closing. `close` marks the tier closed: from then on it touches nothing (the directory may be
another daemon's). Its descriptors, the lock's included, are closed by the last operation still
in flight, so that none ever uses a descriptor number closed under it and reused for another file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import logging
import math
import mmap
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import torch

from lmcache_mp.storage import chunk_format
from lmcache_mp.storage.base import ChunkKey, StorageTier, TierStats
from lmcache_mp.storage.chunk_format import CorruptChunk

logger = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"[0-9a-f]{40}\.kv")
_SUFFIX = ".kv"
_LOCK_FILE = "lock"
_TMP_DIR = "tmp"
# A directory of the tier (a shard, tmp/): never reached through a symlink.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# An object opened for reading: never through a symlink, and O_NONBLOCK so that a FIFO put in its
# place cannot hang the reader (on a regular file it changes nothing).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# The first read of a get: the prefix and, in one syscall, any realistic header (~200 bytes).
_FIRST_READ = 4096
_WARN_INTERVAL_S = 10.0
_GiB = 1 << 30
# Batched reads run on this many threads, so that one chunk's read (preadv, GIL released)
# overlaps another's checksum: promotion then keeps near the speed of a plain single-threaded
# read from the page cache, and beats it from a cold disk (measured: one thread ~60-75%).
_READ_THREADS = 2
# Files are laid out in blocks of this size (the header padded to it), so that the payload of
# an aligned pool object can be written with O_DIRECT: no page-cache copy, which costs the
# writer a core's worth of kernel time per ~0.6 GB/s of buffered writes on a small VM.
_BLOCK = 4096
# A read goes in slices this big, each checksummed right after it lands, while it is still
# in the CPU's cache (one pass over memory instead of two).
_READ_SLICE = 1 << 20
# A write is checksummed and written in slices this big (a multiple of _BLOCK), calling the
# tier's pacer before each: background work that gives way to the request path's copies.
_WRITE_SLICE = 4 << 20
_URL_HELP = "disk:///ABSOLUTE/PATH?size_gb=N"


def object_name(key: ChunkKey) -> str:
    """The file name stem of `key`'s object: 40 hex digits."""
    return hashlib.blake2b(key.chunk_hash + key.fingerprint, digest_size=20).hexdigest()


class _ThrottledWarning:
    """Logs the first warning at once, then at most one per interval, saying how many it held back
    (a full disk fails every write, and one line per chunk would drown the log)."""

    def __init__(self, interval_s: float = _WARN_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._held_back = 0

    def warning(self, msg: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._held_back += 1
                return
            self._next = now + self._interval_s
            held_back, self._held_back = self._held_back, 0
        if held_back:
            msg += " (%d similar warnings held back)"
            args = (*args, held_back)
        logger.warning(msg, *args)


def _payload_offset(header_size: int) -> int:
    """Where the payload starts in a file: the header padded to whole blocks (direct I/O)."""
    return -(-header_size // _BLOCK) * _BLOCK


def _padded(header: bytes) -> memoryview:
    """The header and its zero padding, in page-aligned memory (an anonymous mapping), as
    direct I/O wants its buffers."""
    buffer = mmap.mmap(-1, _payload_offset(len(header)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer[:len(header)] = header
    return memoryview(buffer)


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """Write all of `bufs` in order, resuming after short writes."""
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        written = os.writev(fd, bufs)
        while bufs and written >= bufs[0].nbytes:
            written -= bufs[0].nbytes
            bufs.pop(0)
        if written:
            bufs[0] = bufs[0][written:]


def _read_all(fd: int, dest: memoryview, offset: int) -> None:
    """Fill `dest` from `offset` on, resuming after short reads."""
    done = 0
    while done < dest.nbytes:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            raise CorruptChunk(f"payload truncated after {done} of {dest.nbytes} bytes")
        done += n


def _parse_size_gb(url: str, query: str) -> float:
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=True) if query else {}
    except ValueError:
        raise ValueError(f"disk tier URL {url!r} has a malformed query; expected {_URL_HELP}") from None
    unknown = sorted(set(params) - {"size_gb"})
    if unknown:
        raise ValueError(f"disk tier URL {url!r} has unknown parameters {unknown}; expected {_URL_HELP}")
    values = params.get("size_gb", [])
    if len(values) != 1:
        raise ValueError(f"disk tier URL {url!r} needs exactly one size_gb (GiB); expected {_URL_HELP}")
    try:
        size_gb = float(values[0])
    except ValueError:
        size_gb = math.nan
    if not (math.isfinite(size_gb) and size_gb > 0):
        raise ValueError(f"disk tier URL {url!r}: size_gb must be a positive number, got {values[0]!r}")
    return size_gb


class DiskTier(StorageTier):
    """Chunks as files in one directory; see the module docstring for the layout and invariants.

    `put` writes synchronously and ignores `blocking`: the storage manager calls it from its own
    writer thread, which is where a write may take its time. It skips a key already stored (a key
    names its bytes). After `close`, when the directory may be another daemon's, it touches no
    file: puts, removes and clears do nothing, gets miss.
    """

    contains_is_cheap = True  # an in-memory index

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes} bytes")
        self.root = Path(root)
        self._root = str(self.root)
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (size, seq)
        self._bytes = 0  # sum of the indexed sizes
        self._reserved = 0  # sizes of the writes in flight
        self._busy: set[str] = set()
        self._seq = itertools.count()
        self._tmp_seq = itertools.count()
        self._stats = TierStats(name=f"disk://{self.root}", capacity_bytes=capacity_bytes)
        self._write_warnings = _ThrottledWarning()
        self._corrupt_warnings = _ThrottledWarning()
        self._read_warnings = _ThrottledWarning()
        self._foreign_warnings = _ThrottledWarning()
        # The directory, tmp/ and the lock, open until closed and no operation holds them.
        self._root_fd = self._tmp_fd = self._lock_fd = -1
        self._closed = False
        self._holders = 0  # operations in flight that use the descriptors
        try:
            self._open_directory()
            self._remove_temp_files()
            self._reindex()
        except BaseException:
            self._close_descriptors()
            raise
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="lmcache-mp-disk-read")
        self._direct = True  # until the filesystem refuses O_DIRECT

    @classmethod
    def from_url(cls, url: str) -> DiskTier:
        """A tier for `disk:///ABSOLUTE/PATH?size_gb=N` (N in GiB, positive, may be fractional)."""
        parts = urlsplit(url)
        if parts.scheme != "disk":
            raise ValueError(f"not a disk tier URL: {url!r}; expected {_URL_HELP}")
        if parts.netloc or not parts.path.startswith("/") or parts.fragment:
            raise ValueError(f"disk tier URL {url!r} must name an absolute path: {_URL_HELP}")
        size_gb = _parse_size_gb(url, parts.query)
        return cls(Path(unquote(parts.path)), int(size_gb * _GiB))

    # -- start --------------------------------------------------------------------------------

    def _open_directory(self) -> None:
        """Create and probe the directory and its sub-directories, open them and take the lock."""
        try:
            os.makedirs(self._root, mode=0o700, exist_ok=True)
            # The operator's path, symlinks and all; below it, nothing is followed.
            self._root_fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._tmp_fd = self._own_directory(_TMP_DIR)
            probe = f".probe-{os.getpid()}-{threading.get_ident()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=self._tmp_fd))
            os.unlink(probe, dir_fd=self._tmp_fd)
            for shard in range(256):
                os.close(self._own_directory(f"{shard:02x}"))
            self._lock_fd = self._take_lock()
        except OSError as e:
            raise ValueError(f"disk tier: cannot use {self._root} as a cache directory "
                             f"({e.strerror or e}); pass a writable directory in --l2 {_URL_HELP}") from None

    def _own_directory(self, name: str) -> int:
        """The tier's sub-directory `name`, created if absent, opened without following a symlink:
        a symlink there is refused (mkdir leaves it, and opening it fails), never followed."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self._root_fd)
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except NotADirectoryError:  # what O_DIRECTORY | O_NOFOLLOW says of a symlink, too
            self._refuse_symlink(name)
            raise

    def _refuse_symlink(self, name: str) -> None:
        """Raise the start's error if the tier's own entry `name` is a symlink."""
        if stat.S_ISLNK(os.lstat(name, dir_fd=self._root_fd).st_mode):
            raise ValueError(f"disk tier: {os.path.join(self._root, name)} is a symbolic link, and the "
                             "tier follows none under its directory; remove it, or pass another directory")

    def _take_lock(self) -> int:
        # O_NOFOLLOW: the lock is truncated and written, so a symlink would have its target (or,
        # dangling, a new file at its target) written; O_NONBLOCK: a FIFO there cannot hang us.
        try:
            fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o600, dir_fd=self._root_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._refuse_symlink(_LOCK_FILE)
            raise
        try:
            self._check_lock_file(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"disk tier: {self._root} is in use by another lmcache-mp daemon "
                             f"(pid {owner}); give each daemon its own directory") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _check_lock_file(self, fd: int) -> None:
        # A hard link is another way to reach a file outside the directory with our truncate.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise ValueError(f"disk tier: {os.path.join(self._root, _LOCK_FILE)} is not a plain file of "
                             "its own (a FIFO, a device, a hard link to another file?); remove it")

    def _remove_temp_files(self) -> None:
        # Only after taking the lock: until then they could be another daemon's writes in flight.
        with os.scandir(self._tmp_fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    continue  # never one of ours (writes are files); emptying it would walk into it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=self._tmp_fd)  # a symlink goes itself, never its target

    def _reindex(self) -> None:
        started = time.monotonic()
        found, oversized = self._scan()
        found.sort()
        with self._lock:
            for _, name, size in found:
                self._index[name] = (size, next(self._seq))
                self._bytes += size
            found_bytes = self._bytes
            victims = self._evict_for(0)
            self._busy.update(name for name, _ in oversized)
            self._stats.corrupt_total += len(oversized)
        if oversized:
            logger.warning("disk tier %s: removing %d files named like objects but larger than the "
                           "capacity of %d bytes, which no object is (%s: %d bytes); not counted",
                           self._root, len(oversized), self._capacity, *oversized[0])
        self._unlink_busy(victims + [name for name, _ in oversized])
        logger.info("disk tier %s: indexed %d objects (%.2f GiB) in %.3f s; evicted %d to fit %.2f GiB",
                    self._root, len(found), found_bytes / _GiB, time.monotonic() - started,
                    len(victims), self._capacity / _GiB)

    def _scan(self) -> tuple[list[tuple[int, str, int]], list[tuple[str, int]]]:
        """The regular files named like objects, from stat alone: (mtime_ns, name, size) of those
        that can be objects, and (name, size) of those larger than the capacity, which cannot."""
        found: list[tuple[int, str, int]] = []
        oversized: list[tuple[str, int]] = []
        for shard in range(256):
            prefix = f"{shard:02x}"
            with self._shard(prefix) as shard_fd, os.scandir(shard_fd) as entries:
                for entry in entries:
                    # A symlink, a FIFO, a directory: foreign, left alone.
                    if not (_FILE_NAME.fullmatch(entry.name) and entry.name.startswith(prefix)
                            and entry.is_file(follow_symlinks=False)):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    name = entry.name[:-len(_SUFFIX)]
                    # Counted, such a file (the newest, say) would evict every real object first.
                    if st.st_size > self._capacity:
                        oversized.append((name, st.st_size))
                    else:
                        found.append((st.st_mtime_ns, name, st.st_size))
        return found, oversized

    # -- descriptors --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _descriptors(self) -> Iterator[bool]:
        """Keeps the descriptors open across the caller's file I/O; yields False once the tier is
        closed, when the caller must touch nothing (the directory may be another daemon's)."""
        with self._lock:
            held = not self._closed
            self._holders += held
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    self._holders -= 1
                    last = self._closed and not self._holders
                if last:
                    self._close_descriptors()

    def _close_descriptors(self) -> None:
        """Close the descriptors (the lock's releases the flock); once, by close or its last holder."""
        for fd in (self._lock_fd, self._tmp_fd, self._root_fd):
            if fd >= 0:
                os.close(fd)
        self._root_fd = self._tmp_fd = self._lock_fd = -1

    @contextlib.contextmanager
    def _shard(self, name: str) -> Iterator[int]:
        """The shard directory of object `name` (or of a 2-digit prefix), relative to the root and
        never through a symlink: one there raises NotADirectoryError."""
        fd = os.open(name[:2], _DIR_FLAGS, dir_fd=self._root_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- the tier -----------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        name = object_name(key)
        with self._lock:
            return name in self._index

    def put(self, key: ChunkKey, kv_chunk: torch.Tensor, blocking: bool = True) -> None:
        with self._descriptors() as held:
            if held:
                self._put(object_name(key), key, kv_chunk)

    def _put(self, name: str, key: ChunkKey, kv_chunk: torch.Tensor) -> None:
        with self._lock:
            if name in self._index or name in self._busy:
                return
        payload = chunk_format.as_buffer(kv_chunk)
        header = chunk_format.encode_header(key, payload, _WRITE_SLICE, self.pacer)
        size = _payload_offset(len(header)) + payload.nbytes
        victims = self._reserve(name, size)
        if victims is None:
            return
        self._unlink_busy(victims)
        try:
            self._write(name, header, payload, aligned=kv_chunk.data_ptr() % _BLOCK == 0)
        except OSError as e:
            self._end_write(name, size, stored=False)
            self._write_warnings.warning("disk tier %s: write failed, chunk not stored: %s", self._root, e)
            return
        self._end_write(name, size, stored=True)

    def _reserve(self, name: str, size: int) -> list[str] | None:
        """Mark `name` busy and `size` bytes reserved, evicting what must go (those names are
        returned, busy, for the caller to unlink); None when the write is to be skipped."""
        with self._lock:
            if name in self._index or name in self._busy:
                return None
            if self._reserved + size <= self._capacity:
                victims = self._evict_for(size)
                self._busy.add(name)
                self._reserved += size
                return victims
            self._stats.write_errors_total += 1
            in_flight = self._reserved
        self._write_warnings.warning("disk tier %s: a %d-byte chunk does not fit in the capacity of %d bytes "
                                     "(%d bytes of writes in flight); not stored",
                                     self._root, size, self._capacity, in_flight)
        return None

    def _evict_for(self, size: int) -> list[str]:
        """Under the lock: drop LRU entries until `size` more bytes fit; their names, now busy."""
        victims = []
        while self._bytes + self._reserved + size > self._capacity:
            name, (victim_size, _) = self._index.popitem(last=False)
            self._bytes -= victim_size
            victims.append(name)
        self._busy.update(victims)
        self._stats.evictions_total += len(victims)
        return victims

    def _write(self, name: str, header: bytes, payload: memoryview, aligned: bool) -> None:
        """Write the file (header, padding, payload) under tmp/ and rename it into place. The
        page-aligned bulk of an aligned payload goes by direct I/O, where the filesystem has it."""
        tmp = f"{name}.{next(self._tmp_seq)}"  # in tmp/
        fd, direct = self._create(tmp, direct=aligned and self._direct)
        try:
            try:
                # Direct I/O takes whole blocks only: the tail of a payload that isn't goes buffered.
                sliced = payload.nbytes // _BLOCK * _BLOCK if direct else payload.nbytes
                _write_all(fd, [_padded(header)])
                for start in range(0, sliced, _WRITE_SLICE):  # slices: room for the pacer
                    if self.pacer is not None:
                        self.pacer()
                    _write_all(fd, [payload[start:min(start + _WRITE_SLICE, sliced)]])
                if sliced < payload.nbytes:
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    _write_all(fd, [payload[sliced:]])
            finally:
                os.close(fd)
            with self._shard(name) as shard:
                # Replaces whatever has the name, a symlink included, without following it.
                os.rename(tmp, name + _SUFFIX, src_dir_fd=self._tmp_fd, dst_dir_fd=shard)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._tmp_fd)
            raise

    def _create(self, tmp: str, direct: bool) -> tuple[int, bool]:
        """A new file in tmp/ opened for writing, and whether with O_DIRECT: a filesystem that
        refuses it (EINVAL) gets buffered writes, from now on."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if direct:
            try:
                return os.open(tmp, flags | os.O_DIRECT, 0o600, dir_fd=self._tmp_fd), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._tmp_fd)
            self._direct = False
            logger.info("disk tier %s: the filesystem refuses direct I/O; writing through the page cache",
                        self._root)
        return os.open(tmp, flags, 0o600, dir_fd=self._tmp_fd), False

    def _end_write(self, name: str, size: int, stored: bool) -> None:
        with self._lock:
            self._busy.discard(name)
            self._reserved -= size
            if stored:
                self._index[name] = (size, next(self._seq))
                self._bytes += size
                self._stats.writes_total += 1
            else:
                self._stats.write_errors_total += 1

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        with self._descriptors() as held:
            if held:
                return self._get(object_name(key), key, out)
        self._count_miss()
        return None

    def _get(self, name: str, key: ChunkKey, out: torch.Tensor | None) -> torch.Tensor | None:
        with self._lock:
            entry = self._index.get(name)
            if entry is None:
                self._stats.misses_total += 1
                return None
        try:
            fd = self._open_object(name)
        except FileNotFoundError:  # removed behind our back
            self._drop(name, entry, unlink=False)
            self._count_miss()
            return None
        except OSError as e:
            self._read_failed(name, e)
            return None
        if fd is None:  # replaced behind our back by a symlink or the like: not ours to read or remove
            self._drop(name, entry, unlink=False)
            self._count_miss()
            self._foreign_warnings.warning("disk tier %s: %s is no longer a regular file in a shard "
                                           "directory (a symbolic link?); ignored, not followed",
                                           self._root, name)
            return None
        try:
            return self._read(fd, name, entry, key, out)
        except CorruptChunk as e:
            self._discard_corrupt(name, entry, e.reason)
        except OSError as e:
            self._read_failed(name, e)
        finally:
            os.close(fd)
        return None

    def _open_object(self, name: str) -> int | None:
        """`name`'s file opened for reading; None if it or its shard is a symlink or anything
        else but a regular file (resp. a directory), which is never followed."""
        try:
            with self._shard(name) as shard:
                fd = os.open(name + _SUFFIX, _READ_FLAGS, dir_fd=shard)
        except NotADirectoryError:  # the shard is a symlink, or not a directory
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # the file is a symlink
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device, a directory
            os.close(fd)
            return None
        return fd

    def _read(self, fd: int, name: str, entry: tuple[int, int], key: ChunkKey,
              out: torch.Tensor | None) -> torch.Tensor | None:
        first = os.pread(fd, _FIRST_READ, 0)
        header_size = chunk_format.header_size(first)
        if len(first) >= header_size:
            header = first[:header_size]
        else:
            header = first + os.pread(fd, header_size - len(first), len(first))
        payload_len = chunk_format.check_header(key, header)
        offset = _payload_offset(header_size)
        file_size = os.fstat(fd).st_size
        if file_size != offset + payload_len:
            raise CorruptChunk(f"file is {file_size} bytes, its header says {offset + payload_len}")
        if out is None:
            out = torch.empty(payload_len, dtype=torch.uint8)
        elif out.numel() * out.element_size() != payload_len:
            self._count_miss()
            return None
        dest = chunk_format.as_buffer(out)
        check = chunk_format.PayloadCheck(header)
        for start in range(0, payload_len, _READ_SLICE):  # each slice checksummed while cached
            piece = dest[start:start + _READ_SLICE]
            _read_all(fd, piece, offset + start)
            check.update(piece)
        check.done()
        with self._lock:
            if self._index.get(name) == entry:
                self._index.move_to_end(name)
            self._stats.hits_total += 1
        with contextlib.suppress(OSError):
            os.utime(fd)  # the LRU order, for the next start
        return out

    def _count_miss(self) -> None:
        with self._lock:
            self._stats.misses_total += 1

    def _read_failed(self, name: str, error: OSError) -> None:
        # EIO, EACCES and the like may be transient, so the file stays (LRU eviction ends it).
        self._count_miss()
        self._read_warnings.warning("disk tier %s: reading %s failed: %s", self._root, name, error)

    def _drop(self, name: str, entry: tuple[int, int], unlink: bool) -> bool:
        """Forget `name` if its entry is still `entry` (never a newer object's); with `unlink`,
        the name becomes busy for the caller to unlink. Whether it was forgotten."""
        with self._lock:
            if self._index.get(name) != entry:
                return False
            del self._index[name]
            self._bytes -= entry[0]
            if unlink:
                self._busy.add(name)
            return True

    def _discard_corrupt(self, name: str, entry: tuple[int, int], reason: str) -> None:
        with self._lock:
            self._stats.corrupt_total += 1
        if self._drop(name, entry, unlink=True):
            self._unlink_busy([name])
        self._corrupt_warnings.warning("disk tier %s: removed damaged object %s: %s",
                                       self._root, name, reason)

    def _unlink_busy(self, names: list[str]) -> None:
        """Unlink the files of `names` (out of the index and busy with us), then free the names.
        The caller holds the descriptors. Unlink never follows a symlink, and the shard is opened
        without following one."""
        try:
            for name in names:
                try:
                    with self._shard(name) as shard:
                        os.unlink(name + _SUFFIX, dir_fd=shard)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._write_warnings.warning("disk tier %s: cannot remove %s: %s", self._root, name, e)
        finally:
            if names:
                with self._lock:
                    self._busy.difference_update(names)

    def remove(self, key: ChunkKey) -> None:
        name = object_name(key)
        with self._descriptors() as held:
            if not held:
                return
            with self._lock:
                entry = self._index.pop(name, None)
                if entry is None:
                    return
                self._bytes -= entry[0]
                self._busy.add(name)
            self._unlink_busy([name])

    def clear(self) -> int:
        with self._descriptors() as held:
            if not held:
                return 0
            with self._lock:
                names = list(self._index)
                self._index.clear()
                self._bytes = 0
                self._busy.update(names)
            self._unlink_busy(names)
            return len(names)

    def stats(self) -> TierStats:
        with self._lock:
            return dataclasses.replace(self._stats, objects=len(self._index), bytes=self._bytes)

    def batched_get(self, keys: Iterable[ChunkKey],
                    outs: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """`get` of each key, on `_READ_THREADS` threads so reads overlap checksums."""
        keys = list(keys)
        out_list: list[torch.Tensor | None] = list(outs) if outs is not None else [None] * len(keys)
        if len(keys) < 2:
            return [self.get(k, o) for k, o in zip(keys, out_list, strict=True)]
        return list(self._readers.map(self.get, keys, out_list))

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = not self._holders
        if last:  # else the last operation in flight closes them
            self._close_descriptors()
