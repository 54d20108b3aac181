"""Issue 10: registrations. A chunk the pool can't allocate is refused at REGISTER.

The real daemon, real shared memory and the real worker adapter, as in test_data_path.py.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_mp.errors import ServerError
from lmcache_mp.launcher import DaemonProcess
from lmcache_mp.protocol import ErrorCode
from tests.helpers import BLOCK, CHUNK, LAYERS, block_hashes, status
from tests.kv_worker import make_caches, wait_done
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

# A pool whose tail doesn't fill a slab: once a 16 KiB chunk has fixed the slab size (9 chunks,
# 144 KiB), the pool can allocate 7 slabs in one piece, 1008 KiB, less than its capacity.
POOL_BYTES = 1124 * 1024
SMALL_CHUNK = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2
CONTIGUOUS = 7 * 9 * SMALL_CHUNK
BIG_HEADS = 132  # a chunk of 1056 KiB: less than the pool, more than it can allocate in one piece
BIG_CHUNK = LAYERS * (CHUNK // BLOCK) * BIG_HEADS * BLOCK * 64 * 2


@pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", repr(POOL_BYTES / 2**30))
def test_chunk_larger_than_the_pool_can_allocate_is_refused_at_register(daemon: DaemonProcess,
                                                                       worker_for) -> None:
    assert CONTIGUOUS < BIG_CHUNK < POOL_BYTES
    small = worker_for(daemon.url, seed=1)
    hashes = block_hashes(list(range(2 * CHUNK)))
    small.submit_store_request("s", LoadStoreOp([0, 1, 2, 3], block_hashes=hashes), None)
    wait_done(small, "s", retrieve=False)
    big = LMCacheMPWorkerAdapter(daemon.url, None, "m-big", 1, 0, BLOCK)
    try:
        with pytest.raises(ServerError) as info:
            big.register_kv_caches(make_caches([4, BIG_HEADS, BLOCK, 64], torch.bfloat16, LAYERS, seed=2),
                                   "CPU_ATTN")
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert str(BIG_CHUNK) in info.value.message and str(CONTIGUOUS) in info.value.message
        # Nothing else broke: the other worker is registered and stores, the daemon answers.
        assert status(daemon.url).registered_instances == [small.instance_id]
        more = block_hashes(list(range(1000, 1000 + 2 * CHUNK)))
        small.submit_store_request("s2", LoadStoreOp([4, 5, 6, 7], block_hashes=more), None)
        wait_done(small, "s2", retrieve=False)
        assert status(daemon.url).objects == 4
    finally:
        big.shutdown()
