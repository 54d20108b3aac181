"""Copy threads (`transfer/threads.CopyThreads`): one RETRIEVE's chunk copies split over the
daemon's idle copy threads, bounded by seats, with errors and the request's context carried over.

In process, with real threads. Where a split must be seen, each thread's first copy waits at a
barrier until the expected number of threads have started one (an event, not a sleep); a barrier
that times out (10 s) breaks and fails the test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmcache_mp.engine.dispatch import ARRIVAL
from lmcache_mp.transfer.threads import CopyThreads
from tests.support.helpers import Recorder


@contextmanager
def copy_threads(n: int) -> Iterator[CopyThreads]:
    threads = CopyThreads(n)
    try:
        yield threads
    finally:
        threads.close()


@pytest.mark.parametrize(("n", "split"), [(1, True), (4, False)])
def test_without_split_or_helpers_the_calling_thread_copies_everything(n: int, split: bool) -> None:
    with copy_threads(n) as threads, threads.seat():
        record = Recorder()
        threads.run(10, record, split=split)
    assert list(record.by_thread) == [threading.get_ident()]
    assert record.by_thread[threading.get_ident()] == list(range(10))  # in order, each once
    assert threads.helped_chunks == 0


def test_a_split_spreads_the_chunks_over_every_free_thread() -> None:
    with copy_threads(3) as threads, threads.seat():
        record = Recorder(meet=3)
        threads.run(30, record, split=True)
    assert len(record.by_thread) == 3
    assert record.chunks() == list(range(30))  # each chunk exactly once
    assert threads.helped_chunks == record.helped() > 0


def test_helped_chunks_add_up_over_runs() -> None:
    with copy_threads(2) as threads:
        total = 0
        for _ in range(3):
            with threads.seat():
                record = Recorder(meet=2)
                threads.run(6, record, split=True)
            total += record.helped()
            assert threads.helped_chunks == total
    assert total >= 3  # each run's helper copied at least its first chunk


def test_nothing_to_split_with_nothing_to_run() -> None:
    with copy_threads(2) as threads, threads.seat():
        calls: list[int] = []
        threads.run(0, lambda i: calls.append(i) is None, split=True)
        threads.run(1, lambda i: calls.append(i) is None, split=True)  # one chunk: no helper wanted
    assert calls == [0] and threads.helped_chunks == 0


def test_helpers_take_only_the_seats_left() -> None:
    """Three seats, one held by another operation: this RETRIEVE gets one helper, not two; once
    that operation and the helpers are done, every seat is free again."""
    with copy_threads(3) as threads:
        with threads.seat(), threads.seat():
            record = Recorder(meet=2)
            threads.run(12, record, split=True)
        assert len(record.by_thread) == 2 and record.chunks() == list(range(12))
        with threads.seat():
            record = Recorder(meet=3)  # breaks (and fails) if a seat was not handed back
            threads.run(12, record, split=True)
        assert len(record.by_thread) == 3


def test_a_seat_is_counted_never_waited_for() -> None:
    """More seats taken than threads (a RETRIEVE on the load lane beside STOREs): the operation's own
    thread still copies, at once, and takes no helper."""
    with copy_threads(2) as threads, threads.seat(), threads.seat(), threads.seat():
        record = Recorder()
        threads.run(5, record, split=True)
    assert list(record.by_thread) == [threading.get_ident()] and record.chunks() == list(range(5))


def test_a_copy_that_says_stop_ends_the_hand_out() -> None:
    with copy_threads(1) as threads, threads.seat():
        record = Recorder(copy=lambda i: i != 3)
        threads.run(10, record, split=True)  # returns normally: a cancel is not an error
    assert record.chunks() == [0, 1, 2, 3]


def test_a_split_stopped_on_one_thread_stops_the_other() -> None:
    """The helper's first chunk says stop; the calling thread, whose first chunk completes after
    that, takes at most one more (the one it may take between the helper's False and the stop
    being applied), not the 48 left."""
    stopped = threading.Event()
    caller = threading.get_ident()

    def then(i: int) -> bool:
        if threading.get_ident() != caller:
            stopped.set()
            return False
        assert stopped.wait(10)  # the caller's first chunk completes only after the stop
        return True

    with copy_threads(2) as threads, threads.seat():
        record = Recorder(meet=2, copy=then)
        threads.run(50, record, split=True)
    assert len(record.by_thread) == 2 and len(record.chunks()) <= 3
    assert [len(done) for tid, done in record.by_thread.items() if tid != caller] == [1]


def test_run_returns_only_once_every_started_copy_is_complete() -> None:
    caller = threading.get_ident()
    done: list[int] = []
    caller_finished = threading.Event()

    def then(i: int) -> bool:
        if threading.get_ident() == caller:
            caller_finished.set()
        else:
            assert caller_finished.wait(10)  # the helper's copy outlasts the caller's
            done.append(i)
        return True

    with copy_threads(2) as threads, threads.seat():
        record = Recorder(meet=2, copy=then)
        threads.run(2, record, split=True)
        helped = [i for tid, chunks in record.by_thread.items() if tid != caller for i in chunks]
        assert done == helped == [1 - record.by_thread[caller][0]]


def test_an_error_on_the_calling_thread_is_raised() -> None:
    def then(i: int) -> bool:
        if i == 2:
            raise RuntimeError("chunk 2 failed")
        return True

    with copy_threads(1) as threads, threads.seat():
        record = Recorder(copy=then)
        with pytest.raises(RuntimeError, match="chunk 2 failed"):
            threads.run(10, record, split=True)
    assert record.chunks() == [0, 1, 2]  # no chunk starts after the failure


def test_a_helpers_error_is_raised_on_the_calling_thread_and_frees_its_seat() -> None:
    caller = threading.get_ident()

    def then(i: int) -> bool:
        if threading.get_ident() != caller:
            raise OSError(f"helper failed on chunk {i}")
        return True

    with copy_threads(2) as threads:
        with threads.seat(), pytest.raises(OSError, match="helper failed on chunk"):
            threads.run(20, Recorder(meet=2, copy=then), split=True)
        with threads.seat():
            record = Recorder(meet=2)
            threads.run(4, record, split=True)
        assert len(record.by_thread) == 2


def test_helpers_run_in_the_requests_context() -> None:
    """The fence reads the request's arrival order on whichever thread copies its chunks."""
    token = ARRIVAL.set(42)
    try:
        with copy_threads(3) as threads, threads.seat():
            record = Recorder(meet=3)
            threads.run(9, record, split=True)
    finally:
        ARRIVAL.reset(token)
    assert len(record.arrivals) == 3 and set(record.arrivals.values()) == {42}
    with copy_threads(2) as threads, threads.seat():  # and a later request's helpers see its own
        record = Recorder(meet=2)
        threads.run(4, record, split=True)
    assert set(record.arrivals.values()) == {0}
