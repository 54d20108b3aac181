"""The load lane: a load never queues behind a store (issue 26, review F7). vLLM's forward pass waits for a
RETRIEVE, while a STORE may copy a long prefill's chunks for tens of milliseconds: the daemon runs
RETRIEVEs on a lane of their own (server.py; on a GPU also their own staging buffer and stream,
transfer/context.py). Real daemon, real worker adapter, real shared memory."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.launcher import DaemonProcess
from lmcache_mp.mq import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import ChunkOutcome, RequestType
from tests.helpers import block_hashes, wait_for_status
from tests.kv_worker import make_caches
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

BLOCK, CHUNK = 16, 512
BPC = CHUNK // BLOCK  # blocks per chunk
LAYERS = 16
SHAPE = [2 * BPC, 8, BLOCK, 256]  # 64 KiB pages: a chunk is 16 layers x 32 pages, 32 MiB
STORE_CHUNKS = 64  # 2 GiB: 80 ms of copying on the test VM, against 2 ms for the one-chunk load


def _chunk_hashes(first_token: int, chunks: int) -> list[bytes]:
    """The hashes the worker keys `chunks` chunks by, of tokens from `first_token` on."""
    return block_hashes(list(range(first_token, first_token + chunks * CHUNK)))[BPC - 1::BPC]


def _store(worker: LMCacheMPWorkerAdapter, hashes: list[bytes], request_id: str,
           blocks: list[int]) -> MessagingFuture:
    """A STORE of one chunk per hash, chunk i from blocks[i * BPC:(i + 1) * BPC]."""
    keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=request_id) for h in hashes]
    return worker.mq_client.submit(RequestType.STORE, [keys, worker.instance_id, blocks, b""])


def _until_copying(client: MessageQueueClient, store: MessagingFuture) -> bool:
    """Whether the daemon was seen copying `store` (it counts it among its transfers, and has not
    answered it): STATUS asked back to back, until then or until the STORE is answered."""
    deadline = time.monotonic() + 30
    while not store.query():
        assert time.monotonic() < deadline, "the STORE was neither answered nor seen copying"
        if client.submit(RequestType.STATUS, []).result(10).transfers_running:
            return not store.query()
    return False


def test_a_retrieve_sent_while_a_long_store_copies_finishes_first(daemons: Callable) -> None:
    """A RETRIEVE sent while a 64-chunk STORE of the same worker copies is answered before the
    STORE is. The daemon has one worker thread (`--max-workers 1`): before loads had a lane of
    their own, the RETRIEVE waited in that thread's queue until the STORE was done."""
    daemon: DaemonProcess = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", "2.2", "--max-workers", "1")
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    status = MessageQueueClient(daemon.url)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        wait_for_status(daemon.url, lambda r: r.pool_ready, "the pool prepared")  # room for 2 GiB
        source, target = list(range(BPC)), list(range(BPC, 2 * BPC))
        hashes = block_hashes(list(range(CHUNK)))  # the loaded chunk's, one per block
        for attempt in range(5):
            status.submit(RequestType.CLEAR, []).result(30)  # room for the long STORE, none evicted
            first = _store(worker, hashes[BPC - 1::BPC], "first", source)
            assert first.result(10).outcomes == [ChunkOutcome.STORED]
            # Every chunk copied from the same blocks: the worker's cache stays small.
            fresh = _chunk_hashes((attempt + 1) * 10**7, STORE_CHUNKS)
            store = _store(worker, fresh, f"long{attempt}", source * STORE_CHUNKS)
            if not _until_copying(status, store):  # answered before a STATUS saw it: try again
                continue
            failed = worker.retrieve_now(["load"], [LoadStoreOp(target, block_hashes=hashes)], timeout_s=30)
            store_open = not store.query()
            assert failed == {}
            assert store_open, "the RETRIEVE was answered only after the STORE it was sent behind"
            assert store.result(30).outcomes == [ChunkOutcome.STORED] * STORE_CHUNKS
            break
        else:
            raise AssertionError("no STORE was seen copying in 5 attempts")
        for layer in worker.kv_caches.values():
            assert torch.equal(layer[target], layer[source])
    finally:
        status.close()
        worker.shutdown()
    assert "Traceback" not in daemon.log(), daemon.log()
