"""A lower tier in a local directory (an NVMe drive): one file per chunk, kept across restarts.

Files. Each chunk is one file, laid out, written and read by `tiers/disk_file.py` (a checksummed
header, padding to a block, the chunk's bytes; O_DIRECT writes). Its object name is a digest of
the key's ident. The directory -- its layout (shards, `lock`, `tmp/`), its no-symlink rule and
when its descriptors close -- is `tiers/disk_directory.py`'s. A digest collision is harmless: reads
verify the header against the key. A symlink (or anything but a regular file) at an object's name
is foreign: never indexed, read, written through or evicted (a get of it is a miss that leaves it
there; a put replaces the link).

Writes go to a temp file in `tmp/` (same filesystem) and are renamed into place, so a name never
shows a half-written file to a running daemon. A filesystem that refuses O_DIRECT (tmpfs, some
network filesystems) gets buffered writes from then on. There is no fsync: after a power loss a
file may be torn or empty, and the checksum catches it on its first read, which then deletes it.
A write that fails (ENOSPC, EIO, EDQUOT, ...) removes its temp file, is counted, logged at a
limited rate and otherwise ignored: the disk is a cache, and the daemon serves on without it.

Index. In memory: file name -> (size, sequence number), in LRU order (least recently read or
written first), and the sum of the sizes. At start it is rebuilt from the directory listing and
stat results alone (no file is opened), ordered by mtime; a hit sets the file's mtime, so the LRU
order survives restarts. Capacity counts whole files (headers included); a put evicts LRU files
until the new one fits, and the start evicts down to the capacity. A file larger than the whole
capacity is no object of this tier (a put refuses one) and is removed at start, uncounted: one such
file, say a sparse one, would otherwise evict every real object and then itself.

Concurrency. One lock guards the index, the counters and `_busy` (names with a write or an
unlink in flight); all file I/O happens outside it, while the directory's descriptors are
held. A put skips a name that is indexed or busy, and a file is unlinked only after its entry has
left the index, so a name is never written and unlinked at once. A reader that finds its file
gone, or damaged, drops the entry only if it is still the one it looked up (same sequence
number), so it never drops a newer object's entry. A read that races an eviction either misses
or reads the unlinked file through its open descriptor, whose bytes are still verified. The
worst a race can leave is an entry whose file is gone, which the next get of that key turns into
a miss.

Dropping a model. `drop_models` unlinks the files whose header names one of the models; the keys
of files found at the start are read from their headers first (as `announce` does). A file whose
header cannot be read (an I/O error) might be one of them: the drop then fails, naming how many.

Closing. `close` closes the directory: from then on the tier touches no file (puts, removes and
clears do nothing, gets miss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Set
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import torch

from lmcache_mp.chunks import ChunkKey, TierStats
from lmcache_mp.kv_events.resync import Pass
from lmcache_mp.storage import chunk_format
from lmcache_mp.storage.chunk_format import CorruptChunk
from lmcache_mp.storage.tiers import disk_file
from lmcache_mp.storage.tiers.base import StorageTier
from lmcache_mp.storage.tiers.disk_directory import DiskDirectory

logger = logging.getLogger(__name__)

_WARN_INTERVAL_S = 10.0
_GiB = 1 << 30
# Batched reads run on this many threads, so that one chunk's read (preadv, GIL released)
# overlaps another's checksum: promotion then keeps near the speed of a plain single-threaded
# read from the page cache, and beats it from a cold disk (measured: one thread ~60-75%).
_READ_THREADS = 2
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
        # The keys of indexed names, where known: those written by this process, and those
        # `announce` read from their headers. Only a known key's removal can be told (`events`).
        self._keys: dict[str, ChunkKey] = {}
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
        try:
            self._dir = DiskDirectory(self._root)
        except OSError as e:
            raise ValueError(f"disk tier: cannot use {self._root} as a cache directory "
                             f"({e.strerror or e}); pass a writable directory in --l2 {_URL_HELP}") from None
        try:
            self._dir.remove_temp_files()
            self._reindex()
        except BaseException:
            self._dir.close()
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
        """The directory's objects, from stat alone: (mtime_ns, name, size) of those that can be
        objects, and (name, size) of those larger than the capacity, which cannot."""
        found: list[tuple[int, str, int]] = []
        oversized: list[tuple[str, int]] = []
        for name, st in self._dir.objects():
            # Counted, such a file (the newest, say) would evict every real object first.
            if st.st_size > self._capacity:
                oversized.append((name, st.st_size))
            else:
                found.append((st.st_mtime_ns, name, st.st_size))
        return found, oversized

    # -- the tier -----------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        name = object_name(key)
        with self._lock:
            return name in self._index

    def put(self, key: ChunkKey, kv_chunk: torch.Tensor, blocking: bool = True) -> None:
        with self._dir.held() as held:
            if held:
                self._put(object_name(key), key, kv_chunk)

    def _put(self, name: str, key: ChunkKey, kv_chunk: torch.Tensor) -> None:
        with self._lock:
            if name in self._index or name in self._busy:
                return
        payload = chunk_format.as_buffer(kv_chunk)
        header = chunk_format.encode_header(key, payload, disk_file.WRITE_SLICE, self.pacer)
        size = disk_file.payload_offset(len(header)) + payload.nbytes
        victims = self._reserve(name, size)
        if victims is None:
            return
        self._unlink_busy(victims)
        try:
            self._write(name, header, payload, aligned=kv_chunk.data_ptr() % disk_file.BLOCK == 0)
        except OSError as e:
            self._end_write(name, key, size, stored=False)
            self._write_warnings.warning("disk tier %s: write failed, chunk not stored: %s", self._root, e)
            return
        self._end_write(name, key, size, stored=True)

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
            self._forget(name)
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
                disk_file.write(fd, header, payload, direct, self.pacer)
            finally:
                os.close(fd)
            self._dir.publish(tmp, name)
        except OSError:
            self._dir.discard_temp(tmp)
            raise

    def _create(self, tmp: str, direct: bool) -> tuple[int, bool]:
        """A new file in tmp/ opened for writing, and whether with O_DIRECT: a filesystem that
        refuses it (EINVAL) gets buffered writes, from now on."""
        if direct:
            try:
                return self._dir.create_temp(tmp, direct=True), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            self._direct = False
            logger.info("disk tier %s: the filesystem refuses direct I/O; writing through the page cache",
                        self._root)
        return self._dir.create_temp(tmp, direct=False), False

    def _end_write(self, name: str, key: ChunkKey, size: int, stored: bool) -> None:
        with self._lock:
            self._busy.discard(name)
            self._reserved -= size
            if stored:
                self._index[name] = (size, next(self._seq))
                self._bytes += size
                self._stats.writes_total += 1
                self._keys[name] = key
                if self.events is not None:
                    self.events.stored(key)
            else:
                self._stats.write_errors_total += 1

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        with self._dir.held() as held:
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
            fd = self._dir.open_object(name)
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

    def _read(self, fd: int, name: str, entry: tuple[int, int], key: ChunkKey,
              out: torch.Tensor | None) -> torch.Tensor | None:
        out = disk_file.read(fd, key, out)
        if out is None:  # not the payload's size
            self._count_miss()
            return None
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
            self._forget(name)
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
        The caller holds the directory's descriptors."""
        try:
            for name in names:
                try:
                    self._dir.unlink_object(name)
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
        with self._dir.held() as held:
            if not held:
                return
            with self._lock:
                entry = self._index.pop(name, None)
                if entry is None:
                    return
                self._bytes -= entry[0]
                self._forget(name)
                self._busy.add(name)
            self._unlink_busy([name])

    def clear(self) -> int:
        with self._dir.held() as held:
            if not held:
                return 0
            with self._lock:
                names = list(self._index)
                self._index.clear()
                for name in names:
                    self._forget(name)
                self._bytes = 0
                self._busy.update(names)
            self._unlink_busy(names)
            return len(names)

    def _forget(self, name: str) -> None:
        """Under the lock: `name` left the index; its removal is told if its key is known."""
        key = self._keys.pop(name, None)
        if key is not None and self.events is not None:
            self.events.removed(key)

    def announce(self, resync: Pass) -> None:
        """Tell `events` every indexed object; the keys of those found at the start are read from
        their headers first (one small read each; a damaged header is left to `get` to remove).
        A snapshot, told slice by slice, of the keys still indexed then (`kv_events/resync.py`)."""
        with self._dir.held() as held:
            if not held:
                return
            self._learn_keys()
            with self._lock:
                known = list(self._keys.items())
            for piece in resync.slices(known):
                with self._lock:
                    if self.events is None:
                        return
                    for name, key in piece:
                        if self._keys.get(name) is key:
                            self.events.stored(key)

    def drop_models(self, models: Set[str]) -> int:
        with self._dir.held() as held:
            if not held:
                return 0
            unreadable = self._learn_keys()
            with self._lock:
                names = [name for name, key in self._keys.items() if key.fmt.model_name in models]
                for name in names:
                    self._bytes -= self._index.pop(name)[0]
                    self._forget(name)
                self._busy.update(names)
            self._unlink_busy(names)
        if unreadable:
            raise OSError(f"{unreadable} files' headers could not be read (I/O errors): whether they hold "
                          "the model's chunks is unknown, so they stay")
        return len(names)

    def _learn_keys(self) -> int:
        """Read the keys of the indexed objects whose key is not known yet from their headers (a
        damaged or foreign one stays unknown: no key's read can verify it); returns how many could
        not be read (I/O errors). The caller holds the directory's descriptors."""
        with self._lock:
            unknown = [(name, entry) for name, entry in self._index.items() if name not in self._keys]
        unreadable = 0
        for name, entry in unknown:
            try:
                key = self._read_key(name)
            except OSError:
                unreadable += 1
                continue
            with self._lock:
                if key is not None and self._index.get(name) == entry:
                    self._keys[name] = key
        return unreadable

    def _read_key(self, name: str) -> ChunkKey | None:
        """The key in `name`'s header; None if it is gone, foreign or damaged. Raises OSError on
        an I/O error."""
        try:
            fd = self._dir.open_object(name)
        except FileNotFoundError:
            return None
        if fd is None:
            return None
        try:
            key = disk_file.read_key(fd)
        except CorruptChunk:
            return None
        finally:
            os.close(fd)
        return key if object_name(key) == name else None  # a file under another key's name

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
        self._dir.close()
