"""The only CUDA-specific code: IPC export/import of tensors, interprocess events, a registered
context's copy stream, and page-locking the pool's memory.

Everything else (layouts, copies, the engine) is shared with the CPU path and exercised by
the CPU tests. Nothing here runs without a GPU, except `index_of_uuid`, the pure part of
finding a device by UUID.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from lmcache_mp.custom_types import CudaIPCWrapper
from lmcache_mp.transfer.dtypes import dtype_to_str, str_to_dtype


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


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIPCWrapper:
    if not tensor.is_cuda:
        raise ValueError("CudaIPCWrapper needs a CUDA tensor")
    storage_handle = tensor.untyped_storage()._share_cuda_()
    return CudaIPCWrapper(state=CudaIPCWrapper.State(
        device_uuid=_device_uuid(tensor.device.index),
        storage_handle=tuple(storage_handle),
        dtype=dtype_to_str(tensor.dtype),
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        storage_offset=tensor.storage_offset(),
    ))


def import_cuda_tensor(handle: CudaIPCWrapper) -> torch.Tensor:
    st = handle.state
    index = index_of_uuid(st.device_uuid, _visible_uuids())
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(index, *st.storage_handle[1:])
        view = torch.empty(0, dtype=str_to_dtype(st.dtype), device=f"cuda:{index}")
        view.set_(storage, st.storage_offset, st.shape, st.stride)
    return view


def record_ipc_event(device: torch.device) -> torch.cuda.Event:
    """An interprocess event recorded on the device's current stream: it completes once the work
    enqueued so far (the forward pass that wrote the KV, or still reads the blocks) is done."""
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(device))
    return event


class CopyStream:
    """A registered context's own copy stream. An operation's copies wait for the worker's event
    (on this stream only, not the device) and are complete when `ordered` exits: an event recorded
    behind them is waited for, never a device-wide synchronize, so other ranks' copies and vLLM's
    own work run on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def ordered(self) -> Iterator[None]:
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # also on error: the chunk objects are freed or handed on only after their copies
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()

    def wait_for(self, event_handle: bytes) -> None:
        """Later copies on this stream start once the other process's event has completed."""
        if event_handle:
            torch.cuda.Event.from_ipc_handle(self.device, event_handle).wait(self.stream)


_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context: the daemon copies to several GPUs


def register_host_memory(address: int, nbytes: int) -> Callable[[], None]:
    """Page-lock [address, address + nbytes) of this process's memory for DMA with
    cudaHostRegister (never torch's pinned allocator, which rounds sizes up to a power of two);
    returns the function that unregisters it. Raises torch.cuda.CudaError on failure."""
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    return lambda: torch.cuda.check_error(cudart.cudaHostUnregister(address))
