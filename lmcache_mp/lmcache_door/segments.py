"""The KV caches LMCache's connector registers on CPU: named POSIX shared-memory segments.

Its worker copies vLLM's cache into a segment it creates (`/dev/shm/lmcache_kv_<pid>_<n>`, one per
backing storage, every layer a view of it) and sends each layer's descriptor: the segment's name and
size, the view's dtype, shape, strides and offset (`wire.CpuShmDescriptor`). The daemon opens each
segment once, under checks a hostile or careless client cannot get past:
- the name is one file directly in /dev/shm (no path, no symbolic link: `O_NOFOLLOW`);
- a regular file of the daemon's own user (the only user whose caches it may write), with one name
  (a second hard link could be one of the daemon's pool files), and not the pool file itself;
- at least as large as the descriptors say.

It never maps a segment: POSIX shared memory cannot be sealed against shrinking as our own memfds
are, and a mapped page its worker cuts off would kill the daemon with SIGBUS at the next copy. The
copies are `preadv`/`pwritev` on the descriptor instead, where a shrunk segment is a short read (the
STORE fails, nothing is committed); every copy first checks the segment's size.

`segment_context` describes the caches with torch's meta tensors (shapes and strides, no memory), so
that the geometry, chunk format and block checks are the same code as for every other registration
(`transfer/layouts.py`, `transfer/context.py`); only the copies differ (`SegmentCopies`).
"""

from __future__ import annotations

import os
import re
import stat
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from lmcache_mp.lmcache_door.views import logical_view
from lmcache_mp.lmcache_door.wire import CpuShmDescriptor
from lmcache_mp.transfer.context import Lane, TransferContext, consecutive_runs, kept_runs
from lmcache_mp.transfer.layouts import describe_caches

SHM_DIR = Path("/dev/shm")
# A POSIX shared-memory name as shm_open(3) takes it: "/" and one file name.
_SEGMENT_NAME = re.compile(r"/?([A-Za-z0-9_.+-]{1,255})")
MAX_SEGMENTS = 64  # per registration: LMCache makes one per backing storage (one, on vLLM 0.32)


@dataclass(frozen=True)
class Segment:
    """A client's segment, opened for reading and writing (closed with the last context using it)."""

    name: str
    fd: int
    nbytes: int  # as the descriptors say; the file is at least this large when opened
    identity: tuple[int, int]  # (st_dev, st_ino)


def _file_name(shm_name: str) -> str:
    match = _SEGMENT_NAME.fullmatch(shm_name)
    if match is None or match.group(1) in (".", ".."):
        raise ValueError(f"segment name {shm_name[:64]!r} is not one file name in {SHM_DIR}")
    return match.group(1)


