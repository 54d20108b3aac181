"""Prometheus metrics: every series present from the start, each one moves, and the Grafana
dashboard in examples/ queries only series a live daemon exports."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from lmcache_mp.observability.http import DEFAULT_MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from lmcache_mp.observability.http import MetricsHTTPServer
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, wait_done
from lmcache_mp.testing.launcher import free_port, start_daemon
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import lookup
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp


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


def _threads_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = re.search(r"^Threads:\s+(\d+)$", status, re.M)
    assert threads, status
    return int(threads.group(1)), len(os.listdir(f"/proc/{pid}/fd"))


def _closed_by_server(sock: socket.socket) -> bool:
    """Without blocking: has the server closed `sock` (end of stream or reset)?"""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _wait_until_closed(socks: list[socket.socket], at_least: int, timeout_s: float) -> int:
    """How many of `socks` the server has closed, once `at_least` or the deadline is reached."""
    deadline = time.monotonic() + timeout_s
    while (closed := sum(map(_closed_by_server, socks))) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return closed


def test_idle_metrics_connections_cost_no_thread_and_time_out(short_tmp: Path) -> None:
    # Each idle connection to prometheus_client's server pinned a thread and a descriptor, with no
    # timeout: enough of them (from anyone who can reach --metrics-host) exhausted the daemon.
    port = free_port()
    daemon = start_daemon(short_tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
                          "--metrics-port", str(port))
    idle: list[socket.socket] = []
    try:
        scrape(port)
        threads_before, fds_before = _threads_and_fds(daemon.proc.pid)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
        # The server keeps at most 16 open: it must have closed the rest of them.
        closed = _wait_until_closed(idle, at_least=200 - METRICS_MAX_CONNECTIONS, timeout_s=15)
        threads, fds = _threads_and_fds(daemon.proc.pid)
        assert threads <= threads_before + 2, (threads_before, threads)
        assert fds <= fds_before + METRICS_MAX_CONNECTIONS + 4, (fds_before, fds)
        assert closed >= 200 - METRICS_MAX_CONNECTIONS, closed
        assert scrape(port)["lmcache_mp_pool_capacity_bytes"] > 0  # a scrape is served all the same
        # And the idle ones still open are closed by the server once their time is up (10 s).
        assert _wait_until_closed(idle, at_least=200, timeout_s=30) == 200
    finally:
        for sock in idle:
            sock.close()
        assert daemon.stop() == 0


def _exchange(port: int, request: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send one raw request; the reply's status line, headers and body (read to the server's close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}
    return status, headers, body


def test_metrics_server_replies_and_bounds() -> None:
    registry = CollectorRegistry()
    Counter("demo_events", "events", registry=registry).inc(3)
    server = MetricsHTTPServer("127.0.0.1", 0, registry, max_connections=2, timeout_s=30)
    quick = MetricsHTTPServer("127.0.0.1", 0, registry, timeout_s=0.5)
    server.start()
    quick.start()
    port = server.address[1]
    try:
        assert server._listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        status, headers, body = _exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == "HTTP/1.1 200 OK" and headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
        assert b"demo_events_total 3.0" in body and int(headers["content-length"]) == len(body)
        # As Prometheus asks: OpenMetrics, gzipped (what prometheus_client's own server gave it).
        status, headers, body = _exchange(port, b"GET /metrics?x=1 HTTP/1.1\r\nAccept-Encoding: gzip\r\n"
                                                b"Accept: application/openmetrics-text;version=1.0.0\r\n\r\n")
        assert headers["content-type"].startswith("application/openmetrics-text") and \
            headers["content-encoding"] == "gzip"
        assert gzip.decompress(body).endswith(b"# EOF\n")
        status, headers, body = _exchange(port, b"HEAD /metrics HTTP/1.0\n\n")
        assert status == "HTTP/1.1 200 OK" and body == b"" and int(headers["content-length"]) > 0
        assert _exchange(port, b"GET / HTTP/1.1\r\n\r\n")[0] == "HTTP/1.1 404 Not Found"
        assert _exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n")[0] == "HTTP/1.1 405 Method Not Allowed"
        assert _exchange(port, b"nonsense\r\n\r\n")[0] == "HTTP/1.1 400 Bad Request"

        # Full: a newcomer closes the oldest connection, not itself (nor the other one, within its
        # 30 s).
        oldest, second = (socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2))
        with oldest, second:
            assert _exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")[0] == "HTTP/1.1 200 OK"
            assert oldest.recv(1) == b""  # closed by the server (10 s socket timeout: the deadline)
            assert not _closed_by_server(second)
        # A peer trickling a request that never ends is closed at its deadline all the same.
        with socket.create_connection(("127.0.0.1", quick.address[1]), timeout=10) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            deadline = time.monotonic() + 10
            while not _closed_by_server(slow):
                assert time.monotonic() < deadline, "a trickling request kept its connection open"
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    slow.sendall(b"a")
                time.sleep(0.05)
    finally:
        server.close()
        quick.close()
    assert not server._thread.is_alive() and not quick._thread.is_alive()


DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "lmcache-mp.json"


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
