"""vLLM-side clients of the lmcache-mp daemon: adapters and the KV connector."""

from vllm_adapter.multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    get_lmcache_chunk_size,
    send_lmcache_request,
    striding_block_hashes,
    wrap_kv_caches,
)

__all__ = [
    "LMCacheMPSchedulerAdapter",
    "LMCacheMPWorkerAdapter",
    "LoadStoreOp",
    "get_lmcache_chunk_size",
    "send_lmcache_request",
    "striding_block_hashes",
    "wrap_kv_caches",
]
