"""Moving a worker's CPU KV cache into shared memory in place, or allocating it there.

torch's `share_memory_()` moves a storage in place (its memory is swapped, so every tensor and view
of it keeps working), but it holds the whole cache twice meanwhile, and its copy takes a page fault
per 4 KiB page. Here, instead: a memfd of the storage's size, mapped by torch itself
(`_new_shared_fd_cpu`, so it is an ordinary torch shared storage afterwards: `is_shared()`,
`_share_fd_cpu_()`, unmapped and closed when freed), faulted in by the kernel
(MADV_POPULATE_WRITE) and filled with the storage's bytes in steps spread over threads (ctypes
calls let go of the GIL), each step's old pages given back to the kernel once copied (so the move
needs the cache's size once, not twice); then the two storages swap their memory
(`_swap_data_ptr_`, the in-place swap torch's share path makes too). No name is ever linked in
/dev/shm, and the kernel frees the memfd once no process maps it.

The memfd is sealed against shrinking (F_SEAL_SHRINK): the daemon maps it, and a file cut
short under a mapping would kill the daemon with SIGBUS at its next copy, so the daemon refuses
any memory without that seal. A kernel before 5.14 lacks MADV_POPULATE_WRITE: the pages are
then faulted in as they are written. Where the rest is missing or refused (an older torch, a
seccomp filter on memfd_create), torch's `share_memory_()` runs instead and the reason is
logged once: vLLM keeps working, but the daemon refuses that memory (it can shrink).

Moving costs about what faulting in fresh memory costs (docs/benchmarks.md, section 9): on a VM
whose fresh pages are slow, no way of moving can be much faster. So the connector also offers vLLM
`AllocateInSharedMemory` as the context its KV cache is allocated in: the cache is a memfd from
the start, and registering it hands over its descriptor without moving anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lmcache_mp.storage.pool.memory import MADV_POPULATE_WRITE, _madvise

logger = logging.getLogger(__name__)

STEP_BYTES = 64 << 20  # faulted in and copied per task: small enough to spread over threads
MAX_THREADS = 8  # past this the memory bus, not the threads, is the limit
PROGRESS_FROM_BYTES = 4 << 30  # caches this large log progress while they move
PROGRESS_EVERY_S = 2.0
FAST_PATH = "memfd"
TORCH_PATH = "torch share_memory_"

_fallback_logged = False


def move_to_shared_memory(storage: torch.UntypedStorage) -> str:
    """Move `storage` into shared memory in place; returns the path taken (FAST_PATH or
    TORCH_PATH) and logs one line with its size and time."""
    started = time.monotonic()
    path = FAST_PATH
    missing = _fast_path_missing(storage)
    try:
        if missing is not None:
            raise OSError(missing)
        _move_fast(storage)
    except (OSError, RuntimeError) as err:
        # Nothing was swapped yet: the storage still holds its own memory, untouched.
        _log_fallback_once(err)
        path = TORCH_PATH
        storage.share_memory_()
    elapsed = time.monotonic() - started
    gib = storage.nbytes() / 2**30
    logger.info("KV cache: %.2f GiB moved into shared memory in %.2f s (%.2f s/GiB, %s)", gib, elapsed,
                elapsed / max(gib, 1e-9), path)
    return path


class AllocateInSharedMemory(TorchFunctionMode):
    """While active, `torch.zeros(...)` on the CPU allocates in shared memory (a memfd, zeros from the
    kernel, faulted in as `torch.zeros` would) instead of the heap; every other call runs as usual,
    and so does `torch.zeros` when the memfd is refused (logged once). vLLM allocates its KV cache
    with one `torch.zeros` inside the context a KV connector gives it (`get_mem_pool_context`)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and _plain_cpu_zeros(kwargs):
            tensor = _shared_zeros(_size_of(args), kwargs.get("dtype") or torch.get_default_dtype())
            if tensor is not None:
                return tensor
        return func(*args, **kwargs)


def _plain_cpu_zeros(kwargs: dict[str, Any]) -> bool:
    """A `torch.zeros` call this mode can answer: only dtype and device given, and on the CPU."""
    if not set(kwargs) <= {"dtype", "device"}:
        return False
    device = kwargs.get("device")
    return (torch.device(device) if device is not None else torch.get_default_device()).type == "cpu"


def _size_of(args: tuple) -> torch.Size:
    # torch.zeros(2, 3) and torch.zeros((2, 3)) alike
    return torch.Size(args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args)


