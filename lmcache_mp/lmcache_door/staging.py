"""Staging segments: where a worker in LMCache's `engine_driven` mode writes the chunks it stores and
reads those it loads: raw bytes, never a serialized Python object.

In that mode the worker copies its KV itself, chunk by chunk in LMCache's own chunk layout
(`[2, layers, tokens, hidden]`, or `[layers, tokens, hidden]` for one plane), into buffers the
server names: its registration reply names a POSIX shared-memory segment, each prepare_store /
prepare_retrieve reply the slots of it to use (offset, length, shape, dtype). Without a segment
its payloads would be pickled tensors, which this daemon never loads.

Each registration gets a segment of its own, made by the daemon in /dev/shm (a random name, mode
0600, the daemon's user), never the pool: a worker can write only into its own slots, and a chunk
reaches the pool only through the daemon's copy, at commit, under the key of the transfer those
slots were reserved for. The daemon never maps it (`segments.SegmentContext` copies with
`preadv`/`pwritev`, so a worker that cuts it short fails its own copies, nothing more). The file is
sparse: memory is spent only on the slots a worker writes, and a transfer gets the lowest free slots,
so that what is spent is what the most transfers in flight at once needed, and the pages a load
writes are ones its worker has mapped and touched before. It is removed with the registration
(unregistered, its worker gone, the daemon stopped); a daemon killed outright leaves it, and the
next daemon on the machine removes the segments of daemons no longer running (`remove_orphans`).
"""

from __future__ import annotations

import heapq
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_mp.lmcache_door.wire import DTYPE_SIZES, CpuShmDescriptor, TensorMetadata

SHM_DIR = Path("/dev/shm")
PREFIX = "lmcache_mp_staging_"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)_[0-9a-f]+")
MAX_SLOTS = 256  # chunks in flight per registration: the longest store or load it can stage
# A transfer prepared but never committed (its worker gave up between the two) keeps its slots this
# long, while the worker may still write into them; then they may go to another transfer.
ABANDONED_S = 600.0

TransferKey = tuple[str, str, int, int]  # ("store" | "retrieve", request id, start, end)


@dataclass
class _Transfer:
    slots: list[int]
    since: float
    first: int  # the index, in its key's range, of the chunk its first slot holds


@dataclass
class Staging:
    """One registration's segment: `slots` chunk-sized slots, and which transfer holds which."""

    name: str  # as shm_open(3) names it: "/" and the file's name
    chunk_shape: tuple[int, ...]  # LMCache's, as its worker views a slot
    dtype: str
    slots: int
    chunk_nbytes: int
    fd: int  # handed to the registration's copy context, which closes it
    _free: list[int] = field(default_factory=list)  # a heap: the lowest first
    _held: dict[TransferKey, _Transfer] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, chunk_shape: tuple[int, ...], dtype: str, budget_bytes: int) -> Staging:
        """A new segment of as many slots as `budget_bytes` holds (at least one, at most MAX_SLOTS)."""
        chunk_nbytes = math.prod(chunk_shape) * DTYPE_SIZES[dtype]
        if chunk_nbytes <= 0:
            raise ValueError(f"chunks of shape {chunk_shape}: empty")
        slots = max(1, min(MAX_SLOTS, budget_bytes // chunk_nbytes))
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, slots * chunk_nbytes)  # sparse: no memory until a worker writes
        except BaseException:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        return cls("/" + name, chunk_shape, dtype, slots, chunk_nbytes, fd, list(range(slots)))

    @property
    def nbytes(self) -> int:
        return self.slots * self.chunk_nbytes

    @property
    def identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def descriptor(self) -> CpuShmDescriptor:
        """The segment as one cache "layer" of `slots` blocks, each a whole chunk (one plane-layer
        row per token run): what `segments.SegmentContext` copies pages of."""
        rows = math.prod(self.chunk_shape[:-2])  # planes x layers
        tokens, hidden = self.chunk_shape[-2:]
        shape = (self.slots, rows, tokens, hidden)
        stride = (rows * tokens * hidden, tokens * hidden, hidden, 1)
        return CpuShmDescriptor(version=1, shm_name=self.name, nbytes=self.nbytes,
                                metadata=TensorMetadata(self.dtype, shape, stride, 0, "cpu"))

    def reserve(self, transfer: TransferKey, count: int, first: int = 0) -> list[int]:
        """Up to `count` free slots for `transfer`, for its chunks from index `first` on (what it
        held before is released first); fewer when fewer are free, after taking back those of
        transfers abandoned ABANDONED_S ago."""
        now = time.monotonic()
        with self._lock:
            self._release_locked(transfer)
            if len(self._free) < count:
                for key in [k for k, t in self._held.items() if now - t.since > ABANDONED_S]:
                    self._release_locked(key)
            slots = [heapq.heappop(self._free) for _ in range(min(count, len(self._free)))]
            if slots:
                self._held[transfer] = _Transfer(slots, now, first)
            return slots

    def held(self, transfer: TransferKey) -> tuple[int, list[int]] | None:
        """The index of the first chunk `transfer`'s slots hold, and those slots (None if it holds
        none), still held: copies from them are running."""
        with self._lock:
            held = self._held.get(transfer)
            return (held.first, held.slots) if held is not None else None

    def release(self, transfer: TransferKey, slots: list[int] | None = None) -> list[int] | None:
        """The slots `transfer` held (None if it holds none), free again; with `slots`, only if it
        still holds those (it was not prepared again meanwhile)."""
        with self._lock:
            held = self._held.get(transfer)
            if held is None or (slots is not None and held.slots is not slots):
                return None
            return self._release_locked(transfer)

    def _release_locked(self, transfer: TransferKey) -> list[int] | None:
        held = self._held.pop(transfer, None)
        if held is None:
            return None
        for slot in held.slots:
            heapq.heappush(self._free, slot)
        return held.slots

    def slot_descriptors(self, slots: list[int]) -> list[dict[str, object]]:
        """The slots as LMCache's worker reads them from a prepare reply."""
        return [{"offset": s * self.chunk_nbytes, "length": self.chunk_nbytes,
                 "shape": list(self.chunk_shape), "dtype": self.dtype} for s in slots]

    def remove(self) -> None:
        """Unlink the segment (a worker that still maps it keeps its memory until it unmaps)."""
        (SHM_DIR / self.name.lstrip("/")).unlink(missing_ok=True)


def remove_orphans(owner: int) -> list[str]:
    """Remove the staging segments of `owner` left by daemons no longer running (killed outright)."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        match = _NAME.fullmatch(path.name)
        try:
            if match is None or path.lstat().st_uid != owner or Path(f"/proc/{match.group(1)}").exists():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed
