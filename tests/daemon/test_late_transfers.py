"""Late transfers: a RETRIEVE still running after its client gave up must never write into blocks
that vLLM has reused, nor a STORE publish what they hold by then (defect 7). A worker whose RETRIEVE timed out
reports the load failed (freeing its blocks) only once the daemon has answered CANCEL_TRANSFERS
or is gone. Real daemons, real workers."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine import cancellation
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, RequestType, RetrieveResult
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.probes import freeze
from tests.support.helpers import count_lookup, lease, refusal, status, store, wait_for_status
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp, fences

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
TIMEOUT_S = 0.5  # the worker's request timeout: short, so that loads time out while the daemon is stopped
CHUNKS = 3
HASHES = block_hashes(list(range(CHUNKS * CHUNK)))  # one per block
CHUNK_HASHES = HASHES[CHUNK // BLOCK - 1::CHUNK // BLOCK]  # one per chunk, as the worker keys them
SOURCE = list(range(CHUNKS * CHUNK // BLOCK))  # blocks the chunks are stored from
TARGET = [b + 20 for b in SOURCE]  # blocks they are loaded into
SENTINEL = -3.0


@pytest.fixture
def stored(daemons: Callable) -> Iterator[tuple[DaemonProcess, LMCacheMPWorkerAdapter]]:
    """A daemon holding CHUNKS chunks stored from a worker (timeout TIMEOUT_S) whose TARGET blocks
    hold SENTINEL; the chunks are leased to request "r"."""
    daemon: DaemonProcess = daemons(*DAEMON_ARGS)
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, timeout_s=TIMEOUT_S)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        store(worker.mq_client, worker.instance_id, CHUNK_HASHES, "s")
        for cache in worker.kv_caches.values():
            cache[TARGET] = SENTINEL
        assert lease(worker.mq_client, CHUNK_HASHES, "r") == CHUNKS
        yield daemon, worker
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)  # a frozen daemon would never answer the shutdown
        worker.shutdown()
        assert "Traceback" not in daemon.log(), daemon.log()


def target_pages(worker: LMCacheMPWorkerAdapter, blocks: list[int] = TARGET) -> torch.Tensor:
    return torch.stack([cache[blocks].clone() for cache in worker.kv_caches.values()])


def loaded(worker: LMCacheMPWorkerAdapter) -> bool:
    return torch.equal(target_pages(worker), target_pages(worker, SOURCE))


def poll_load(worker: LMCacheMPWorkerAdapter, request_id: str, seconds: float) -> dict[str, list[int]] | None:
    """Poll `get_finished` for up to `seconds`: the failed loads once `request_id` is reported."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, loads = worker.get_finished(set())
        if request_id in loads:
            return worker.take_failed_retrieves()
        assert worker.take_failed_retrieves() == {}, "a load was reported failed but not finished"
        time.sleep(0.01)
    return None


def assert_stays(worker: LMCacheMPWorkerAdapter, pages: torch.Tensor, seconds: float = 1.0) -> None:
    """Nothing writes into the target blocks any more."""
    time.sleep(seconds)
    assert torch.equal(target_pages(worker), pages), "the daemon wrote into them after the load was reported"


def test_a_timed_out_load_is_held_until_the_daemon_confirms(stored) -> None:
    daemon, worker = stored
    freeze(daemon.proc)  # the RETRIEVE below waits, unread, for the daemon: it will run when it resumes
    worker.submit_retrieve_request("r", LoadStoreOp(TARGET, block_hashes=HASHES), None)
    # Long past the timeout, the daemon stopped: the blocks must not be handed back to vLLM.
    assert poll_load(worker, "r", 4 * TIMEOUT_S) is None, "reported while the daemon could still write"

    daemon.proc.send_signal(signal.SIGCONT)
    failed = poll_load(worker, "r", 10)
    assert failed == {"r": TARGET}  # cancelled (or done, but never answered in time): vLLM recomputes
    assert_stays(worker, target_pages(worker))
    report = status(daemon.url)
    assert report.leases == 0 and report.cancelled_transfers == 1


class StandInEvent:
    """Stands in for a `torch.cuda.Event(interprocess=True)` on this GPU-less machine: the worker
    sends its IPC handle (b'', "no event", which a CPU cache accepts) and must keep it alive."""

    def ipc_handle(self) -> bytes:
        return b""


