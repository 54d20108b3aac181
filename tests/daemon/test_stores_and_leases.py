"""Stores that do not land at once, and leases a request will not spend; real daemons.

A worker retries a store's chunks that found no space, and holds the stores made while the
daemon is away until it is back, reporting the request finished only once its chunks landed
(or were given up, within bounds). RELEASE_LEASES drops the pins on chunks a request will not
retrieve. The scheduler's hit path: hits on every rank leased, END_SESSION releasing
them, and its failure logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.probes import freeze
from tests.support.helpers import chunk_hashes, count_lookup, lease, lookup, status, store, wait_for_leases
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

# A pool of a few dozen chunks (16 KiB each), quick to fill with pinned ones.
DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0005")
BLOCKS_PER_CHUNK = CHUNK // BLOCK


def store_op(tokens: list[int], first_block: int = 0) -> LoadStoreOp:
    """A vLLM-like store of the full chunks of `tokens`, from consecutive blocks."""
    hashes = block_hashes(tokens)
    return LoadStoreOp(list(range(first_block, first_block + len(hashes))), block_hashes=hashes)


def finished_within(worker: LMCacheMPWorkerAdapter, request_id: str, seconds: float) -> bool:
    """Whether the worker reports `request_id` (finished by vLLM) as done storing in time."""
    deadline = time.monotonic() + seconds
    while True:
        if request_id in worker.get_finished({request_id})[0]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def fill_with_pinned_chunks(client: MessageQueueClient, instance_id: int, request_id: str) -> int:
    """Store chunks and lease each to `request_id` until the pool has no room left; returns
    how many are pinned."""
    pinned = 0
    for i in range(1000):
        hashes = chunk_hashes([10**6 + i * 100 + t for t in range(CHUNK)])
        if store(client, instance_id, hashes, "filler") == [ChunkOutcome.NO_SPACE]:
            return pinned
        pinned += lease(client, hashes, request_id)
    raise AssertionError("the pool never filled up")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_store_that_found_no_space_is_retried_once_space_frees(daemon: DaemonProcess, worker_for) -> None:
    worker = worker_for(daemon.url)
    client = worker.mq_client
    pinned = fill_with_pinned_chunks(client, worker.instance_id, "pins")
    assert pinned > 0 and status(daemon.url).leases == pinned

    tokens = list(range(2 * CHUNK))
    worker.submit_store_request("r", store_op(tokens), None)
    # While every chunk is pinned the store cannot land: vLLM must keep the blocks.
    assert not finished_within(worker, "r", 0.5)
    hashes = chunk_hashes(tokens)
    assert count_lookup(client, hashes) == 0

    client.submit(RequestType.END_SESSION, ["pins"]).result(10)
    assert finished_within(worker, "r", 10)
    assert count_lookup(client, hashes) == 2  # landed before the request was reported


def test_store_made_while_the_daemon_restarts_lands_once_it_is_back(daemons) -> None:
    first: DaemonProcess = daemons(*DAEMON_ARGS)
    worker = LMCacheMPWorkerAdapter(first.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        assert first.stop() == 0
        tokens = list(range(500, 500 + 2 * CHUNK))
        worker.submit_store_request("r", store_op(tokens), None)
        assert not finished_within(worker, "r", 0.3)  # held, not dropped

        second: DaemonProcess = daemons(*DAEMON_ARGS, url=first.url)
        assert finished_within(worker, "r", 15)
        client = MessageQueueClient(second.url)
        try:
            hashes = chunk_hashes(tokens)
            assert count_lookup(client, hashes) == 2
        finally:
            client.close()
    finally:
        worker.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_store_that_timed_out_is_sent_again(daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A frozen daemon: the STORE times out on the client (0.5 s), and is sent again until the
    daemon answers; the request is reported only then, and nothing is given up."""
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, timeout_s=0.5, store_retry_s=10)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        caplog.set_level(logging.WARNING, logger="vllm_adapter.worker_adapter")
        tokens = list(range(900, 900 + 2 * CHUNK))
        freeze(daemon.proc)
        try:
            worker.submit_store_request("r", store_op(tokens), None)
            assert not finished_within(worker, "r", 1.2)  # timed out at least once meanwhile
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert finished_within(worker, "r", 10)
        client = MessageQueueClient(daemon.url)
        try:
            assert count_lookup(client, chunk_hashes(tokens)) == 2
        finally:
            client.close()
        assert not [r for r in caplog.records if "gave up" in r.getMessage()]
    finally:
        worker.shutdown()


