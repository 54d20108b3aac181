"""A LOOKUP's cost is bounded by what is registered, not by what it claims. It named a world of
2^31 ranks (looped over, seconds to minutes on the socket thread that serves every client), it
tried every mix of the formats registered per rank (2 formats x 16 ranks: 720 ms per LOOKUP),
and the registry remembered an answer per (model, world size) ever asked. Real daemons and
adapters, except the memory check, which drives the registry in process.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.engine.registry import Registry
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.sockets import SocketAccess
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, wait_done
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import lookup
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
WORLD = 8
KINDS = ("CPU_ATTN", "FLASH_ATTN")  # two kinds of cache of one shape: two engines of one model
HASHES = block_hashes(list(range(2 * CHUNK)))  # two chunks
BLOCKS = list(range(len(HASHES)))


@pytest.fixture
def two_engines(daemon: DaemonProcess) -> Iterator[dict[tuple[str, int], LMCacheMPWorkerAdapter]]:
    """Every rank of a WORLD-rank model registered twice: once per kind of cache."""
    workers: dict[tuple[str, int], LMCacheMPWorkerAdapter] = {}
    try:
        for kind in KINDS:
            for rank in range(WORLD):
                worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", WORLD, rank, BLOCK)
                workers[kind, rank] = worker
                worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=rank), kind)
        yield workers
    finally:
        for worker in workers.values():
            worker.shutdown()


def store(worker: LMCacheMPWorkerAdapter, request_id: str) -> None:
    worker.submit_store_request(request_id, LoadStoreOp(BLOCKS, block_hashes=HASHES), None)
    wait_done(worker, request_id, retrieve=False)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_lookup_counts_chunks_one_engine_can_load_not_a_mix_of_engines(daemon: DaemonProcess,
                                                                          two_engines) -> None:
    """Stored by the first kind on half the ranks and the second kind on the others: no engine
    can load that, so it is no hit (every mix of formats used to be tried, and this one hit).
    Stored by one kind on every rank: a hit."""
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", WORLD, 0, BLOCK)
    try:
        for rank in range(WORLD):
            store(two_engines[KINDS[rank * 2 // WORLD], rank], f"mixed-{rank}")
        assert lookup(scheduler, "r1", block_hashes=HASHES) == 0
        for rank in range(WORLD // 2, WORLD):
            store(two_engines[KINDS[0], rank], f"first-kind-{rank}")
        assert lookup(scheduler, "r2", block_hashes=HASHES) == 2 * CHUNK
    finally:
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize("world_size", [4 << 20, 2**31 - 1])
def test_a_lookup_claiming_a_huge_world_is_answered_at_once(daemon: DaemonProcess, worker_for,
                                                            world_size: int) -> None:
    worker_for(daemon.url)  # rank 0 of a one-rank "m" is registered
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    try:
        client.handshake("tests")
        for model in ("m", "never-registered"):
            # A hang would be a timeout: the loop over 2^31 ranks took minutes and an OOM kill.
            lookup_chunks = [model, world_size, None, [b"h" * 32]]
            assert client.submit(RequestType.LOOKUP_CHUNKS, lookup_chunks).result(10) == 0
    finally:
        client.close()


def test_lookups_of_unknown_worlds_leave_nothing_behind(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "attach.sock", SocketAccess(), CHUNK, lambda nbytes: None)
    try:
        registry.format_combos("warm-up", 1)
        tracemalloc.start()
        try:
            for i in range(100_000):
                assert registry.format_combos(f"model-{i}", 1 + i % 8) == []
            grown, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert grown < 1 << 20, f"{grown} bytes kept after 100,000 lookups of unknown models"
    finally:
        registry.close()
