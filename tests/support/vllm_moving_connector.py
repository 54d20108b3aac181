"""`LMCacheMPDaemonConnector` without its KV-cache allocation context, for the real-vLLM tests: vLLM
allocates its CPU cache on the heap, as with a vLLM that never asks a connector for the context,
and registering moves it into shared memory in place (`lmcache_mp.transfer.shm_move`)."""

from __future__ import annotations

from vllm_adapter.connector import LMCacheMPDaemonConnector as AllocatingConnector


class LMCacheMPDaemonConnector(AllocatingConnector):
    def get_mem_pool_context(self) -> None:
        return None
