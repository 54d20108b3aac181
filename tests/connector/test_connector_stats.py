"""What the worker half records for vLLM's metrics (`vllm_adapter/stats.py`), against the real
daemon, driven step by step as in test_connector_logic: the chunks a STORE copied (not those the
daemon held already), a load, and a load that failed."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.launcher import DaemonProcess
from tests.connector.test_connector_logic import DAEMON_ARGS, clear_all
from tests.support.connector_helpers import Blocks, Worker, match, request, step, store_prompt
from vllm_adapter.connector_common import ConnectorSettings, LMCacheMPConnectorMetadata
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.ops import LoadStoreOp
from vllm_adapter.stats import LMCacheMPConnectorStats

# The stand-in worker's caches (bfloat16): one block, every layer.
BLOCK_BYTES = LAYERS * math.prod(SHAPE[1:]) * 2


def taken(worker: Worker) -> LMCacheMPConnectorStats:
    stats = worker.side.take_stats()
    assert stats is not None
    return stats


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_the_worker_records_stores_loads_and_failed_loads(daemon: DaemonProcess) -> None:
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode="async")
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    worker = Worker(settings, seed=1, block_bytes=[BLOCK_BYTES])
    try:
        tokens = list(range(2 * CHUNK + 1))
        tables = {"w": list(range(5)), "again": list(range(5)), "r": list(range(20, 25)),
                  "gone": list(range(30, 35))}
        store_prompt(scheduler, worker, request("w", tokens), tables)
        ((stored, stored_bytes, seconds),) = taken(worker).stores
        assert (stored, stored_bytes) == (2 * CHUNK, 4 * BLOCK_BYTES) and seconds > 0

        # The same chunks again: the daemon holds them, copies nothing, and nothing is recorded.
        again = LoadStoreOp(tables["w"][:4], block_hashes=block_hashes(tokens)[:4])
        worker.run(LMCacheMPConnectorMetadata(stores={"again": again}), finished={"again"})
        worker.wait_reported("sent", "again")
        assert worker.side.take_stats() is None

        reader = request("r", tokens)
        assert match(scheduler, reader) == (2 * CHUNK, True)
        scheduler.update_state_after_alloc(reader, Blocks(tables["r"][:4]), 2 * CHUNK)
        worker.run(scheduler.build_connector_meta(step(tables)))
        worker.wait_reported("received", "r")
        stats = taken(worker)
        assert [load[:2] for load in stats.loads] == [(2 * CHUNK, 4 * BLOCK_BYTES)]
        assert stats.failed_load_tokens == [] and stats.stores == []

        gone = request("gone", tokens)
        assert match(scheduler, gone) == (2 * CHUNK, True)
        scheduler.update_state_after_alloc(gone, Blocks(tables["gone"][:4]), 2 * CHUNK)
        raw = MessageQueueClient(daemon.url)
        try:  # the chunks vanish between the lookup and the load
            for request_id in ("w", "r", "gone"):
                raw.submit(RequestType.END_SESSION, [request_id]).result(10)
            assert clear_all(raw) == 2
        finally:
            raw.close()
        worker.run(scheduler.build_connector_meta(step(tables)))
        worker.wait_reported("failed", "gone")
        stats = taken(worker)
        assert stats.failed_load_tokens == [2 * CHUNK] and stats.loads == []
        assert stats.reduce()["failed_loads"] == 1
    finally:
        worker.side.shutdown()
        scheduler.shutdown()