def open_segment(shm_name: str, nbytes: int, owner: int, forbidden: set[tuple[int, int]]) -> Segment:
    """Open `shm_name` under the checks of the module docstring; ValueError saying which failed."""
    path = SHM_DIR / _file_name(shm_name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"cannot open segment {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"segment {path} is not a regular file")
        if st.st_uid != owner:
            raise ValueError(f"segment {path} belongs to uid {st.st_uid}, not to this daemon's user "
                             f"({owner})")
        if st.st_nlink != 1 or identity in forbidden:
            raise ValueError(f"segment {path} has {st.st_nlink} names or is one of this daemon's own files")
        if st.st_size < nbytes:
            raise ValueError(f"segment {path} holds {st.st_size} bytes, its descriptors say {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return Segment(shm_name, fd, nbytes, identity)


def open_segments(descriptors: list[CpuShmDescriptor], owner: int,
                  forbidden: set[tuple[int, int]]) -> dict[str, Segment]:
    """Each segment the layers name, opened once; every one closed if any check fails."""
    sizes: dict[str, int] = {}
    for i, d in enumerate(descriptors):
        if sizes.setdefault(d.shm_name, d.nbytes) != d.nbytes:
            raise ValueError(f"layer {i} gives segment {d.shm_name!r} {d.nbytes} bytes, an earlier one "
                             f"{sizes[d.shm_name]}")
    if len(sizes) > MAX_SEGMENTS:
        raise ValueError(f"{len(sizes)} segments; at most {MAX_SEGMENTS}")
    opened: dict[str, Segment] = {}
    try:
        for name, nbytes in sizes.items():
            opened[name] = open_segment(name, nbytes, owner, forbidden)
    except BaseException:
        for segment in opened.values():
            os.close(segment.fd)
        raise
    return opened


def _meta_layer(d: CpuShmDescriptor) -> torch.Tensor:
    """The layer's view as a meta tensor: its shape and strides over its segment, no memory."""
    dtype = getattr(torch, d.metadata.dtype)
    base = torch.empty(d.nbytes // dtype.itemsize, dtype=dtype, device="meta")
    return base.as_strided(d.metadata.shape, d.metadata.stride, d.metadata.storage_offset)


def _dense(page: torch.Tensor) -> bool:
    """Whether a page's elements fill one run of bytes, in whatever order its dimensions are (its
    bytes are copied as they lie: the same order out of the segment and back into it)."""
    order = sorted(range(page.dim()), key=lambda d: (-page.stride(d), page.size(d) == 1))
    return page.permute(order).is_contiguous()


class SegmentContext(TransferContext):
    """A registration's copies between its segments and the pool: `TransferContext`'s geometry and
    checks, with file copies (`SegmentCopies`) in place of tensor copies."""

    def __init__(self, descriptors: list[CpuShmDescriptor], segments: dict[str, Segment], layout: str,
                 kv_layout: str | None, block_size: int, chunk_size: int):
        layers = [logical_view(_meta_layer(d), kv_layout, block_size) for d in descriptors]
        layers, geometry = describe_caches(layers, layout, block_size)
        super().__init__(layers, geometry, chunk_size, staged=False)
        for i, view in enumerate(self._views):  # block-major
            if not _dense(view[0]):
                raise ValueError(f"layer {i}: a block's page is not one contiguous run of bytes (strides "
                                 f"{descriptors[i].metadata.stride}); this daemon copies whole pages")
        itemsize = geometry.dtype.itemsize
        # Per layer: its segment's descriptor, its block 0's byte offset and the bytes between blocks.
        self._pages = [(segments[d.shm_name].fd, view.storage_offset() * itemsize, view.stride(0) * itemsize)
                       for d, view in zip(descriptors, self._views, strict=True)]
        self.page_nbytes = geometry.page_nbytes
        self.segments = list(segments.values())
        for segment in self.segments:  # closed once no copy nor registration holds this context
            weakref.finalize(self, os.close, segment.fd)

    def chunk_view(self, data: torch.Tensor) -> torch.Tensor:
        """A pool object's bytes as `[layers, blocks_per_chunk, page bytes]`."""
        return data.view(self.geometry.num_layers, self.blocks_per_chunk, self.page_nbytes)

    @contextmanager
    def operation(self, block_ids: list[int], event_handle: bytes, lane: Lane,
                  chunk_blocks: list[int] | None = None) -> Iterator[SegmentCopies]:
        del event_handle, lane  # CPU: no device work to wait for, no lanes to take turns in
        for segment in self.segments:
            size = os.fstat(segment.fd).st_size
            if size < segment.nbytes:  # its worker cut it short: a write would grow it back
                raise ValueError(f"segment {segment.name} holds {size} bytes, {segment.nbytes} when "
                                 "registered")
        yield SegmentCopies(self, block_ids, chunk_blocks)


class SegmentCopies:
    """One STORE's or RETRIEVE's copies, chunk by chunk, as `transfer.context.Copies` does them."""

    splittable = True  # positional reads and writes: chunks may be copied from several threads

    def __init__(self, context: SegmentContext, block_ids: list[int], chunk_blocks: list[int] | None):
        self._ctx = context
        self._block_ids = block_ids
        self._starts: list[int] | None = None
        if chunk_blocks is not None:
            self._starts = [0]
            for count in chunk_blocks:
                self._starts.append(self._starts[-1] + count)

    def _ids(self, i: int) -> list[int]:
        if self._starts is None:
            bpc = self._ctx.blocks_per_chunk
            return self._block_ids[i * bpc:(i + 1) * bpc]
        return self._block_ids[self._starts[i]:self._starts[i + 1]]

    def gather(self, i: int, chunk: torch.Tensor) -> None:
        """Read chunk `i`'s pages of every layer out of the segments into `chunk` (`chunk_view`)."""
        self._copy(i, chunk, write=False)

    def scatter(self, chunk: torch.Tensor, i: int) -> None:
        """Write `chunk` into chunk `i`'s pages of every layer; -1 ids are left alone."""
        self._copy(i, chunk, write=True)

    def _copy(self, i: int, chunk: torch.Tensor, *, write: bool) -> None:
        ctx = self._ctx
        ids = self._ids(i)
        page = ctx.page_nbytes
        for start, end in kept_runs(ids):
            for position, count in consecutive_runs(ids, start, end):
                for layer, (fd, first, step) in enumerate(ctx._pages):
                    if step == page:  # the run's pages are one range of the file, and of the chunk
                        _transfer(fd, chunk[layer, position:position + count].numpy(),
                                  first + ids[position] * step, write)
                        continue
                    for n in range(count):
                        _transfer(fd, chunk[layer, position + n].numpy(), first + (ids[position] + n) * step,
                                  write)


def _transfer(fd: int, buffer: numpy.ndarray, offset: int, write: bool) -> None:
    """One positional read or write of a whole buffer; OSError on a short one (a segment cut short)."""
    want = buffer.nbytes
    done = os.pwritev(fd, [buffer], offset) if write else os.preadv(fd, [buffer], offset)
    if done != want:
        raise OSError(f"the segment gave {done} of {want} bytes at offset {offset}: it was cut short")
