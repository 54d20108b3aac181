"""The only CUDA-specific code: IPC export/import of tensors, interprocess events, a registered
context's copy stream, and page-locking the pool's memory.

Everything else (layouts, copies, the engine, checking a view's geometry) is shared with the CPU
path and exercised by the CPU tests. Nothing here runs without a GPU, except the pure parts:
`index_of_uuid` (finding a device by UUID) and the checks of a handle before anything is opened.

Only torch is needed: it exports and opens CUDA storages by IPC handle (`_share_cuda_`,
`_new_shared_cuda`), makes interprocess events and streams, and binds cudaHostRegister
(`torch.cuda.cudart()`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import cast

import torch

from lmcache_mp.custom_types import CudaIPCWrapper
from lmcache_mp.errors import FatalError
from lmcache_mp.transfer.dtypes import dtype_to_str, str_to_dtype
from lmcache_mp.transfer.views import check_view, view_of

# Named in every refusal of handles CUDA cannot open: the cause is nearly always the deployment,
# and the worker does not retry a refusal (INVALID_ARGUMENT), so the message must say what to fix.
IPC_REQUIREMENTS = ("daemon and vLLM must share the PID and IPC namespaces and see the same GPU; "
                    "CUDA IPC is impossible in EXCLUSIVE_PROCESS compute mode")

# `_share_cuda_()`'s tuple: (device, memory handle, storage bytes, storage offset in its allocation,
# ref-counter file, slot in it, event handle, event_sync_required). `_new_shared_cuda` takes the
# same (this process's device first) and type-checks it strictly: a bool is no int there.
_STORAGE_HANDLE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)

StorageHandle = tuple[bytes | int | bool | None, ...]


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _visible_uuids() -> list[str]:
    return [_device_uuid(index) for index in range(torch.cuda.device_count())]


def index_of_uuid(uuid: str, visible_uuids: list[str]) -> int:
    """The ordinal, in this process, of the device named `uuid`. Handles name devices by UUID,
    not ordinal: CUDA_VISIBLE_DEVICES may number the same device differently per process."""
    try:
        return visible_uuids.index(uuid)
    except ValueError:
        raise ValueError(f"no visible CUDA device has UUID {uuid} "
                         f"(visible: {', '.join(visible_uuids) or 'none'})") from None


def export_cuda_tensors(tensors: Sequence[torch.Tensor]) -> list[CudaIPCWrapper]:
    """One handle per tensor, in order, sharing each distinct storage once. Every `_share_cuda_()`
    puts its storage behind one more ref-counter slot and interprocess event (torch's
    CudaIPCSentData) that live as long as the storage, and vLLM 0.32 views every layer in one
    buffer: per layer, that was one of each per layer. The views of one storage carry the very same
    storage handle, so `import_cuda_tensors` opens it once; per view only its geometry differs."""
    shared: dict[tuple[int, int], StorageHandle] = {}
    handles = []
    for tensor in tensors:
        if not tensor.is_cuda:
            raise ValueError(f"expected CUDA tensors, got one on {tensor.device}")
        storage = tensor.untyped_storage()
        key = storage.data_ptr(), storage.nbytes()
        storage_handle = shared.get(key)
        if storage_handle is None:
            storage_handle = shared[key] = tuple(storage._share_cuda_())
        handles.append(CudaIPCWrapper(state=CudaIPCWrapper.State(
            device_uuid=_device_uuid(tensor.device.index),
            storage_handle=storage_handle,
            dtype=dtype_to_str(tensor.dtype),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
        )))
    return handles


def import_cuda_tensors(handles: Sequence[CudaIPCWrapper]) -> list[torch.Tensor]:
    """The tensors `handles` describe, opened in this process. Every handle is checked before
    anything is opened (its storage handle's form; its view inside that storage, as for shared
    memory: `views.check_view`); then each distinct storage, one device and storage handle, is
    opened once and viewed per handle. Raises ValueError for a malformed handle, and, naming
    IPC_REQUIREMENTS, for handles CUDA cannot open."""
    for handle in handles:
        st = handle.state
        check_view(str_to_dtype(st.dtype), st.shape, st.stride, st.storage_offset,
                   _storage_nbytes(st.storage_handle))
    try:
        storages = _open_storages(handles)
    except torch.OutOfMemoryError:
        raise  # no room on the device: the registry says so
    except (RuntimeError, ValueError) as err:  # torch.AcceleratorError, CudaError; no such device
        raise ValueError(f"cannot open the worker's CUDA memory: {err}; {IPC_REQUIREMENTS}") from None
    return [view_of(storages[h.state.device_uuid, h.state.storage_handle], str_to_dtype(h.state.dtype),
                    h.state.shape, h.state.stride, h.state.storage_offset) for h in handles]


def _storage_nbytes(storage_handle: StorageHandle) -> int:
    """The size of the storage `storage_handle` names, once it is checked to be one that
    `_new_shared_cuda` takes (it raises TypeError otherwise) and that names memory: the client
    made it."""
    types = tuple(type(value) for value in storage_handle)
    if types != _STORAGE_HANDLE_TYPES:
        raise ValueError("malformed CUDA storage handle: expected (device, handle, bytes, offset, "
                         "ref counter, slot, event, sync) typed "
                         f"{', '.join(t.__name__ for t in _STORAGE_HANDLE_TYPES)}; got "
                         f"{', '.join(t.__name__ for t in types) or 'nothing'}")
    nbytes, offset, slot = cast(tuple[int, int, int], storage_handle[2:4] + storage_handle[5:6])
    if nbytes <= 0 or offset < 0 or slot < 0:
        raise ValueError(f"CUDA storage handle names {nbytes} bytes at offset {offset} (ref-counter "
                         f"slot {slot}): no storage")
    return nbytes


def _open_storages(handles: Sequence[CudaIPCWrapper]
                   ) -> dict[tuple[str, StorageHandle], torch.UntypedStorage]:
    """Each distinct (device UUID, storage handle) of `handles`, opened on this process's ordinal
    of that device."""
    visible = _visible_uuids()
    storages: dict[tuple[str, StorageHandle], torch.UntypedStorage] = {}
    for handle in handles:
        key = handle.state.device_uuid, handle.state.storage_handle
        if key in storages:
            continue
        index = index_of_uuid(handle.state.device_uuid, visible)
        with torch.cuda.device(index):
            # event_sync_required=False: the exporter's event marks only what preceded the share
            # (vLLM zeroing its new cache), and every copy waits for an event of the operation's
            # own, recorded later on vLLM's stream. Opening it would leave one event open here per
            # import, which torch never destroys.
            storages[key] = torch.UntypedStorage._new_shared_cuda(index, *handle.state.storage_handle[1:7],
                                                                  False)
    return storages


def record_ipc_event(device: torch.device) -> torch.cuda.Event:
    """An interprocess event recorded on the device's current stream: it completes once the work
    enqueued so far (the forward pass that wrote the KV, or still reads the blocks) is done."""
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(device))
    return event


# How long an operation's copies may take, the wait for the worker's event included, before the
# daemon gives up on the device. Far past a worker's request timeout (30 s by default: it has given
# up on the request by then), a forward pass, and any copy (milliseconds a chunk): past it, the
# copies wait for what will never come (a worker that died mid-copy may leave its event unfired).
COMPLETION_DEADLINE_S = 120.0


def wait_bounded(waiter: Executor, wait: Callable[[], None], deadline_s: float, what: str) -> None:
    """Run `wait` (a blocking synchronize) on `waiter`'s thread, and return once it has, raising
    what it raised; raise FatalError if it has not returned within `deadline_s`.

    A CUDA wait takes no timeout, and polling an event either spins a core or adds up to its
    period to every operation's latency; handing the wait to a thread costs tens of microseconds
    and no core. Past the deadline that thread stays blocked: the daemon exits (FatalError)."""
    done = waiter.submit(wait)
    try:
        done.result(timeout=deadline_s)
    except TimeoutError:
        raise FatalError(f"{what} did not complete within {deadline_s:.0f} s (a worker that died "
                         "mid-copy may leave its event unfired): the device cannot be trusted") from None


def _is_cuda_error(err: BaseException) -> bool:
    """A CUDA error (torch.AcceleratorError since torch 2.8; before, a RuntimeError saying so)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        return isinstance(err, accelerator_error)
    return isinstance(err, RuntimeError) and str(err).startswith("CUDA error")


