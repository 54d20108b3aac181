"""The daemon answers at once while its pool's memory is prepared in the background; real daemons.

A pool of 6 GiB takes several seconds to prepare on the test machine (a 24 GiB VM); the daemon
must answer PING, HELLO and STATUS meanwhile, give STOREs a typed answer (NO_SPACE where no
prepared memory is free), store and serve exact bytes once ready, and stop promptly on SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lmcache_mp.config import available_memory_bytes
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ChunkOutcome, RequestType, StatusReport
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.probes import scrape
from lmcache_mp.testing.servers import command
from tests.support.helpers import chunk_hashes, count_lookup, run_worker, status, store

BIG_POOL_GB = 6
# Answers while the pool is prepared: the preparing thread must never hold the socket thread
# (a madvise holding the GIL did, for seconds).
MAX_ROUND_TRIP_S = 0.5


needs_memory = pytest.mark.skipif((available_memory_bytes() or 0) / 2**30 < BIG_POOL_GB + 4,
                                  reason=f"needs {BIG_POOL_GB + 4} GiB of available memory")


def _big_daemon(daemons, *args: str) -> DaemonProcess:
    return daemons("--chunk-size", str(CHUNK), "--l1-size-gb", str(BIG_POOL_GB), *args, pool_ready=False)


def _wait_ready(url: str, timeout: float = 240) -> StatusReport:
    deadline = time.monotonic() + timeout
    while not (report := status(url)).pool_ready:
        assert time.monotonic() < deadline, f"pool not ready in {timeout} s: {report}"
        time.sleep(0.1)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_memory
def test_daemon_answers_while_its_pool_is_prepared(daemons) -> None:
    port = _free_port()
    daemon = _big_daemon(daemons, "--metrics-port", str(port))
    answered_s = time.monotonic() - daemon.started_at  # start_daemon returned on HELLO
    first = status(daemon.url)
    assert not first.pool_ready and first.pool_ready_bytes < first.pool_bytes == BIG_POOL_GB * 2**30
    assert scrape(port)["lmcache_mp_pool_ready_bytes"] < BIG_POOL_GB * 2**30
    cli = subprocess.run([*command(), "status", "--url", daemon.url], capture_output=True, text=True,
                         timeout=60)
    # Its pool line says how much is prepared (or, should it have finished meanwhile, "ready").
    assert cli.returncode == 0 and ("prepared so far" in cli.stdout or "; ready" in cli.stdout), \
        cli.stdout + cli.stderr

    client = MessageQueueClient(daemon.url)
    try:
        slowest, nonce = 0.0, 0
        while not status(daemon.url).pool_ready:
            nonce += 1
            sent = time.monotonic()
            assert client.submit(RequestType.PING, [nonce]).result(10) == nonce
            slowest = max(slowest, time.monotonic() - sent)
            time.sleep(0.02)
    finally:
        client.close()
    ready_s = time.monotonic() - daemon.started_at
    assert nonce > 0 and slowest < MAX_ROUND_TRIP_S, (nonce, slowest)
    assert answered_s < ready_s
    ready = status(daemon.url)
    assert ready.pool_ready_bytes == ready.pool_bytes
    assert scrape(port)["lmcache_mp_pool_ready_bytes"] == BIG_POOL_GB * 2**30
    log = daemon.log()
    # Serving ("ready" with its endpoints) was logged before the pool was; progress in between.
    assert log.index("ready (node-local)") < log.index("pool ready:")
    assert "GiB prepared (" in log


@needs_memory
def test_store_before_the_pool_is_ready_gets_a_typed_answer_then_bytes_are_exact(
        daemons, worker_for, short_tmp: Path) -> None:
    daemon = _big_daemon(daemons)
    worker = worker_for(daemon.url)  # CPU_ATTN caches from seed 1, registered
    client = worker.mq_client
    tokens = list(range(4 * CHUNK))
    hashes = chunk_hashes(tokens)
    early = store(client, worker.instance_id, hashes, "early")
    # STORED where prepared memory was free, else NO_SPACE; a STORE reserves under one lock, so
    # what was stored is a leading run, and exactly that is found.
    assert all(outcome in (ChunkOutcome.STORED, ChunkOutcome.NO_SPACE) for outcome in early)
    leading = next((i for i, outcome in enumerate(early) if outcome != ChunkOutcome.STORED), len(early))
    assert early[leading:] == [ChunkOutcome.NO_SPACE] * (len(early) - leading)
    assert count_lookup(client, hashes) == leading

    _wait_ready(daemon.url)
    again = store(client, worker.instance_id, hashes, "after")
    assert all(outcome in (ChunkOutcome.STORED, ChunkOutcome.ALREADY_PRESENT) for outcome in again)
    assert count_lookup(client, hashes) == len(hashes)

    # Another process retrieves into other blocks: the bytes the worker stored, early or not.
    out = short_tmp / "pages.pt"
    reader_blocks = list(range(32, 32 + len(block_hashes(tokens))))
    run_worker({"url": daemon.url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
                "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": "m",
                "block_ids": reader_blocks, "request_id": "reader", "out": str(out),
                "block_hashes": [h.hex() for h in block_hashes(tokens)]})
    got = torch.load(out)
    assert got["hit"] == len(tokens) and got["failed"] == []
    expected = pages(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN", SHAPE,
                     list(range(len(block_hashes(tokens)))))
    assert torch.equal(got["pages"].view(torch.uint8), expected.view(torch.uint8))


@needs_memory
def test_sigterm_while_the_pool_is_prepared_stops_promptly(daemons) -> None:
    daemon = _big_daemon(daemons)
    assert not status(daemon.url).pool_ready
    sent = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=30) == 0
    took = time.monotonic() - sent
    # Promptly: it did not wait for the pool to be prepared (on a busy machine a stop may take
    # seconds of its own, so the time alone cannot tell).
    assert took < 5 or "pool ready:" not in daemon.log(), (took, daemon.log())
    assert "stopped" in daemon.log()