def test_held_stores_are_bounded_in_number_and_age(daemons, caplog: pytest.LogCaptureFixture) -> None:
    daemon: DaemonProcess = daemons(*DAEMON_ARGS)
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, store_retry_s=1.0, max_held_stores=2)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        assert daemon.stop() == 0
        caplog.set_level(logging.WARNING, logger="vllm_adapter.worker_adapter")
        started = time.monotonic()
        for i, rid in enumerate(("a", "b", "c")):
            worker.submit_store_request(rid, store_op(list(range(i * 1000, i * 1000 + 2 * CHUNK))), None)
        reported_at: dict[str, float] = {}  # vLLM finished all three: when each was reported
        finished = {"a", "b", "c"}
        while len(reported_at) < 3 and time.monotonic() - started < 5:
            reported_at.update((rid, time.monotonic() - started) for rid in worker.get_finished(finished)[0])
            finished = set()  # vLLM names a finished request once
            time.sleep(0.01)
        # Three held, two allowed: the oldest is given up at once, the others at their age.
        assert reported_at["a"] < 0.5
        assert 1.0 <= reported_at["b"] < 3 and 1.0 <= reported_at["c"] < 3
        gave_up = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
        assert len(gave_up) == 3, gave_up
        assert "request a" in gave_up[0] and "2 chunk(s) not stored" in gave_up[0]
        assert "too many stores held" in gave_up[0]
        assert all("not stored within 1 s" in m for m in gave_up[1:])
    finally:
        worker.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_release_leases_drops_only_the_named_chunks(daemon: DaemonProcess, worker_for) -> None:
    worker = worker_for(daemon.url)
    client = worker.mq_client
    hashes = chunk_hashes(list(range(4 * CHUNK)))
    assert store(client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 4
    assert lease(client, hashes, "r") == 4

    def release(request_id: str, chunks: list[bytes]) -> None:
        keys = [IPCCacheEngineKey("m", 1, None, chunk_hash=h, request_id=request_id) for h in chunks]
        assert client.submit(RequestType.RELEASE_LEASES, [keys]).result(10) is None

    release("other", hashes)  # another request's: untouched
    assert status(daemon.url).leases == 4
    release("r", hashes[:2])
    assert status(daemon.url).leases == 2
    release("r", hashes[:2])  # released already: nothing more
    assert status(daemon.url).leases == 2
    client.submit(RequestType.END_SESSION, ["r"]).result(10)
    assert status(daemon.url).leases == 0


@contextlib.contextmanager
def ranks_holding(url: str, world_size: int, hashes: list[bytes]) -> Iterator[None]:
    """`world_size` worker processes, registered as the ranks of model "m", each with the chunks
    of `hashes` (vLLM block hashes, from block 0 on) stored, holding their registrations: the
    setup of `scripts/bench/bench_control_plane.py`'s hit rotation."""
    procs = []
    try:
        for rank in range(world_size):
            spec = {"url": url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
                    "num_layers": LAYERS, "block_size": BLOCK, "action": "store_and_hold", "model": "m",
                    "world_size": world_size, "rank": rank, "seed": rank,
                    "block_ids": list(range(len(hashes))), "block_hashes": [h.hex() for h in hashes]}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "lmcache_mp.testing.kv_worker", json.dumps(spec)],
                stdout=subprocess.PIPE, text=True))
            assert procs[-1].stdout is not None
            assert procs[-1].stdout.readline().startswith("READY"), f"rank {rank} did not come up"
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