def _shared_zeros(size: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """A zero tensor in a memfd, or None (the caller allocates as usual) where that is refused."""
    nbytes = size.numel() * dtype.itemsize
    if nbytes == 0 or not hasattr(os, "memfd_create"):
        return None
    started = time.monotonic()
    try:
        storage = _new_memfd_storage(nbytes)
        address = storage.data_ptr()
        _run_steps(nbytes, lambda offset, n: _prefault(address + offset, n))
    except (OSError, RuntimeError) as err:
        _log_fallback_once(err)
        return None
    elapsed = time.monotonic() - started
    logger.info("KV cache: %.2f GiB allocated in shared memory in %.2f s (%s)", nbytes / 2**30, elapsed,
                FAST_PATH)
    return torch.empty(0, dtype=dtype).set_(storage, 0, size)


def _fast_path_missing(storage: torch.UntypedStorage) -> str | None:
    """Why the fast path can't run here, or None."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available"
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_"
    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return f"a {storage.nbytes()}-byte storage on {storage.device}"
    return None


def _move_fast(storage: torch.UntypedStorage) -> None:
    nbytes = storage.nbytes()
    shared = _new_memfd_storage(nbytes)
    src, dst = storage.data_ptr(), shared.data_ptr()
    released: list[int] = []  # steps copied, then released from the old memory (their offsets)
    try:
        _run_steps(nbytes, lambda offset, n: _move_step(dst, src, offset, n, released))
        storage._swap_data_ptr_(shared)
    except BaseException:
        for offset in released:  # a failed move leaves the storage as it found it
            ctypes.memmove(src + offset, dst + offset, min(STEP_BYTES, nbytes - offset))
        raise
    # `shared` now holds the old memory, freed with it here.


def _new_memfd_storage(nbytes: int) -> torch.UntypedStorage:
    """A torch storage over a fresh memfd of `nbytes` (zeros, not faulted in yet), sealed against
    shrinking: the daemon maps it too, and a file cut short under a mapping turns the next copy
    of the cut pages into SIGBUS, which would kill the daemon. It refuses memory without the seal."""
    fd = os.memfd_create("lmcache-mp-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a dup of fd
    finally:
        os.close(fd)


def _run_steps(nbytes: int, step: Callable[[int, int], None]) -> None:
    """`step(offset, n)` over [0, nbytes) in STEP_BYTES pieces, spread over threads; raises the
    first failure once every running step has ended (the rest are cancelled)."""
    offsets = range(0, nbytes, STEP_BYTES)
    progress = _Progress(nbytes) if nbytes >= PROGRESS_FROM_BYTES else None
    cpus = _process_cpus()
    with ThreadPoolExecutor(max(1, min(MAX_THREADS, len(offsets), len(cpus))), thread_name_prefix="kv-share",
                            initializer=os.sched_setaffinity, initargs=(0, cpus)) as pool:
        futures = [pool.submit(step, offset, min(STEP_BYTES, nbytes - offset)) for offset in offsets]
        try:
            for future in as_completed(futures):
                future.result()
                if progress is not None:
                    progress.step(STEP_BYTES)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _prefault(address: int, nbytes: int) -> None:
    """Have the kernel zero-fill these pages in one call, no fault per page. A kernel before
    5.14 does not know the advice (EINVAL): the pages are then faulted in as they are written,
    slower but still in the sealed memfd the daemon requires."""
    try:
        _madvise(address, nbytes, MADV_POPULATE_WRITE)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise


def _move_step(dst: int, src: int, offset: int, nbytes: int, released: list[int]) -> None:
    _prefault(dst + offset, nbytes)  # the copy then only copies
    ctypes.memmove(dst + offset, src + offset, nbytes)
    if _release(src + offset, nbytes):
        released.append(offset)


def _release(address: int, nbytes: int) -> bool:
    """Give the whole pages of [address, address + nbytes) back to the kernel (they read as zeros
    then), so that a move holds the old and the new memory at once one step at a time, not the
    whole cache twice. Partial pages at the ends may hold the allocator's own data: kept."""
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return False
    try:
        _madvise(start, end - start, mmap.MADV_DONTNEED)
    except OSError:  # e.g. locked memory: it is freed after the swap instead
        return False
    return True


def _process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on. vLLM's CPU worker pins each of its compute
    threads, its main thread included, to a CPU of its own, and threads inherit their creator's
    pinning: the fill threads are pinned to all of them instead (nothing else runs while the
    cache is set up)."""
    cpus = set(os.sched_getaffinity(0))
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has exited since the listing
            cpus |= os.sched_getaffinity(int(task))
    return cpus


class _Progress:
    """Logs how far a large move is, every PROGRESS_EVERY_S."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes
        self._done = 0
        self._started = self._last = time.monotonic()

    def step(self, nbytes: int) -> None:
        self._done = min(self._nbytes, self._done + nbytes)
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY_S and self._done < self._nbytes:
            self._last = now
            logger.info("KV cache: %.1f of %.1f GiB in shared memory (%.2f GB/s)", self._done / 2**30,
                        self._nbytes / 2**30, self._done / max(now - self._started, 1e-9) / 1e9)


def _log_fallback_once(err: BaseException) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.info("KV cache: the memfd path is unavailable (%s); using torch's own allocation and "
                    "share_memory_()", err)
