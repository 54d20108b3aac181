"""Zero-copy CPU registration: shared-memory KV caches handed over by file descriptor.

This module holds the shared memory itself; `attach.py` holds the hand-over of its descriptors
over the attach socket (and that socket's invariants).

Worker side: `share_cpu_tensors` moves each cache's storage into shared memory *in place*
(`shm_move`: the storage's memory is swapped, so vLLM keeps using the very same tensors and
views) and returns small handles plus one descriptor per storage, which `attach.AttachChannel`
passes to the daemon.

Daemon side: `map_storages` maps the descriptors (those `attach.AttachListener` accepted) and
`view_shared` opens each handle as a view of them; `prebuild_page_tables` faults the mappings in
once their registration is accepted.

The memory's invariants:
- The memory is a memfd (or, where that path is unavailable, torch's unlinked shared memory):
  there is no name in /dev/shm to leak, and the kernel frees it once the last process holding it
  is gone.
- The daemon maps only memory that cannot shrink under it and that it may write into (a memfd
  sealed with F_SEAL_SHRINK and not against writes, `_check_seals`); anything else is a typed
  refusal. A handle's geometry is the client's, so a view that would reach outside its mapping
  is refused (`view_shared`).
- A refused registration never faults in the worker's memory: page tables are built only once it
  is accepted, in the background.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading

import torch

from lmcache_mp.custom_types import SharedMemoryTensor
from lmcache_mp.storage.pool.memory import MADV_POPULATE_WRITE, _madvise
from lmcache_mp.transfer.dtypes import dtype_to_str, str_to_dtype
from lmcache_mp.transfer.shm_move import move_to_shared_memory
from lmcache_mp.transfer.views import view_of

logger = logging.getLogger(__name__)

_POPULATE_STEP_BYTES = 256 << 20
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; Python does not name it


# ---- worker side --------------------------------------------------------------------------


def share_cpu_tensors(tensors: list[torch.Tensor]) -> tuple[list[SharedMemoryTensor], list[int]]:
    """Move each tensor's storage into shared memory in place; return handles and the
    descriptors (owned by torch: do not close them) in storage-index order."""
    handles: list[SharedMemoryTensor] = []
    fds: list[int] = []
    index_of: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"expected CPU tensors, got one on {tensor.device}")
        storage = tensor.untyped_storage()
        if not storage.is_shared():
            move_to_shared_memory(storage)
        key = storage.data_ptr()
        if key not in index_of:
            try:
                fd, _size = storage._share_fd_cpu_()
            except RuntimeError as err:
                raise RuntimeError(
                    "cannot get a descriptor for a shared KV storage; torch's sharing strategy "
                    "must be 'file_descriptor' (the Linux default)"
                ) from err
            index_of[key] = len(fds)
            fds.append(fd)
        handles.append(SharedMemoryTensor(state=SharedMemoryTensor.State(
            storage_index=index_of[key],
            storage_nbytes=storage.nbytes(),
            dtype=dtype_to_str(tensor.dtype),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
        )))
    return handles, fds



# ---- daemon side ----------------------------------------------------------------------------


def map_storages(fds: list[int], nbytes: list[int]) -> list[torch.UntypedStorage]:
    """Map shared-memory descriptors (closing them) as torch storages. The mapping lives as
    long as any tensor viewing it. Nothing is touched: `prebuild_page_tables` once the
    registration is accepted."""
    storages = []
    try:
        for fd, size in zip(fds, nbytes, strict=True):
            _check_seals(fd)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"shared memory descriptor holds {actual} bytes, the handle says {size}")
            try:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as err:  # a descriptor opened read-only, say
                raise ValueError(f"its shared memory cannot be mapped to read and write: {err}") from None
            storages.append(torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage())
    finally:
        for fd in fds:
            os.close(fd)
    return storages


def _check_seals(fd: int) -> None:
    """Refuse memory its worker could cut short under the daemon's mapping: the daemon's next
    copy of the cut pages would die of SIGBUS. A memfd sealed with F_SEAL_SHRINK (as `shm_move`
    makes them) cannot shrink; nothing else is accepted. Refuse memory sealed against writes
    too: a RETRIEVE writes into it, and the kernel refuses such a shared writable mapping."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: not a memfd (a plain file, torch's shm_open memory, a pipe...)
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("its shared memory can shrink under the daemon: only a memfd sealed with "
                         f"F_SEAL_SHRINK is accepted, as the worker adapter makes them (seals {seals:#x})")
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise ValueError("its shared memory is sealed against writes (F_SEAL_WRITE or "
                         f"F_SEAL_FUTURE_WRITE, seals {seals:#x}): the daemon writes RETRIEVEd KV into it")


def prebuild_page_tables(storages: list[torch.UntypedStorage]) -> None:
    """Build the page tables of freshly mapped storages on a background thread, once their
    registration is accepted (a refused one must not fault in the worker's memory)."""
    threading.Thread(target=_build_page_tables, args=(storages,), name="attach-populate", daemon=True).start()


def _build_page_tables(storages: list[torch.UntypedStorage]) -> None:
    """Build the page tables of freshly mapped storages, so the first copies don't take a page fault
    per page. In the background: with MAP_POPULATE, REGISTER took ~0.7 s per GiB before it answered.
    Holding `storages` keeps the mappings alive until done; a copy meanwhile faults on its own."""
    for storage in storages:
        for start in range(0, storage.nbytes(), _POPULATE_STEP_BYTES):
            try:
                _madvise(storage.data_ptr() + start, min(_POPULATE_STEP_BYTES, storage.nbytes() - start),
                         MADV_POPULATE_WRITE)
            except OSError as err:  # a kernel before 5.14: pages are mapped as copies touch them
                logger.debug("not prebuilding the page tables of a shared KV cache: %s", err)
                return


def view_shared(handle: SharedMemoryTensor, storages: list[torch.UntypedStorage]) -> torch.Tensor:
    """The tensor `handle` describes, viewing one of the mapped `storages`. The geometry is
    the client's, so it is checked (`views.view_of`): a view that would reach outside the mapping
    is refused."""
    st = handle.state
    if not 0 <= st.storage_index < len(storages):
        raise ValueError(f"handle names shared storage {st.storage_index}, "
                         f"only {len(storages)} were attached")
    storage = storages[st.storage_index]
    if storage.nbytes() != st.storage_nbytes:
        raise ValueError(f"shared storage {st.storage_index} has {storage.nbytes()} bytes, "
                         f"the handle says {st.storage_nbytes}")
    return view_of(storage, str_to_dtype(st.dtype), st.shape, st.stride, st.storage_offset)
