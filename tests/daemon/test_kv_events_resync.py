"""KV event resyncs against the real daemon: a resync larger than a batch, or than the
log's ring, settles once (the publisher skips to the log's end and the resync's slices wait for
it), leaves LOOKUP as fast as before and SIGTERM working; the publisher's memory stays bounded
with a subscriber and a replay peer that never read, while a reading subscriber's view stays
exact. The two triggers seen: a warm restart adopting a large pool with --kv-events-listen (no
client involved), and many CLEAR_TIERS at once on a large pool."""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import zmq

from lmcache_mp.kv_events.log import external_hash
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ChunkOutcome, RequestType, StatusReport
from lmcache_mp.testing.blocks import BLOCK, CHUNK, NUM_BLOCKS
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import count_lookup, fmt, status, store, wait_for_status
from tests.support.kv_event_subscriber import Subscriber

CHUNK_ARGS = ("--chunk-size", str(CHUNK))
CHUNKS_PER_STORE = NUM_BLOCKS * BLOCK // CHUNK  # the stand-in worker's whole cache, once
SETTLE_DEADLINE_S = 90.0
SIGTERM_DEADLINE_S = 20.0
LOOKUPS = 200
# The publisher's memory, at most (kv_events_publisher): 64 MiB of batches kept for replay, 256
# batches (~256 KiB at most each) queued for the stalled subscriber, 32 for the stalled replay
# peer; the rest of the margin for the allocator.
RSS_GROWTH_BOUND = 256 * 2**20
RESYNCS = 30  # of 20,000 chunks, ~4 MiB of batches each: twice what replay keeps


def events_args(tmp: Path) -> tuple[str, ...]:
    return ("--kv-events-listen", f"ipc://{tmp / 'kv-events.sock'}")


def fill(client: MessageQueueClient, instance_id: int, chunks: int) -> list[bytes]:
    """`chunks` new chunks stored, a whole cache per STORE; their hashes."""
    hashes = [os.urandom(32) for _ in range(chunks)]
    for start in range(0, chunks, CHUNKS_PER_STORE):
        outcomes = store(client, instance_id, hashes[start:start + CHUNKS_PER_STORE], f"fill-{start}")
        assert set(outcomes) == {ChunkOutcome.STORED}, outcomes
    return hashes


def settled(report: StatusReport) -> bool:
    """No resync asked for or running, and every record the log holds published or counted lost."""
    return (not report.kv_events_resyncing
            and report.kv_events_published_total + report.kv_events_dropped_total == report.kv_events_seq)


def lookup_p50_ms(client: MessageQueueClient, hashes: list[bytes]) -> float:
    times = []
    for i in range(LOOKUPS):
        start = time.perf_counter()
        assert count_lookup(client, [hashes[i % len(hashes)]]) == 1
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def held_by_subscriber(report: StatusReport, subscriber: Subscriber | None = None) -> set:
    """What a subscriber holds in the pool (`subscriber`'s live view, gaps filled by replay; a new
    one replaying from seq 0 if none)."""
    reader = subscriber or Subscriber(*report.kv_events_endpoints)
    try:
        reader.poll(0.2)
        reader.replay(reader.holdings.next_seq)
        assert reader.holdings.next_seq == report.kv_events_batches_total
        return set(reader.holdings.held[("CPU", None)])
    finally:
        if subscriber is None:
            reader.close()


def expected(hashes: list[bytes]) -> set:
    return {(external_hash(h), fmt().fingerprint.hex()) for h in hashes}


def stops_on_sigterm(daemon: DaemonProcess) -> None:
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=SIGTERM_DEADLINE_S) == 0
    assert time.monotonic() - started < SIGTERM_DEADLINE_S


def test_a_warm_restart_adopting_a_large_pool_settles(daemons, short_tmp: Path, worker_for) -> None:
    """8,000 chunks adopted and verified by a daemon whose log keeps 256 records: the publisher
    loses records while the verification announces them, and resyncs, each resync 30x the ring.
    Before, the publisher went on from the oldest record kept, and each pass overran it again, for
    ever (a core busy, ~46 lost-events warnings a second)."""
    args = (*CHUNK_ARGS, "--l1-size-gb", "0.2")
    first: DaemonProcess = daemons(*args)
    worker = worker_for(first.url)
    client = MessageQueueClient(first.url, request_timeout_s=30)
    client.handshake("tests")
    try:
        hashes = fill(client, worker.instance_id, 8000)
        wait_for_status(first.url, lambda r: r.pool_unsealed == 0, "every chunk sealed", daemon=first)
        before_ms = lookup_p50_ms(client, hashes)
    finally:
        client.close()
        worker.shutdown()
    assert first.stop(keep_pool=True) == 0
    again: DaemonProcess = daemons(*args, *events_args(short_tmp), "--kv-events-log-records", "256")
    report = wait_for_status(again.url, lambda r: r.pool_unverified == 0 and settled(r),
                             "the adopted chunks verified and the stream settled", SETTLE_DEADLINE_S, again)
    assert report.objects == 8000 and report.kv_events_dropped_total > 0  # lost, so resynced
    assert report.kv_events_resyncs_total >= 1
    assert held_by_subscriber(report) == expected(hashes)
    worker = worker_for(again.url)  # LOOKUP finds a model's chunks by the format its registration gives
    client = MessageQueueClient(again.url, request_timeout_s=30)
    client.handshake("tests")
    try:
        after_ms = lookup_p50_ms(client, hashes)
        assert after_ms < max(5 * before_ms, 5.0), (before_ms, after_ms)
        assert settled(status(again.url))
    finally:
        client.close()
        worker.shutdown()  # while its daemon runs: it unregisters at once
    stops_on_sigterm(again)


