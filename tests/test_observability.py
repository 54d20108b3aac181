"""Prometheus metrics: every series present from the start, each one moves, and the Grafana
dashboard in examples/ queries only series a live daemon exports."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_counts_the_data_path(short_tmp: Path) -> None:
    port = free_port()
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
            shown = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "status", "--url", daemon.url],
                                   capture_output=True, text=True, timeout=60).stdout
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
        # `lmcache-mp status`, as an operator reads it: the hit rate and the registered worker
        assert "lookups   5 chunks asked, 3 found: hit rate 60.0%" in shown, shown
        assert re.search(r"^  \d+ +m +0/1 +CPU_ATTN +2 +64 ", shown, re.M), shown
    finally:
        assert daemon.stop() == 0


DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "lmcache-mp.json"


def test_grafana_dashboard_queries_only_exported_series(short_tmp: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"lmcache_mp_[a-z0-9_]+", expr)}
    assert len(queried) >= 20, queried
    port = free_port()
    daemon = start_daemon(short_tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
                          "--metrics-port", str(port), "--l2", f"disk://{short_tmp}/disk?size_gb=0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert daemon.stop() == 0
    exported = set(re.findall(r"^(lmcache_mp_[a-z0-9_]+)", text, re.M))
    assert queried <= exported, f"the dashboard queries series no daemon exports: {queried - exported}"
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    rated = {name for expr in exprs for name in re.findall(r"rate\((lmcache_mp_[a-z0-9_]+)", expr)}
    for name in rated:  # rate() is meaningful only over counters (and histogram buckets)
        family = name.removesuffix("_total").removesuffix("_bucket")
        assert types.get(family, types.get(name)) in ("counter", "histogram"), (name, types.get(family))
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