STAGING_SLOTS = 2  # a lane's staging buffers: one chunk's DMA overlaps the next one's gather


class CopyStream:
    """A registered context's own copy streams (one pair per lane; `urgent`: the load lane's). An
    operation's copies wait for the worker's event (on `stream` only, not the device) and are
    complete when `ordered` exits: an event recorded behind them is waited for, never a
    device-wide synchronize, so other ranks' copies and vLLM's own work run on.

    Its DMAs (between a staging slot and the pool) run on `transfer`, its gathers and scatters
    (between the worker's cache and a slot) on `stream`, so that one chunk's DMA overlaps the next
    chunk's gather (measured on H200s: a 256 MiB STORE in one process 5.9-6.05 -> 5.56-5.62 ms, the
    DMAs alone 4.92; docs/benchmarks.md section 8). Per slot, its writer waits until the slot is
    free and marks it ready; its reader waits until it is ready and marks it free (`writing`,
    `reading`)."""

    def __init__(self, device: torch.device, *, urgent: bool):
        self.device = device
        # Priority -1 (lower is more urgent) puts a load's copy kernels ahead of those of every
        # default-priority stream, vLLM's compute stream and the store lane's included.
        priority = -1 if urgent else 0
        self.stream = torch.cuda.Stream(device, priority=priority)
        self.transfer = torch.cuda.Stream(device, priority=priority)
        # Per staging slot: it holds what its reader needs / its last reader is done with it. An
        # event never recorded is complete: a slot's first use waits for nothing.
        self._ready = [torch.cuda.Event() for _ in range(STAGING_SLOTS)]
        self._free = [torch.cuda.Event() for _ in range(STAGING_SLOTS)]
        # Waits for this stream's copies (`wait_bounded`); at most one operation at a time uses
        # the stream (its lane's lock), so one thread. It exits when the context is dropped.
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="lmcache-mp-copy-wait")
        # Recorded behind each operation's copies (one operation at a time: re-recording is safe).
        # Blocking: the waiting thread sleeps until the copies are done instead of spinning a core
        # that vLLM's scheduler and API server need.
        self._done = torch.cuda.Event(blocking=True)

    @contextmanager
    def ordered(self) -> Iterator[None]:
        """The operation's copies on this stream; a CUDA error or a wait past the deadline raises
        FatalError (the daemon exits and is restarted with a new CUDA context)."""
        try:
            try:
                with torch.cuda.stream(self.stream):
                    yield
            finally:  # also on error: the chunk objects are freed or handed on only after their copies
                self.stream.wait_stream(self.transfer)
                self._done.record(self.stream)
                wait_bounded(self._waiter, self._done.synchronize, COMPLETION_DEADLINE_S,
                             f"the copies on {self.device}")
        except Exception as err:
            if _is_cuda_error(err):
                raise FatalError(f"a copy on {self.device} failed: {err} (CUDA errors are sticky: "
                                 "every later copy on this device would fail)") from err
            raise

    @contextmanager
    def writing(self, slot: int, *, transfer: bool) -> Iterator[None]:
        """The block's work writes staging slot `slot`, on the transfer stream (a DMA in) or on this
        one (a gather), once the slot's last reader is done with it."""
        stream = self._enter(slot, self._free, transfer)
        with self._on(stream):
            yield
        self._ready[slot].record(stream)

    @contextmanager
    def reading(self, slot: int, *, transfer: bool) -> Iterator[None]:
        """The block's work reads staging slot `slot` (a DMA out; a scatter), once it is written."""
        stream = self._enter(slot, self._ready, transfer)
        with self._on(stream):
            yield
        self._free[slot].record(stream)

    def _enter(self, slot: int, events: list[torch.cuda.Event], transfer: bool) -> torch.cuda.Stream:
        stream = self.transfer if transfer else self.stream
        stream.wait_event(events[slot])
        return stream

    def _on(self, stream: torch.cuda.Stream) -> AbstractContextManager[object]:
        # Inside `ordered` this stream is the current one already: switching costs host time per
        # chunk (the TRITON_MLA case's small chunks were host-bound).
        return torch.cuda.stream(stream) if stream is self.transfer else nullcontext()

    def wait_for(self, event_handle: bytes) -> None:
        """Later copies on this stream start once the other process's event has completed."""
        if not event_handle:
            return
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, event_handle)
        except RuntimeError as err:  # a worker's bad handle (not sticky): its request is refused
            raise ValueError(f"the worker's event handle cannot be opened on {self.device}: {err}") from None
        event.wait(self.stream)


_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context: the daemon copies to several GPUs


def register_host_memory(address: int, nbytes: int) -> Callable[[], None]:
    """Page-lock [address, address + nbytes) of this process's memory for DMA with
    cudaHostRegister (never torch's pinned allocator, which rounds sizes up to a power of two);
    returns the function that unregisters it. Raises torch.cuda.CudaError on failure."""
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    return lambda: torch.cuda.check_error(cudart.cudaHostUnregister(address))
