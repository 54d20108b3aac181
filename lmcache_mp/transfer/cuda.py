"""The only CUDA-specific code: IPC export/import of tensors and events.

Everything else (layouts, copies, the engine) is shared with the CPU path and exercised by
the CPU tests. Nothing here runs without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmcache_mp.custom_types import dtype_to_str, str_to_dtype


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _index_of_uuid(uuid: str) -> int:
    # Map by UUID, not ordinal: CUDA_VISIBLE_DEVICES may number devices differently per process.
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise ValueError(f"no visible CUDA device has UUID {uuid}")


def export_cuda_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    if not tensor.is_cuda:
        raise ValueError("CudaIPCWrapper needs a CUDA tensor")
    storage_handle = tensor.untyped_storage()._share_cuda_()
    return {
        "device_uuid": _device_uuid(tensor.device.index),
        "storage_handle": tuple(storage_handle),
        "dtype": dtype_to_str(tensor.dtype),
        "shape": tuple(tensor.shape),
        "stride": tuple(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
    }


def import_cuda_tensor(device_uuid: str, storage_handle: tuple, dtype: str, shape: tuple[int, ...],
                       stride: tuple[int, ...], storage_offset: int) -> torch.Tensor:
    index = _index_of_uuid(device_uuid)
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(index, *storage_handle[1:])
        view = torch.empty(0, dtype=str_to_dtype(dtype), device=f"cuda:{index}")
        view.set_(storage, storage_offset, shape, stride)
    return view


def wait_for_ipc_event(handle: bytes, device: torch.device) -> None:
    """Make the current stream wait for an event recorded by another process."""
    torch.cuda.Event.from_ipc_handle(device, handle).wait(torch.cuda.current_stream(device))


def synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context: the daemon copies to several GPUs


def register_host_memory(address: int, nbytes: int) -> Callable[[], None]:
    """Page-lock [address, address + nbytes) of this process's memory for DMA with
    cudaHostRegister (never torch's pinned allocator, which rounds sizes up to a power of two);
    returns the function that unregisters it. Raises torch.cuda.CudaError on failure."""
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    return lambda: torch.cuda.check_error(cudart.cudaHostUnregister(address))
