"""The only CUDA-specific code: IPC export/import of tensors and events.

Everything else (layouts, copies, the engine) is shared with the CPU path and exercised by
the CPU tests. Nothing here runs without a GPU, except `index_of_uuid`, the pure part of
finding a device by UUID.
"""

from __future__ import annotations

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


def wait_for_ipc_event(handle: bytes, device: torch.device) -> None:
    """Make the current stream wait for an event recorded by another process."""
    torch.cuda.Event.from_ipc_handle(device, handle).wait(torch.cuda.current_stream(device))


def synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()
