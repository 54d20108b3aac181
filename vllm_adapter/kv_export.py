"""How a worker's KV caches reach the daemon: shared once at registration, ordered per transfer.

KV bytes never travel in messages. At registration a worker hands over its caches: CPU caches
as shared-memory file descriptors (over the attach socket), CUDA caches as IPC handles, each
storage once. Every STORE or RETRIEVE of CUDA caches then carries an interprocess event that
orders the daemon's copies after vLLM's work on the same blocks.
"""

from __future__ import annotations

import torch

from lmcache_mp.custom_types import KVCache
from lmcache_mp.transfer.cuda import export_cuda_tensors, record_ipc_event
from lmcache_mp.transfer.shm import share_cpu_tensors


def export_kv_caches(kv_caches: dict[str, torch.Tensor]) -> tuple[KVCache, list[int]]:
    """Handles for the daemon, one per layer in layer order, and the shared-memory file
    descriptors that go with them (CPU only; they travel over the attach socket). CPU caches
    are moved into shared memory in place (see `lmcache_mp.transfer.shm`); CUDA caches are
    exported by IPC handle, each storage once (vLLM puts every layer in one)."""
    tensors = list(kv_caches.values())
    if tensors and all(t.is_cuda for t in tensors):
        return export_cuda_tensors(tensors), []
    handles, fds = share_cpu_tensors(tensors)
    return list(handles), fds


def record_kv_event(kv_caches: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
    """For CUDA caches, an interprocess event on the current (vLLM's compute) stream: it marks the
    work enqueued so far, the forward pass that wrote the KV a STORE reads or still reads the blocks
    a RETRIEVE overwrites, and the daemon's copies wait for it. None for CPU caches: their work is
    done when the call returns."""
    first = next(iter(kv_caches.values()), None)
    if first is None or not first.is_cuda:
        return None
    return record_ipc_event(first.device)