@pytest.mark.daemon_args("--chunk-size", str(CHUNK))
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_benchmark_hits_lease_every_rank_and_end_session_releases_them(
        daemon: DaemonProcess, world_size: int) -> None:
    """The control-plane benchmark's hit scenario (ranks registered in other processes, their chunks
    stored, the scheduler adapter looking up and ending sessions) hits every chunk on every rank,
    leases each, and END_SESSION, fire and forget, releases them all; a miss leases nothing.
    The scheduler sends nothing after its END_SESSION: the client's flusher sends it."""
    hashes = block_hashes(list(range(NUM_BLOCKS * BLOCK)))
    chunks = len(hashes) // BLOCKS_PER_CHUNK
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", world_size, 0, BLOCK)
    try:
        with ranks_holding(daemon.url, world_size, hashes):
            for request_id, prefix in (("all", chunks), ("part", chunks // 4)):
                hit = lookup(scheduler, request_id, block_hashes=hashes[:prefix * BLOCKS_PER_CHUNK])
                assert hit == prefix * CHUNK
                wait_for_leases(daemon.url, 1, prefix * world_size)
                scheduler.end_session(request_id)
                wait_for_leases(daemon.url, 0, 0)
            other = block_hashes([10**6 + t for t in range(4 * CHUNK)])
            assert lookup(scheduler, "miss", block_hashes=other) == 0
            assert status(daemon.url).leases == 0
    finally:
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_failed_end_session_is_logged(daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    """END_SESSION is fire and forget, but its failure is not silent: the scheduler adapter logs
    it (the request's leases then last until the daemon's TTL)."""
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK, timeout_s=0.3)
    try:
        freeze(daemon.proc)
        scheduler.end_session("r1")
        time.sleep(0.5)
        scheduler.maybe_submit_lookup_request("r2", block_hashes=block_hashes(list(range(CHUNK))))
        with caplog.at_level(logging.WARNING, logger="vllm_adapter.scheduler_adapter"):
            deadline = time.monotonic() + 5
            while "END_SESSION for request r1 failed" not in caplog.text:
                assert time.monotonic() < deadline, "the failed END_SESSION went unnoticed"
                scheduler.check_lookup_result("r2")
                time.sleep(0.01)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        scheduler.shutdown()
    status(daemon.url)  # running again before the fixture stops it (a SIGTERM racing the SIGCONT is lost)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_lookup_chunks_answers_and_leases_as_lookup_does(daemon: DaemonProcess, worker_for) -> None:
    """LOOKUP_CHUNKS, the scheduler adapter's compact LOOKUP of hash keys: the same prefix, the same
    leases, the same refusal of keys that name nothing."""
    worker = worker_for(daemon.url)
    client = worker.mq_client
    hashes = chunk_hashes(list(range(4 * CHUNK)))
    assert store(client, worker.instance_id, hashes[:3], "s") == [ChunkOutcome.STORED] * 3
    keys = [IPCCacheEngineKey("m", 1, None, chunk_hash=h, request_id="a") for h in hashes]
    assert client.submit(RequestType.LOOKUP, [keys]).result(10) == 3
    assert client.submit(RequestType.LOOKUP_CHUNKS, ["m", 1, "b", hashes]).result(10) == 3
    assert (status(daemon.url).sessions, status(daemon.url).leases) == (2, 6)
    assert client.submit(RequestType.LOOKUP_CHUNKS, ["m", 2, "c", hashes]).result(10) == 0  # no rank 1
    assert client.submit(RequestType.LOOKUP_CHUNKS, ["other", 1, "c", hashes]).result(10) == 0
    assert client.submit(RequestType.LOOKUP_CHUNKS, ["m", 1, None, hashes]).result(10) == 3  # leases nothing
    with pytest.raises(ServerError) as refused:
        client.submit(RequestType.LOOKUP_CHUNKS, ["m", 1, "d", [hashes[0], b""]]).result(10)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT
    for request_id in ("a", "b"):
        client.submit(RequestType.END_SESSION, [request_id]).result(10)
    assert (status(daemon.url).sessions, status(daemon.url).leases) == (0, 0)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_lookups_leases_are_in_place_before_the_next_request_is_read(daemon: DaemonProcess,
                                                                        worker_for) -> None:
    """A LOOKUP is answered before its leases are recorded (dispatch.ReplyThen), but the daemon
    records them before it reads another request: a STATUS or an END_SESSION sent right behind
    the LOOKUP, without waiting for its reply, finds them."""
    worker = worker_for(daemon.url)
    client = worker.mq_client
    hashes = chunk_hashes(list(range(3 * CHUNK)))
    assert store(client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 3
    for n in range(20):
        looked_up = client.submit(RequestType.LOOKUP_CHUNKS, ["m", 1, f"r{n}", hashes])
        report = client.submit(RequestType.STATUS, [])
        ended = client.submit(RequestType.END_SESSION, [f"r{n}"])
        assert looked_up.result(10) == 3
        assert (report.result(10).sessions, report.result(10).leases) == (1, 3)
        ended.result(10)
    assert (status(daemon.url).sessions, status(daemon.url).leases) == (0, 0)
