"""The scheduler half's `reset_cache` (vLLM's `reset_prefix_cache(reset_connector=True)`), driven
without an engine against a real daemon: the model's chunks leave the daemon, a request waiting with
a lookup answered before asks again, a store a worker holds for another try is given up, and a daemon
that cannot confirm makes it False, logged.
The same on a real engine: tests/vllm/test_vllm_reset.py."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.protocol import ChunkOutcome, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.connector_helpers import Worker, match, request, step, until
from tests.support.helpers import chunk_hashes, count_lookup, status, store
from vllm_adapter import LMCacheMPWorkerAdapter
from vllm_adapter.connector_common import ConnectorSettings
from vllm_adapter.connector_scheduler import SchedulerSide

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_reset_cache_drops_the_models_chunks_and_is_false_without_the_daemon(
        daemon: DaemonProcess, worker_for, caplog: pytest.LogCaptureFixture) -> None:
    tokens = [random.Random(3).randrange(1000) for _ in range(2 * CHUNK + 5)]
    worker = worker_for(daemon.url)  # model "m"
    other = LMCacheMPWorkerAdapter(daemon.url, None, "other", 1, 0, BLOCK)
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, timeout_s=2.0, load_mode="async")
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    try:
        other.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=2), "CPU_ATTN")
        hashes = chunk_hashes(tokens)
        assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 2
        other_keys = [IPCCacheEngineKey("other", 1, 0, chunk_hash=h, request_id="o") for h in hashes]
        stored = other.mq_client.submit(RequestType.STORE, [other_keys, other.instance_id,
                                                            list(range(2 * CHUNK // BLOCK)), b""])
        assert stored.result(10).outcomes == [ChunkOutcome.STORED] * 2
        waiting = request("w", tokens)
        assert match(scheduler, waiting) == (2 * CHUNK, True)  # answered, not loaded yet

        with caplog.at_level(logging.INFO, logger="vllm_adapter"):
            assert scheduler.reset_cache() is True
        assert "2 chunks dropped from the daemon's pool" in caplog.text
        assert count_lookup(worker.mq_client, hashes) == 0 and status(daemon.url).objects == 2  # other's
        assert match(scheduler, waiting) == (0, False)  # asked again, not the answer from before

        assert daemon.stop() == 0
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="vllm_adapter"):
            assert scheduler.reset_cache() is False
        assert "the daemon did not confirm it" in caplog.text
    finally:
        scheduler.shutdown()
        other.shutdown()


def test_a_store_held_across_a_reset_is_given_up_not_sent_with_the_old_kv(daemons) -> None:
    """A worker holds a store while the daemon is away; the daemon returns and the model is reset
    (its weights changed): the held store's KV was computed before, so it must never land."""
    first = daemons(*DAEMON_ARGS)
    settings = ConnectorSettings(url=first.url, reconnect_interval_s=0.3, timeout_s=60.0, load_mode="async")
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    worker = Worker(settings, seed=1)  # holds its store up to `timeout_s`: the daemon's restart is shorter
    try:
        tokens = list(range(700, 700 + 2 * CHUNK + 1))
        tables = {"h": list(range(5))}
        req = request("h", tokens)
        assert match(scheduler, req) == (0, False)
        prefill = scheduler.build_connector_meta(step(tables, new=((req, 0, len(tokens)),)))
        assert list(prefill.stores) == ["h"]
        assert first.stop() == 0
        worker.run(prefill)  # held: the daemon is away
        assert scheduler.request_finished(req) is True
        second = daemons(*DAEMON_ARGS, url=first.url)
        until(scheduler.reset_cache)  # True once the scheduler is connected again
        finished = {"h"}

        def store_settled() -> bool:
            worker.run(scheduler.build_connector_meta(step(tables)), finished)
            finished.clear()
            return "h" in worker.reported["sent"]

        until(store_settled)
        assert status(second.url).objects == 0
        assert match(scheduler, request("again", tokens)) == (0, False)
    finally:
        worker.side.shutdown()
        scheduler.shutdown()
