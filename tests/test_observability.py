"""Prometheus metrics: every series present from the start, and each one moves."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import torch

from lmcache_mp.launcher import start_daemon
from tests.helpers import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, block_hashes, lookup
from tests.kv_worker import make_caches, wait_done
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(lmcache_mp_[^\s]+)\s+([-+0-9.eE]+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def test_metrics_endpoint_counts_the_data_path(short_tmp: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon(short_tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
                          "--metrics-port", str(port))
    try:
        before = scrape(port)
        assert before['lmcache_mp_requests_total{status="OK",type="STORE"}'] == 0
        assert before['lmcache_mp_lookup_chunks_total{result="hit"}'] == 0
        assert before["lmcache_mp_pool_objects"] == 0 and before["lmcache_mp_pool_capacity_bytes"] > 0
        worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
        try:
            worker.register_kv_caches(make_caches([NUM_BLOCKS, 2, BLOCK, 64], torch.bfloat16, LAYERS, 1),
                                      "CPU_ATTN")
            hashes = block_hashes(list(range(3 * CHUNK)))
            worker.submit_store_request("s", LoadStoreOp(list(range(6)), block_hashes=hashes), None)
            wait_done(worker, "s", retrieve=False)
            assert lookup(scheduler, "r", block_hashes=hashes + block_hashes(list(range(9)))) == 3 * CHUNK
            assert lookup(scheduler, "x", block_hashes=block_hashes(list(range(1, 2 * CHUNK + 1)))) == 0
            worker.submit_retrieve_request("r", LoadStoreOp(list(range(10, 16)), block_hashes=hashes), None)
            wait_done(worker, "r", retrieve=True)
            after = scrape(port)
        finally:
            worker.shutdown()
            scheduler.shutdown()
        assert after['lmcache_mp_requests_total{status="OK",type="STORE"}'] == 1
        assert after['lmcache_mp_store_chunks_total{outcome="stored"}'] == 3
        assert after['lmcache_mp_lookup_chunks_total{result="hit"}'] == 3
        assert after['lmcache_mp_lookup_chunks_total{result="miss"}'] == 2
        assert after['lmcache_mp_retrieve_chunks_total{result="loaded"}'] == 3
        chunk_bytes = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2
        assert after['lmcache_mp_copied_bytes_total{direction="store"}'] == 3 * chunk_bytes
        assert after['lmcache_mp_copied_bytes_total{direction="retrieve"}'] == 3 * chunk_bytes
        assert after['lmcache_mp_request_seconds_count{type="LOOKUP_CHUNKS"}'] == 2  # the scheduler's
        assert after["lmcache_mp_pool_objects"] == 3
        assert after["lmcache_mp_registered_instances"] == 1
    finally:
        assert daemon.stop() == 0
