"""Helpers shared by the scheduler and worker adapters (the seed's `utils`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from lmcache_mp.custom_types import KVCache
from lmcache_mp.mq import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import RequestType
from lmcache_mp.transfer.cuda import export_cuda_tensors, record_ipc_event
from lmcache_mp.transfer.shm import share_cpu_tensors


def striding_block_hashes(block_hashes: list[bytes], blocks_in_chunk: int) -> Iterator[bytes]:
    """One key per full chunk: the hash of the chunk's last block. vLLM's block hashes
    chain, so that one hash names the whole prefix through the end of the chunk. A partial
    tail chunk yields nothing."""
    return iter(block_hashes[blocks_in_chunk - 1 :: blocks_in_chunk])


def send_lmcache_request(mq_client: MessageQueueClient, request_type: RequestType,
                         payloads: list[Any]) -> MessagingFuture[Any]:
    return mq_client.submit(request_type, payloads)


def get_lmcache_chunk_size(mq_client: MessageQueueClient, timeout_s: float = 10.0) -> int:
    return send_lmcache_request(mq_client, RequestType.GET_CHUNK_SIZE, []).result(timeout_s)


def export_kv_caches(kv_caches: dict[str, torch.Tensor]) -> tuple[KVCache, list[int]]:
    """Handles for the daemon, one per layer in layer order, and the shared-memory file
    descriptors that go with them (CPU only; they travel over the attach socket). CPU caches
    are moved into shared memory in place (see `lmcache_mp.transfer.shm`); CUDA caches are
    exported by IPC handle, each storage once (vLLM puts every layer in one)."""
    tensors = list(kv_caches.values())
    if tensors and all(t.is_cuda for t in tensors):
        return list(export_cuda_tensors(tensors)), []
    handles, fds = share_cpu_tensors(tensors)
    return list(handles), fds


def wrap_kv_caches(kv_caches: dict[str, torch.Tensor]) -> KVCache:
    """The seed's helper: just the handles of `export_kv_caches`."""
    return export_kv_caches(kv_caches)[0]


def record_kv_event(kv_caches: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
    """For CUDA caches, an interprocess event on the current (vLLM's compute) stream: it marks the
    work enqueued so far, the forward pass that wrote the KV a STORE reads or still reads the blocks
    a RETRIEVE overwrites, and the daemon's copies wait for it. None for CPU caches: their work is
    done when the call returns."""
    first = next(iter(kv_caches.values()), None)
    if first is None or not first.is_cuda:
        return None
    return record_ipc_event(first.device)
