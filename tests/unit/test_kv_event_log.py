"""The KV event log, its resyncs and its publisher, in process, over real ZeroMQ sockets: a log that
overran its publisher counts what was lost and resyncs once, however many records the resync
holds (its slices wait for the publisher; live writers never wait); replay is bounded in bytes, and
a replay peer that never reads holds up no other."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import zmq

from lmcache_mp.kv_events.log import STORED, EventBatch, EventLog
from lmcache_mp.kv_events.publisher import BATCH_OVERHEAD_BYTES, END_SEQ, EventPublisher, KeptBatches
from lmcache_mp.kv_events.resync import Pass, Resync

FINGERPRINT = b"f" * 16


def replay_all(url: str, start: int = 0) -> list[EventBatch]:
    """Every batch the publisher kept from `start`, by its replay protocol."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(url)
    batches = []
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append(msgspec.msgpack.decode(payload, type=EventBatch))
    finally:
        dealer.close(linger=0)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.01)


@contextmanager
def publishing(log: EventLog, on_missed: Callable[[], None] | None = None
               ) -> Iterator[tuple[EventPublisher, str]]:
    directory = Path(tempfile.mkdtemp(prefix="lmc-ev-", dir="/tmp"))
    pub, replay = f"ipc://{directory / 'ev'}", f"ipc://{directory / 'ev.replay'}"
    publisher = EventPublisher(log, pub, replay, on_missed=on_missed)
    try:
        yield publisher, replay
    finally:
        publisher.close()
        shutil.rmtree(directory, ignore_errors=True)


def key(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(32, "big"), FINGERPRINT


def test_the_ring_keeps_the_newest_and_says_what_a_reader_missed() -> None:
    log = EventLog(capacity=8)
    for i in range(20):
        log.stored(0, (bytes([i]) * 32, b"f" * 16))
    got = log.read(0, 100)  # seq 0 (the opening clear) to 20: only the last 8 are kept
    assert (got.first_seq, got.missed, got.next_seq) == (13, True, 21)
    assert [record[2][0] for record in got.records] == list(range(12, 20))
    assert log.read(21, 5).records == [] and not log.read(21, 5).missed
    assert log.read(0, 1).records[0][0] == STORED


def test_a_resync_larger_than_the_ring_settles_after_one_pass() -> None:
    """The publisher starts behind a full ring (it lost records): it skips to the log's end and
    asks for one resync, whose 20x-the-ring announcements wait for it slice by slice; the stream
    is then exactly AllBlocksCleared and every chunk held, nothing lost twice. (Resuming from the
    oldest record kept, each pass overran the ring again: a resync loop that never ended.)"""
    log = EventLog(capacity=256)
    held = [key(i) for i in range(5120)]

    def announce(resync: Pass) -> None:
        for piece in resync.slices(held):
            for k in piece:
                log.stored(0, k)

    for i in range(1000):  # all of it before the publisher reads
        log.stored(0, key(10_000 + i))
    resync = Resync(log, [("source", announce)], first=[])
    try:
        with publishing(log, on_missed=resync.request) as (publisher, replay):
            def settled() -> bool:
                c = publisher.counters()
                return (not resync.counters()["resyncing"]
                        and c["events_total"] + c["dropped_total"] == log.end)

            wait_until(lambda: resync.counters()["resyncs_total"] == 1 and settled(), "settled")
            assert publisher.counters()["dropped_total"] == 1001  # the opening clear and the 1000
            events = [event for batch in replay_all(replay) for event in batch.events]
            assert type(events[0]).__name__ == "AllBlocksCleared"
            assert [e.block_hashes[0] for e in events[1:]] == [int.from_bytes(k[0][-8:], "big") for k in held]
            assert resync.counters() == {"resyncs_total": 1, "resyncing": 0}
    finally:
        resync.close()


def test_requests_during_a_pass_restart_it_and_close_abandons_it() -> None:
    """Twenty requests during a pass cost one more pass, not twenty; a pass waiting for a
    publisher that stopped reading ends at close."""
    log = EventLog(capacity=256)
    held = [key(i) for i in range(2000)]
    passes: list[int] = []
    hold_first = threading.Event()

    def announce(resync: Pass) -> None:
        passes.append(log.end)
        hold_first.wait(30)
        for piece in resync.slices(held):
            for k in piece:
                log.stored(0, k)

    resync = Resync(log, [("source", announce)], first=[])
    try:
        with publishing(log, on_missed=resync.request) as (publisher, replay):
            resync.request()
            wait_until(lambda: len(passes) == 1, "the first pass started")
            for _ in range(19):
                resync.request()
            hold_first.set()
            wait_until(lambda: not resync.counters()["resyncing"]
                       and publisher.counters()["events_total"] == log.end, "the resyncs done and published")
            assert len(passes) == 2 and resync.counters() == {"resyncs_total": 1, "resyncing": 0}
            assert publisher.counters()["dropped_total"] == 0
            events = [type(event).__name__ for batch in replay_all(replay) for event in batch.events]
            # The opening clear and one per request, then the second pass whole: the first was
            # abandoned before its first slice.
            assert events == ["AllBlocksCleared"] * 21 + ["BlockStored"] * 2000
        log.pace_by(0)  # as if a publisher stood at 0 and never read again: the next pass waits
        resync.request()
        wait_until(lambda: len(passes) == 3, "the third pass started")
        assert resync.counters()["resyncing"] == 1
        started = time.monotonic()
    finally:
        resync.close()
    assert time.monotonic() - started < 5
    assert resync.counters() == {"resyncs_total": 1, "resyncing": 0}


def test_replay_is_bounded_in_bytes_and_a_peer_that_never_reads_holds_up_no_other() -> None:
    kept = KeptBatches(limit_bytes=10 * (1000 + BATCH_OVERHEAD_BYTES))
    for seq in range(50):
        kept.add(seq, bytes(1000))
    assert (kept.first, kept.end, kept.nbytes) == (40, 50, 10 * (1000 + BATCH_OVERHEAD_BYTES))

    log = EventLog(capacity=1 << 16)
    with publishing(log) as (publisher, replay):
        for i in range(20_000):
            log.stored(0, key(i))
        wait_until(lambda: publisher.counters()["events_total"] == log.end, "published")
        context = zmq.Context.instance()
        stuck = context.socket(zmq.DEALER)  # asks, never reads
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.connect(replay)
        try:
            stuck.send_multipart([b"", (0).to_bytes(8, "big")])
            wait_until(lambda: publisher.counters()["replays_total"] == 1, "the stuck peer's request taken")
            batches = replay_all(replay)
            assert sum(len(b.events) for b in batches) == log.end
        finally:
            stuck.close(linger=0)
