"""One object's file of the disk tier (`disk.py`): how it is laid out, written and read back.

Layout. A file holds the object of `chunk_format.py`: its checksummed header, zero padding to a
4 KiB block, then the chunk's bytes. Reads verify the header against the key, so a file can only
ever be served for the key it was written for, and the payload against its checksum.

Writes. The whole blocks of a page-aligned payload (the pool's objects are) are written with
O_DIRECT, straight from pool memory: a buffered write costs the writer thread kernel time that
the request path needs; the tail that doesn't fill a block goes buffered. Reads go through the
page cache. Which file, where, and what happens when the filesystem refuses O_DIRECT, are the
tier's (`disk.py`) and its directory's (`tiers/disk_directory.py`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable

import torch

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage import chunk_format
from lmcache_mp.storage.chunk_format import CorruptChunk

# The first read of a get: the prefix and, in one syscall, any realistic header (~200 bytes).
_FIRST_READ = 4096
# Files are laid out in blocks of this size (the header padded to it), so that the payload of
# an aligned pool object can be written with O_DIRECT: no page-cache copy, which costs the
# writer a core's worth of kernel time per ~0.6 GB/s of buffered writes on a small VM.
BLOCK = 4096
# A read goes in slices this big, each checksummed right after it lands, while it is still
# in the CPU's cache (one pass over memory instead of two).
_READ_SLICE = 1 << 20
# A write is checksummed and written in slices this big (a multiple of BLOCK), calling the
# tier's pacer before each: background work that gives way to the request path's copies.
WRITE_SLICE = 4 << 20


def payload_offset(header_size: int) -> int:
    """Where the payload starts in a file: the header padded to whole blocks (direct I/O)."""
    return -(-header_size // BLOCK) * BLOCK


def write(fd: int, header: bytes, payload: memoryview, direct: bool,
          pacer: Callable[[], None] | None) -> None:
    """Write the file (header, padding, payload) to `fd`, a new file opened with O_DIRECT if
    `direct`, calling `pacer` before each slice of the payload."""
    # Direct I/O takes whole blocks only: the tail of a payload that isn't goes buffered.
    sliced = payload.nbytes // BLOCK * BLOCK if direct else payload.nbytes
    _write_all(fd, [_padded(header)])
    for start in range(0, sliced, WRITE_SLICE):  # slices: room for the pacer
        if pacer is not None:
            pacer()
        _write_all(fd, [payload[start:min(start + WRITE_SLICE, sliced)]])
    if sliced < payload.nbytes:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        _write_all(fd, [payload[sliced:]])


def read_key(fd: int) -> ChunkKey:
    """The key the file at `fd` is named for, from its header alone (the payload unchecked).
    CorruptChunk if the header is damaged; OSError if it cannot be read."""
    return chunk_format.read_key(_read_header(fd))[0]


def _read_header(fd: int) -> bytes:
    first = os.pread(fd, _FIRST_READ, 0)
    header_size = chunk_format.header_size(first)
    if len(first) >= header_size:
        return first[:header_size]
    return first + os.pread(fd, header_size - len(first), len(first))


def read(fd: int, key: ChunkKey, out: torch.Tensor | None) -> torch.Tensor | None:
    """The payload of the file at `fd`, checked against `key` and its checksum, in `out` (or a
    new tensor); None if `out` is not of the payload's size. CorruptChunk if the file is
    damaged, truncated or another key's; OSError if it cannot be read."""
    header = _read_header(fd)
    payload_len = chunk_format.check_header(key, header)
    offset = payload_offset(len(header))
    file_size = os.fstat(fd).st_size
    if file_size != offset + payload_len:
        raise CorruptChunk(f"file is {file_size} bytes, its header says {offset + payload_len}")
    if out is None:
        out = torch.empty(payload_len, dtype=torch.uint8)
    elif out.numel() * out.element_size() != payload_len:
        return None
    dest = chunk_format.as_buffer(out)
    check = chunk_format.PayloadCheck(header)
    for start in range(0, payload_len, _READ_SLICE):  # each slice checksummed while cached
        piece = dest[start:start + _READ_SLICE]
        _read_all(fd, piece, offset + start)
        check.update(piece)
    check.done()
    return out


def _padded(header: bytes) -> memoryview:
    """The header and its zero padding, in page-aligned memory (an anonymous mapping), as
    direct I/O wants its buffers."""
    buffer = mmap.mmap(-1, payload_offset(len(header)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