def test_a_loads_cuda_event_lives_until_the_daemon_is_done_with_it(stored) -> None:
    """The daemon opens a load's event when it runs the load, which may be after the worker's
    timeout: the worker keeps the event until the load is answered or its cancel confirmed."""
    daemon, worker = stored
    freeze(daemon.proc)
    event = StandInEvent()
    alive = weakref.ref(event)
    worker.submit_retrieve_request("r", LoadStoreOp(TARGET, block_hashes=HASHES), event)  # type: ignore[arg-type]
    del event
    gc.collect()
    assert poll_load(worker, "r", 4 * TIMEOUT_S) is None
    assert alive() is not None, "dropped while the daemon could still open it"
    daemon.proc.send_signal(signal.SIGCONT)
    assert poll_load(worker, "r", 10) is not None
    gc.collect()
    assert alive() is None, "kept after the daemon confirmed"


def test_a_timed_out_sync_load_returns_once_the_daemon_confirms(stored) -> None:
    daemon, worker = stored
    freeze(daemon.proc)
    returned: list[dict[str, list[int]]] = []
    loader = threading.Thread(target=lambda: returned.append(
        worker.retrieve_now(["r"], [LoadStoreOp(TARGET, block_hashes=HASHES)], TIMEOUT_S)))
    loader.start()
    loader.join(4 * TIMEOUT_S)
    assert not returned, "the sync load returned while the daemon could still write"
    daemon.proc.send_signal(signal.SIGCONT)
    loader.join(10)
    assert returned == [{"r": TARGET}]
    assert_stays(worker, target_pages(worker))