def test_many_clear_tiers_at_once_on_a_large_pool_settle(daemons, short_tmp: Path, worker_for) -> None:
    """20 CLEAR_TIERS at once with 20,000 chunks in the pool: before, 20 resyncs of 20,000 records
    overran the log's ring (262,144), and the resync that followed never ended: a core busy, LOOKUP
    p50 up to 40 ms, SIGTERM unheeded."""
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.4", *events_args(short_tmp))
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=60)
    client.handshake("tests")
    live = Subscriber(*status(daemon.url).kv_events_endpoints)
    try:
        hashes = fill(client, worker.instance_id, 20_000)
        wait_for_status(daemon.url, settled, "the stores published", SETTLE_DEADLINE_S, daemon)
        before_ms = lookup_p50_ms(client, hashes)
        clears = [client.submit(RequestType.CLEAR_TIERS, []) for _ in range(20)]
        for future in clears:
            assert future.result(60) == []
        report = wait_for_status(daemon.url, settled, "the resyncs done and published",
                                 SETTLE_DEADLINE_S, daemon)
        assert report.objects == 20_000 and report.kv_events_resyncs_total >= 1
        assert held_by_subscriber(report, live) == expected(hashes)
        after_ms = lookup_p50_ms(client, hashes)
        assert after_ms < max(5 * before_ms, 5.0), (before_ms, after_ms)
    finally:
        live.close()
        client.close()
        worker.shutdown()
    stops_on_sigterm(daemon)


def rss_bytes(daemon: DaemonProcess) -> int:
    """The daemon's resident memory that is its own: VmRSS less the pool file's pages (RssShmem),
    which the fill makes resident once and for all."""
    lines = Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines()
    kib = {name: int(value.split()[0]) for name, value in (line.split(":", 1) for line in lines)
           if name in ("VmRSS", "RssShmem")}
    return (kib["VmRSS"] - kib["RssShmem"]) * 1024


def test_subscribers_that_never_read_cost_bounded_memory(daemons, short_tmp: Path, worker_for) -> None:
    """RESYNCS resyncs of 20,000 chunks with a subscriber and a replay peer that never read, the
    peer asking again after each: the daemon's own memory grows by less than RSS_GROWTH_BOUND
    (before: replay kept 10,000 batches however large, ~8 GiB at the bound, and queued a copy of
    them for the peer, up to 1,000), and a subscriber that reads holds exactly the pool."""
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.4", *events_args(short_tmp))
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=60)
    client.handshake("tests")
    pub, replay = status(daemon.url).kv_events_endpoints
    context = zmq.Context()
    stalled = context.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(pub)
    asker = context.socket(zmq.DEALER)
    asker.setsockopt(zmq.RCVHWM, 1)
    asker.connect(replay)
    live = Subscriber(pub, replay)
    try:
        hashes = fill(client, worker.instance_id, 20_000)
        filled = wait_for_status(daemon.url, settled, "the stores published", SETTLE_DEADLINE_S, daemon)
        baseline = rss_bytes(daemon)
        peak = baseline
        for i in range(RESYNCS):
            assert client.submit(RequestType.CLEAR_TIERS, []).result(60) == []
            # Every batch since the fill (the resyncs' own), again and again.
            asker.send_multipart([b"", filled.kv_events_batches_total.to_bytes(8, "big")])
            report = wait_for_status(daemon.url, settled, f"resync {i} published", SETTLE_DEADLINE_S, daemon)
            live.poll(0)
            live.replay(live.holdings.next_seq)  # what it missed (the batches before it joined)
            peak = max(peak, rss_bytes(daemon))
        assert report.kv_events_resyncs_total >= 1 and report.kv_events_dropped_total == 0
        assert peak - baseline < RSS_GROWTH_BOUND, f"grew {(peak - baseline) / 2**20:.0f} MiB"
        assert held_by_subscriber(report, live) == expected(hashes)
    finally:
        live.close()
        stalled.close(linger=0)
        asker.close(linger=0)
        context.term()
        client.close()
        worker.shutdown()
    stops_on_sigterm(daemon)
