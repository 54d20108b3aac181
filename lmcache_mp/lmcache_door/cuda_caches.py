"""The KV caches LMCache's connector registers on CUDA: torch IPC handles of vLLM's own cache.

Its `cuda` descriptor is what our connector sends too, in other clothes: torch's `_share_cuda_`
tuple of the storage, the device's UUID, and the layer's view (dtype, shape, strides, offset in
elements). So the caches are opened by the same code as ours (`transfer/cuda.py`), described by the
same geometry (`transfer/layouts.py`) and copied by the same context (`transfer/context.py`).

LMCache's worker may send a layer's dimensions reordered: `views.logical_view` turns them back.

Not served, each refused with its reason: LMCache's isolated-IPC mode (`cuda_raw` descriptors of
driver-level handles, and timeline-semaphore events in place of CUDA's interprocess events) and VMM
allocations (a descriptor this version does not decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_mp.custom_types import CudaIPCWrapper
from lmcache_mp.lmcache_door.views import layout_name, logical_view
from lmcache_mp.lmcache_door.wire import CudaDescriptor, Descriptors, LayoutHints, RawCudaDescriptor

if TYPE_CHECKING:
    from lmcache_mp.transfer.context import TransferContext

CUDA_LAYOUT = "LMCACHE_CUDA"
# cudaIpcEventHandle_t: what torch's Event.ipc_handle() gives and Event.from_ipc_handle takes.
EVENT_HANDLE_BYTES = 64
ISOLATED_IPC = ("LMCache's isolated IPC mode (driver-level memory handles, timeline-semaphore events) is "
                "not served: run vLLM with isolated_ipc off (the default), sharing the daemon's PID and IPC "
                "namespaces")


def is_cuda(descriptors: Descriptors) -> bool:
    """Whether the registration is of CUDA caches (any kind of CUDA descriptor)."""
    return any(isinstance(d, CudaDescriptor | RawCudaDescriptor) for d in descriptors)


def wrappers(descriptors: Descriptors) -> list[CudaIPCWrapper]:
    """Our own handles for LMCache's `cuda` descriptors; ValueError for any other kind."""
    out = []
    for i, d in enumerate(descriptors):
        if isinstance(d, RawCudaDescriptor):
            raise ValueError(ISOLATED_IPC)
        if not isinstance(d, CudaDescriptor):
            raise ValueError(f"layer {i}: a {type(d).__name__} among CUDA caches")
        m = d.metadata
        out.append(CudaIPCWrapper(state=CudaIPCWrapper.State(
            device_uuid=m.device_uuid, storage_handle=d.handle, dtype=m.dtype, shape=m.shape, stride=m.stride,
            storage_offset=m.storage_offset)))
    return out


def check_event_handle(handle: bytes) -> None:
    """A transfer's event must be one CUDA interprocess event handle (empty: nothing to wait for)."""
    if handle and len(handle) != EVENT_HANDLE_BYTES:
        raise ValueError(f"an event handle of {len(handle)} bytes, not CUDA's {EVENT_HANDLE_BYTES}: "
                         f"{ISOLATED_IPC}")


def cuda_context(descriptors: Descriptors, hints: LayoutHints, block_size: int, chunk_size: int
                 ) -> TransferContext:
    """The registration's copy context over its opened caches; ValueError saying why not."""
    from lmcache_mp.transfer.context import TransferContext
    from lmcache_mp.transfer.cuda import import_cuda_tensors
    from lmcache_mp.transfer.layouts import describe_caches

    layers = [logical_view(layer, hints.kv_layout, block_size)
              for layer in import_cuda_tensors(wrappers(descriptors))]
    layers, geometry = describe_caches(layers, layout_name(CUDA_LAYOUT, hints.kv_layout), block_size)
    return TransferContext(layers, geometry, chunk_size)
