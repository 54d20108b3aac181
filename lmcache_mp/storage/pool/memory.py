"""The pool's memory: one mapping (anonymous, or of a pool file: `pool/file.py`), prepared piece by
piece from its start.

Preparing means faulting every page in (a page faulted in by a STORE's copy costs that STORE ~3x
its copy time) and, where CUDA is present, page-locking it for DMA. For a large pool that takes
seconds to minutes, so the daemon does it on a background thread and answers at once; the pool
hands out only memory whose piece is prepared (`ready_bytes` only grows, from offset 0).

How pages are faulted in, measured on the 2-core KVM VM of docs/benchmarks.md (kernel 6.18, THP
in `madvise` mode), 2 GiB of fresh mapping, GB/s over several runs: touching each page (torch
`zero_`) 0.4-0.5; `memset` 0.9-1.1; MADV_POPULATE_WRITE 0.7-1.5; after MADV_HUGEPAGE, `memset`
1.1-3.5 and MADV_POPULATE_WRITE 1.2-5.5 (the kernel zeroes 2 MiB pages, one fault each, no
user-space write). So: MADV_HUGEPAGE, then MADV_POPULATE_WRITE; where the kernel lacks it (before
Linux 5.14) one byte per page is written instead.

Pinning is `cudaHostRegister` per piece (the `pin` callable, `transfer.cuda.register_host_memory`
in the daemon), never torch's pinned allocator: that one pins in one piece, before the daemon
could answer, and rounds sizes up to a power of two (a 100 GiB pool would take 128 GiB). A copy
spanning two separately registered pieces is still correct, but CUDA treats it as pageable and it
is slower; the pool ends pieces on its slab boundaries once it knows its slab size, so only an
object larger than a slab, or one in a piece prepared before the first REGISTER fixed that size,
can span two.

Pinning can fail where CUDA works (an RLIMIT_MEMLOCK or container policy, gVisor): the pool then
prepares the rest unpinned, which copies read and write just as correctly, staged through the
driver and slower, rather than never getting the capacity (`pinned_bytes`, `pin_error`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

from lmcache_mp.storage.pool.file import PoolFile

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 30  # what is pinned (registered) at once, and the unit of readiness
# Faulted in per madvise call; the stop flag is checked between them. Small, because the call holds
# the process's mmap lock throughout: every other thread's mmap (a thread's stack, a Python arena)
# waits for it, and starting a thread does so holding the GIL. A step holds it for its size over the
# populate rate; measured on the test VM, 2 GiB: 256 MiB steps held a thread start for up to 1.07 s
# at 0.5 GB/s (fresh guest memory) and 51 ms at 6.4 GB/s; 64 MiB steps 14-22 ms at 6.1 GB/s.
_STEP_BYTES = 64 << 20
_PROGRESS_EVERY_S = 2.0
_PROGRESS_EVERY_FRACTION = 0.1
MADV_HUGEPAGE = 14  # <linux/mman.h>; Python's mmap module may lack the names
MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

# pin(address, nbytes) page-locks that range and returns the function that unlocks it.
PinFn = Callable[[int, int], Callable[[], None]]


def _madvise(address: int, nbytes: int, advice: int) -> None:
    """madvise(2) through ctypes, which lets go of the GIL: `mmap.madvise` holds it, and a populate
    of a few hundred MiB would stall the daemon's socket thread for as long."""
    if _libc.madvise(address, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _round_up_page(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class PoolMemory:
    """A mapping of `nbytes` and its preparation, piece by piece, in order: private and anonymous,
    or the data of `backing`, a pool file, whose pages MADV_POPULATE_WRITE allocates without
    writing them (a full tmpfs then fails the call, where a plain write would kill the daemon with
    SIGBUS; huge pages where the kernel gives them to shared memory)."""

    def __init__(self, nbytes: int, pin: PinFn | None, piece_bytes: int,
                 backing: PoolFile | None = None) -> None:
        self.nbytes = nbytes
        self.piece_bytes = piece_bytes
        self._backing = backing
        if backing is not None:
            self.tensor = backing.data
        else:
            # Page-aligned: a mapping rather than the heap, whose large blocks start past a page.
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        self._pin = pin
        self._unpins: list[Callable[[], None]] = []
        # Both written only by the preparing thread: the pinned prefix of the mapping (from offset
        # 0), and why pinning stopped ("" while it has not failed).
        self.pinned_bytes = 0
        self.pin_error = ""
        self._populate = True  # cleared when the kernel refuses MADV_POPULATE_WRITE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready_bytes = 0  # written only by the preparing thread, after each piece

    @property
    def ready(self) -> bool:
        return self.ready_bytes >= self.nbytes

    def prepare(self, snap: Callable[[int], int], on_piece: Callable[[int], None]) -> None:
        """Prepare every piece in order on this thread, until all are or `close` stops it; after
        each, `on_piece(end)`. A piece ends at `snap(start + piece_bytes)`, the caller's boundary at
        or below that offset (page-aligned), or a page past it when that boundary is not past
        `start`. Raises OSError if a piece can't be faulted in: memory runs out. A piece that can't be
        pinned is used unpinned, and so is every later one (`pin_error`)."""
        started = last_log = time.monotonic()
        logged_bytes = 0
        while self.ready_bytes < self.nbytes:
            start = self.ready_bytes
            end = snap(start + self.piece_bytes)
            end = min(self.nbytes, end if end > start else _round_up_page(start + self.piece_bytes))
            if not self._prepare_piece(start, end):
                return
            self.ready_bytes = end
            on_piece(end)
            now = time.monotonic()
            if (now - last_log >= _PROGRESS_EVERY_S
                    or end - logged_bytes >= _PROGRESS_EVERY_FRACTION * self.nbytes) and end < self.nbytes:
                logger.info("pool: %.1f of %.1f GiB prepared (%.2f GB/s)", end / 2**30, self.nbytes / 2**30,
                            (end - logged_bytes) / max(now - last_log, 1e-9) / 1e9)
                last_log, logged_bytes = now, end
        elapsed = time.monotonic() - started
        pinned = ", not pinned" if self.pin_error else ", pinned" if self._pin else ""
        logger.info("pool ready: %.2f GiB prepared in %.2f s (%.2f GB/s)%s", self.nbytes / 2**30, elapsed,
                    self.nbytes / max(elapsed, 1e-9) / 1e9, pinned)

    def prepare_in_background(self, snap: Callable[[int], int], on_piece: Callable[[int], None]) -> None:
        """`prepare` on a thread of its own; a failure is logged and leaves the pool at what is
        ready (never larger: a doubtful page is never handed out)."""
        self._thread = threading.Thread(target=self._prepare_logged, args=(snap, on_piece),
                                        name="pool-prepare", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop preparing (within one step of faulting, or one piece's pinning) and unpin."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        while self._unpins:
            self._unpins.pop()()

    def _prepare_logged(self, snap: Callable[[int], int], on_piece: Callable[[int], None]) -> None:
        try:
            self.prepare(snap, on_piece)
        except Exception as err:  # whatever failed (memory ran out) ends preparation, nothing else
            logger.error("pool preparation stopped at %.2f of %.2f GiB: %s: %s; the pool serves with "
                         "what is ready", self.ready_bytes / 2**30, self.nbytes / 2**30,
                         type(err).__name__, err)

    def _prepare_piece(self, start: int, end: int) -> bool:
        """Fault in [start, end) and pin it (unless pinning failed); False, with the piece left
        unused, if stopped."""
        address = self.tensor.data_ptr()
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, slower to fault
            _madvise(address + start, end - start, MADV_HUGEPAGE)
        for step in range(start, end, _STEP_BYTES):
            if self._stop.is_set():
                return False
            self._fault_in(step, min(end, step + _STEP_BYTES))
        if self._pin is not None and not self.pin_error:
            try:
                self._unpins.append(self._pin(address + start, end - start))
            except RuntimeError as err:  # torch.cuda.CudaError
                self._pinning_failed(err)
            else:
                self.pinned_bytes = end
        return True

    def _pinning_failed(self, err: RuntimeError) -> None:
        """Pinning stops for good (the next piece would fail the same way); the pool goes on."""
        self.pin_error = f"{type(err).__name__}: {err}"
        logger.warning("pool: cannot pin memory for DMA beyond %.2f GiB (%s); preparing the rest "
                       "unpinned: copies stay correct, staged and slower", self.pinned_bytes / 2**30,
                       self.pin_error)

    def _fault_in(self, start: int, end: int) -> None:
        if self._populate:
            try:
                _madvise(self.tensor.data_ptr() + start, end - start, MADV_POPULATE_WRITE)
                return
            except OSError as err:
                # EINVAL: a kernel before 5.14. ENOMEM, and EFAULT (a full tmpfs: SIGBUS on access
                # otherwise), are real.
                if err.errno != errno.EINVAL:
                    raise
                self._populate = False
        if self._backing is not None:
            # Allocated in the file system, so that a full one fails here, not with SIGBUS at a
            # later write; never written: the file may hold chunks to adopt.
            os.posix_fallocate(self._backing.fd, self._backing.data_offset + start, end - start)
            return
        # One written byte per page faults it in (the kernel zeroes it).
        self.tensor[start:end:mmap.PAGESIZE].zero_()
