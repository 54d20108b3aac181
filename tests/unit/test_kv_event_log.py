"""The KV event log and its publisher, in process, over real ZeroMQ sockets: a log that overran
its publisher counts what was lost and asks for a resync, never blocking a writer."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from lmcache_mp.kv_events import CLEARED, STORED, EventBatch, EventLog
from lmcache_mp.kv_events_publisher import END_SEQ, EventPublisher


def replay_all(url: str) -> list[EventBatch]:
    """Every batch the publisher kept, by its replay protocol."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(url)
    batches = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append(msgspec.msgpack.decode(payload, type=EventBatch))
    finally:
        dealer.close(linger=0)


def test_the_ring_keeps_the_newest_and_says_what_a_reader_missed() -> None:
    log = EventLog(capacity=8)
    for i in range(20):
        log.stored(0, (bytes([i]) * 32, b"f" * 16))
    got = log.read(0, 100)  # seq 0 (the opening clear) to 20: only the last 8 are kept
    assert (got.first_seq, got.missed, got.next_seq) == (13, True, 21)
    assert [record[2][0] for record in got.records] == list(range(12, 20))
    assert log.read(21, 5).records == [] and not log.read(21, 5).missed
    assert log.read(0, 1).records[0][0] == STORED


def test_an_overrun_publisher_counts_the_loss_and_resyncs() -> None:
    log = EventLog(capacity=16)
    for i in range(100):  # all of it before the publisher reads: it can only see the last 16
        log.stored(0, (bytes([i]) * 32, b"f" * 16))
    resyncs: list[int] = []

    def resync() -> None:
        resyncs.append(log.end)
        log.cleared()

    directory = Path(tempfile.mkdtemp(prefix="lmc-ev-", dir="/tmp"))
    pub, replay = f"ipc://{directory / 'ev'}", f"ipc://{directory / 'ev.replay'}"
    publisher = EventPublisher(log, pub, replay, on_missed=resync)
    try:
        deadline = time.monotonic() + 30
        while publisher.counters()["events_total"] < 17:  # the 16 kept, then the resync's clear
            assert time.monotonic() < deadline, publisher.counters()
            time.sleep(0.01)
        assert publisher.counters()["dropped_total"] == 101 - 16
        assert len(resyncs) == 1
        events = [event for batch in replay_all(replay) for event in batch.events]
        assert len(events) == 17 and type(events[-1]).__name__ == "AllBlocksCleared"
        assert log.read(log.end - 1, 1).records[0][0] == CLEARED
    finally:
        publisher.close()
        shutil.rmtree(directory, ignore_errors=True)