def test_a_load_held_for_a_daemon_that_dies_is_released(stored, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    daemon, worker = stored
    monkeypatch.setattr(fences, "FENCE_ERROR_AFTER_S", 2 * TIMEOUT_S)
    caplog.set_level(logging.WARNING, logger=fences.__name__)
    freeze(daemon.proc)
    worker.submit_retrieve_request("r", LoadStoreOp(TARGET, block_hashes=HASHES), None)
    assert poll_load(worker, "r", 6 * TIMEOUT_S) is None
    daemon.stop(signal.SIGKILL)  # the stopped daemon is gone without ever confirming
    assert poll_load(worker, "r", 5) == {"r": TARGET}
    assert torch.all(target_pages(worker) == SENTINEL)
    # One WARNING when the load was held, one ERROR once it was held too long; no more.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(warnings) == 1 and "did not answer a load of request r " in warnings[0], warnings
    assert len(errors) == 1 and "load of request r is still held" in errors[0], errors


def test_an_answered_load_is_reported_at_once(stored) -> None:
    """No fence without a timeout: a load the daemon answered is reported as before."""
    _, worker = stored
    worker.submit_retrieve_request("r", LoadStoreOp(TARGET, block_hashes=HASHES), None)
    assert poll_load(worker, "r", 5) == {}
    assert loaded(worker)


# ---- the request itself --------------------------------------------------------------------


def cancel(client: MessageQueueClient, instance_id: int, request_ids: list[str]) -> int:
    return client.submit(RequestType.CANCEL_TRANSFERS, [instance_id, request_ids]).result(10)


def test_only_its_own_connection_cancels_or_unregisters_an_instance(stored) -> None:
    """Another client can neither cancel a worker's transfers (a flood of its
    cancels once evicted the worker's confirmed one) nor unregister it."""
    daemon, worker = stored
    other = MessageQueueClient(daemon.url)
    try:
        iid = worker.instance_id
        assert refusal(other, RequestType.CANCEL_TRANSFERS, [iid, ["r"]]).code is ErrorCode.FORBIDDEN
        assert refusal(other, RequestType.UNREGISTER_KV_CACHE, [iid]).code is ErrorCode.FORBIDDEN
        assert status(daemon.url).registered_instances == [iid]
        assert status(daemon.url).cancelled_transfers == 0
        # An instance not registered has nothing left to start: a CANCEL for it records nothing.
        assert cancel(other, iid + 1, [f"r{i}" for i in range(2000)]) == 0
        assert status(daemon.url).cancelled_transfers == 0
        # Its own worker may: the record keeps it.
        assert cancel(worker.mq_client, iid, ["r"]) == 0
        assert status(daemon.url).cancelled_transfers == 1
    finally:
        other.close()


PER_INSTANCE = cancellation.DEFAULT_MAX_CANCELLED_PER_INSTANCE


def test_a_full_cancelled_record_refuses_new_cancels_and_forgets_none(daemons: Callable) -> None:
    daemon: DaemonProcess = daemons(*DAEMON_ARGS, "--queue-deadline-s", "0.5")
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        client, iid = worker.mq_client, worker.instance_id
        # One request is capped by bytes before it is decoded...
        flood = [f"cmpl-{i:032x}-0" for i in range(70_000)]
        assert refusal(client, RequestType.CANCEL_TRANSFERS, [iid, flood]).code is ErrorCode.BAD_PAYLOAD
        # ...and the record per instance: full, it refuses new pairs and keeps the old ones.
        for start in range(0, PER_INSTANCE, 4096):
            assert cancel(client, iid, flood[start:min(start + 4096, PER_INSTANCE)]) == 0
        assert refusal(client, RequestType.CANCEL_TRANSFERS, [iid, ["one-more"]]).code is ErrorCode.OVERLOADED
        assert cancel(client, iid, flood[:2]) == 0  # sent again: nothing new to keep
        assert status(daemon.url).cancelled_transfers == PER_INSTANCE
        # Kept for twice the queue deadline plus a second (no operation sent before a CANCEL can
        # start later), then forgotten, which makes room again.
        wait_for_status(daemon.url, lambda r: r.cancelled_transfers == 0, "the record expired")
        assert cancel(client, iid, ["one-more"]) == 0
    finally:
        worker.shutdown()


BIG_BLOCKS = 4096  # a cache whose half is 2048 chunks: tens of ms of copying


@pytest.fixture
def big_worker(daemons: Callable, request: pytest.FixtureRequest
               ) -> Iterator[tuple[DaemonProcess, LMCacheMPWorkerAdapter, list[bytes]]]:
    """A worker with a BIG_BLOCKS cache (its daemon has one worker thread, or as many as the test's
    parameter says); chunk hashes for half of it."""
    workers = getattr(request, "param", 1)  # one, or two: RETRIEVEs are split
    daemon: DaemonProcess = daemons(*DAEMON_ARGS, "--max-workers", str(workers))
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches([BIG_BLOCKS, 2, BLOCK, 64], torch.bfloat16, LAYERS, seed=1),
                                  "CPU_ATTN")
        hashes = block_hashes(list(range(BIG_BLOCKS // 2 * BLOCK)))[CHUNK // BLOCK - 1::CHUNK // BLOCK]
        yield daemon, worker, hashes
        assert status(daemon.url).transfers_running == 0
    finally:
        worker.shutdown()


def keys_of(hashes: list[bytes], request_id: str) -> list[IPCCacheEngineKey]:
    return [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=request_id) for h in hashes]


def test_cancel_refuses_what_was_sent_before_it_and_nothing_after(daemons: Callable, tmp_path: Path) -> None:
    """A RETRIEVE and a STORE queued (not started) when the CANCEL arrives are refused, and the
    RETRIEVE's leases are spent; a RETRIEVE and a STORE of the same request sent after the
    CANCEL (vLLM storing what it recomputed) run as usual, and so do other requests.

    They are queued for sure: a RETRIEVE and a STORE of another request hold each lane's one worker
    thread mid-copy (`tests/support/gated_daemon.py`), and the CANCEL is answered while they still do: it
    waits for nothing that is not its requests'."""
    gated = [sys.executable, "-m", "tests.support.gated_daemon", str(tmp_path)]
    daemon: DaemonProcess = daemons(*DAEMON_ARGS, "--max-workers", "1", command_prefix=gated)
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        client, iid = worker.mq_client, worker.instance_id
        bpc = CHUNK // BLOCK
        assert store(client, iid, CHUNK_HASHES, "s") == [ChunkOutcome.STORED] * CHUNKS
        one_chunk = TARGET[:bpc]
        fresh = block_hashes(list(range(10**6, 10**6 + CHUNK)))[bpc - 1::bpc]  # not stored yet
        others = block_hashes(list(range(10**7, 10**7 + CHUNK)))[bpc - 1::bpc]
        assert lease(client, CHUNK_HASHES[:1], "r") == 1 and status(daemon.url).leases == 1

        for lane in ("load", "store"):
            (tmp_path / lane).touch()
        busy = keys_of(CHUNK_HASHES, "busy-load")
        busy_load = client.submit(RequestType.RETRIEVE, [busy, iid, TARGET, b""])
        busy_store = client.submit(RequestType.STORE, [keys_of(others, "busy-store"), iid, SOURCE[:bpc], b""])
        # Two requests copying (the fence counts requests, hence two request ids).
        wait_for_status(daemon.url, lambda r: r.transfers_running == 2, "both lanes copying")
        # Sent on the same connection, so they reach the daemon before the CANCEL, and queue.
        load = client.submit(RequestType.RETRIEVE, [keys_of(CHUNK_HASHES[:1], "r"), iid, one_chunk, b""])
        save = client.submit(RequestType.STORE, [keys_of(fresh, "r"), iid, list(range(bpc)), b""])
        assert cancel(client, iid, ["r", "never-seen"]) == 0  # nothing of them copying
        assert not busy_load.query() and not busy_store.query()
        for lane in ("load", "store"):
            (tmp_path / lane).unlink()
        assert busy_load.result(10).ok
        assert busy_store.result(10).outcomes == [ChunkOutcome.STORED]
        result: RetrieveResult = load.result(10)
        assert not result.ok and result.reason == "cancelled"
        assert save.wait(10)
        error = save.exception()
        assert isinstance(error, ServerError) and error.code is ErrorCode.CANCELLED, error
        assert status(daemon.url).leases == 0
        assert count_lookup(client, fresh) == 0

        # Sent after the CANCEL: carried out.
        assert client.submit(RequestType.STORE, [keys_of(fresh, "r"), iid, list(range(bpc)), b""]).result(10)
        assert count_lookup(client, fresh) == 1
        assert client.submit(RequestType.RETRIEVE, [keys_of(CHUNK_HASHES[:1], "r"), iid, one_chunk, b""]
                             ).result(10).ok
        # Only that instance: a CANCEL naming another instance leaves this one's requests alone.
        assert cancel(client, iid + 1, ["r2"]) == 0
        assert client.submit(RequestType.RETRIEVE, [keys_of(CHUNK_HASHES[:1], "r2"), iid, one_chunk, b""]
                             ).result(10).ok
        assert status(daemon.url).transfers_running == 0
    finally:
        worker.shutdown()


def cancel_while_copying(daemon: DaemonProcess, worker: LMCacheMPWorkerAdapter, request_type: RequestType,
                         hashes: list[bytes], blocks: list[int], before_each: Callable[[], None],
                         split: bool = False) -> tuple[MessagingFuture, torch.Tensor]:
    """Send `request_type` for `hashes` and cancel it while it copies (with `split`: once a
    helper thread copies too), retrying with a new request id until a CANCEL lands mid-copy
    (mostly the first time): its future and the blocks as they were when the CANCEL was answered."""
    client, iid = worker.mq_client, worker.instance_id
    for attempt in range(20):
        before_each()
        request_id = f"r{attempt}"
        helped = status(daemon.url).split_chunks
        op = client.submit(request_type, [keys_of(hashes, request_id), iid, blocks, b""])
        while not op.query():
            report = status(daemon.url)
            if report.transfers_running and (not split or report.split_chunks > helped):
                break
        stopped = cancel(client, iid, [request_id])
        pages = torch.stack([cache[blocks].clone() for cache in worker.kv_caches.values()])
        op.wait(10)
        if stopped:
            assert stopped == 1
            return op, pages
    raise AssertionError(f"no CANCEL came while a {request_type.name} ran")


@pytest.mark.parametrize(("big_worker", "split"), [(1, False), (2, True)], indirect=["big_worker"],
                         ids=["one-thread", "split"])
def test_cancel_stops_a_retrieve_that_is_copying(big_worker, split: bool) -> None:
    """A RETRIEVE of many chunks is cancelled while it copies (with two worker threads: while both
    threads copy it): the CANCEL is answered once every thread has stopped (between chunks), and
    nothing is written after that."""
    daemon, worker, hashes = big_worker
    assert ChunkOutcome.NO_SPACE not in store(worker.mq_client, worker.instance_id, hashes, "s")
    target = list(range(BIG_BLOCKS // 2, BIG_BLOCKS))

    def fill() -> None:
        for cache in worker.kv_caches.values():
            cache[target] = SENTINEL

    copy, pages = cancel_while_copying(daemon, worker, RequestType.RETRIEVE, hashes, target, fill, split)
    result: RetrieveResult = copy.result()
    assert not result.ok and result.reason == "cancelled"
    time.sleep(0.2)
    assert torch.equal(torch.stack([cache[target] for cache in worker.kv_caches.values()]), pages)
    assert bool(torch.any(pages == SENTINEL)), "the copy ran to its end"


def test_cancel_stops_a_store_and_publishes_nothing(big_worker) -> None:
    """A STORE cancelled while it copies stores nothing, not even the chunks it had copied: its
    blocks may hold another request's KV by then."""
    daemon, worker, hashes = big_worker
    client = worker.mq_client
    source = list(range(BIG_BLOCKS // 2))
    copy, _ = cancel_while_copying(daemon, worker, RequestType.STORE, hashes, source, lambda: None)
    error = copy.exception()
    assert isinstance(error, ServerError) and error.code is ErrorCode.CANCELLED, error
    assert count_lookup(client, hashes) == 0  # not even the chunks copied before the CANCEL
    assert status(daemon.url).objects == 0  # and their slots were freed
