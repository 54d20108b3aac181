"""The load lane: a load never queues behind a store. vLLM's forward pass waits for a RETRIEVE,
while a STORE may copy a long prefill's chunks for tens of milliseconds: the daemon runs
RETRIEVEs on a lane of their own (server.py; on a GPU also their own staging buffer and stream,
transfer/context.py). Real daemon (its STORE held mid-copy at a gate: `tests/support/gated_daemon.py`),
real worker adapter, real shared memory."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.mq import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import ChunkOutcome, RequestType
from lmcache_mp.testing.blocks import block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import wait_for_status
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

BLOCK, CHUNK = 16, 64
BPC = CHUNK // BLOCK  # blocks per chunk
LAYERS = 2
SHAPE = [3 * BPC, 2, BLOCK, 64]


def _store(worker: LMCacheMPWorkerAdapter, tokens: list[int], request_id: str,
           blocks: list[int]) -> MessagingFuture:
    """A STORE of the chunks of `tokens`, chunk i from blocks[i * BPC:(i + 1) * BPC]."""
    keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=request_id)
            for h in block_hashes(tokens)[BPC - 1::BPC]]
    return worker.mq_client.submit(RequestType.STORE, [keys, worker.instance_id, blocks, b""])


def test_a_retrieve_sent_while_a_store_copies_finishes_first(daemons: Callable, tmp_path: Path) -> None:
    """A RETRIEVE sent while a STORE of the same worker is copying is answered while the STORE is
    still held mid-copy. The daemon has one worker thread (`--max-workers 1`): before loads had a
    lane of their own, the RETRIEVE waited in that thread's queue behind the STORE, here forever."""
    gate = tmp_path / "store"
    gated = [sys.executable, "-m", "tests.support.gated_daemon", str(tmp_path)]
    daemon: DaemonProcess = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--max-workers", "1",
                                    command_prefix=gated)
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    status = MessageQueueClient(daemon.url)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        source, target, other = list(range(BPC)), list(range(BPC, 2 * BPC)), list(range(2 * BPC, 3 * BPC))
        loaded = list(range(CHUNK))
        assert _store(worker, loaded, "first", source).result(10).outcomes == [ChunkOutcome.STORED]

        gate.touch()  # STOREs from now on wait mid-copy
        held = _store(worker, list(range(10**6, 10**6 + CHUNK)), "held", other)
        wait_for_status(daemon.url, lambda r: r.transfers_running > 0, "the STORE copying")
        failed = worker.retrieve_now(["load"], [LoadStoreOp(target, block_hashes=block_hashes(loaded))],
                                     timeout_s=30)
        assert failed == {}
        assert not held.query(), "the held STORE was answered before its gate opened"
        gate.unlink()
        assert held.result(30).outcomes == [ChunkOutcome.STORED]
        for layer in worker.kv_caches.values():
            assert torch.equal(layer[target], layer[source])
    finally:
        status.close()
        worker.shutdown()
    assert "Traceback" not in daemon.log(), daemon.log()
