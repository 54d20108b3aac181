"""A registered cache's tensors as views of storages the daemon opened from a worker's handles.

The view geometry (dtype, shape, stride, offset) is the client's, for CPU shared memory and CUDA IPC
alike, so both paths check it here before viewing anything: a view reaching outside its storage
would let a copy read or write memory that is not the cache.
"""

from __future__ import annotations

import math

import torch


def check_view(dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], storage_offset: int,
               storage_nbytes: int) -> None:
    """Raise ValueError unless the view lies wholly inside a storage of `storage_nbytes` bytes."""
    if (len(shape) != len(stride) or min(shape, default=1) <= 0
            or min(stride, default=0) < 0 or storage_offset < 0):
        raise ValueError(f"invalid view: shape {shape}, stride {stride}, offset {storage_offset}")
    last = storage_offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    # A KV cache's elements are distinct bytes: more of them than the storage holds (a zero
    # stride repeating one) is no cache, and would overflow torch's element count.
    if max(last + 1, math.prod(shape)) * dtype.itemsize > storage_nbytes:
        raise ValueError(f"a {shape} view at offset {storage_offset} overruns the "
                         f"{storage_nbytes}-byte storage")


def view_of(storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple[int, ...],
            stride: tuple[int, ...], storage_offset: int) -> torch.Tensor:
    """The checked (`check_view`) view of `storage`, on its device."""
    check_view(dtype, shape, stride, storage_offset, storage.nbytes())
    view = torch.empty(0, dtype=dtype, device=storage.device)
    view.set_(storage, storage_offset, shape, stride)
    return view
