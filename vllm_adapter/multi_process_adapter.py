"""The seed's `multi_process_adapter` and `utils` names, where code written for the seed finds them.

The adapters live in `scheduler_adapter.py` and `worker_adapter.py` (the worker's registration in
`registration.py`), the op and its keys in `ops.py`; their docstrings say where each differs from
the seed. The three helpers below are the seed's own API, kept for its callers: nothing here
calls them.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_mp.custom_types import KVCache
from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import RequestType
from vllm_adapter.kv_export import export_kv_caches
from vllm_adapter.ops import LoadStoreOp, striding_block_hashes
from vllm_adapter.scheduler_adapter import LMCacheMPSchedulerAdapter
from vllm_adapter.worker_adapter import LMCacheMPWorkerAdapter

__all__ = ["LMCacheMPSchedulerAdapter", "LMCacheMPWorkerAdapter", "LoadStoreOp", "get_lmcache_chunk_size",
           "send_lmcache_request", "striding_block_hashes", "wrap_kv_caches"]


def send_lmcache_request(mq_client: MessageQueueClient, request_type: RequestType,
                         payloads: list[Any]) -> MessagingFuture[Any]:
    """The seed's name for `mq_client.submit`."""
    return mq_client.submit(request_type, payloads)


def get_lmcache_chunk_size(mq_client: MessageQueueClient, timeout_s: float = 10.0) -> int:
    """The daemon's chunk size (the adapters learn it from HELLO instead)."""
    return send_lmcache_request(mq_client, RequestType.GET_CHUNK_SIZE, []).result(timeout_s)


def wrap_kv_caches(kv_caches: dict[str, torch.Tensor]) -> KVCache:
    """The seed's helper: just the handles of `export_kv_caches`."""
    return export_kv_caches(kv_caches)[0]
