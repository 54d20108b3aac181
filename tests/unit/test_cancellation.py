"""The transfer fence (`cancellation.TransferFence`): which STOREs and RETRIEVEs are copying, which
a worker has cancelled, and in what order the server read them.

In process. Each call runs "as the request the server read n-th": `ARRIVAL` is set around it the
way the server sets it around a handler (set, call, reset), so every ordering below is exact.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from lmcache_mp.engine.cancellation import TransferFence
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode
from tests.support.helpers import arrived

A, B = 1, 2  # instance ids


def fence(**bounds: int) -> TransferFence:
    return TransferFence(queue_deadline_s=10, **bounds)


def overloaded(err: pytest.ExceptionInfo[ServerError], words: str) -> bool:
    return err.value.code is ErrorCode.OVERLOADED and words in err.value.message


def test_begin_and_end_count_the_pairs_copying() -> None:
    f = fence()
    with arrived(1):
        assert f.begin([(A, "r1"), (A, "r2"), (A, "r1")])  # a pair named twice is one pair
        assert f.begin([(A, "r1")])  # a second operation on the same request
    assert f.counts() == (2, 0)
    f.end([(A, "r1"), (A, "r2")])
    assert f.counts() == (1, 0)  # r1's second operation still copies
    f.end([(A, "r1")])
    assert f.counts() == (0, 0)


def test_a_cancel_with_nothing_copying_is_answered_at_once() -> None:
    f = fence()
    with arrived(1):
        answer = f.cancel(A, ["r1", "r2"])
    assert answer == 0 and isinstance(answer, int)
    assert f.counts() == (0, 2)


def test_an_operation_read_before_the_cancel_never_starts() -> None:
    f = fence()
    with arrived(5):
        f.cancel(A, ["r"])
    with arrived(4):  # queued before the CANCEL
        assert f.cancelled([(A, "r")])
        assert not f.begin([(A, "other"), (A, "r")])  # one cancelled pair refuses the whole operation
    assert f.counts() == (0, 1)  # and nothing of it was counted
    with arrived(0):  # unset: before everything
        assert not f.begin([(A, "r")])


def test_an_operation_read_after_the_cancel_runs() -> None:
    """Such as the STORE of what vLLM recomputed after a cancelled load."""
    f = fence()
    with arrived(5):
        f.cancel(A, ["r"])
    with arrived(6):
        assert not f.cancelled([(A, "r")])
        assert f.begin([(A, "r")])
    assert f.counts() == (1, 1)


def test_a_cancel_names_its_instances_requests_only() -> None:
    f = fence()
    with arrived(5):
        f.cancel(A, ["r"])
    with arrived(1):
        assert f.begin([(B, "r")])  # the same request id on another instance
        assert f.begin([(A, "r2")])


def test_a_cancel_sent_again_covers_what_was_read_in_between() -> None:
    f = fence()
    with arrived(2):
        f.cancel(A, ["r"])
    with arrived(3):
        assert f.begin([(A, "r")])
    f.end([(A, "r")])
    with arrived(5):
        assert f.cancel(A, ["r"]) == 0
    with arrived(4):
        assert not f.begin([(A, "r")])
    assert f.counts() == (0, 1)  # one pair, remembered once


def test_a_cancel_during_a_copy_answers_once_the_copy_ends() -> None:
    f = fence()
    with arrived(1):
        assert f.begin([(A, "r1"), (A, "r2")])
        assert f.begin([(A, "r2")])
    with arrived(2):
        answer = f.cancel(A, ["r1", "r2", "r3"])
    assert isinstance(answer, Future) and not answer.done()
    with arrived(1):  # the copy checks between chunks, from its own request's context
        assert f.cancelled([(A, "r1")])
    assert f.counts() == (2, 3)
    f.end([(A, "r1"), (A, "r2")])
    assert not answer.done()  # r2's other operation still copies
    f.end([(A, "r2")])
    assert answer.result(0) == 2  # two of the cancelled requests had a copy running


def test_every_cancel_waiting_on_a_copy_is_answered() -> None:
    f = fence()
    with arrived(1):
        f.begin([(A, "r")])
    with arrived(2):
        first = f.cancel(A, ["r"])
    with arrived(3):
        second = f.cancel(A, ["r", "s"])
    assert isinstance(first, Future) and isinstance(second, Future)
    f.end([(A, "r")])
    assert (first.result(0), second.result(0)) == (1, 1)


def test_a_cancel_for_an_unregistered_instance_records_nothing() -> None:
    f = fence()
    with arrived(1):
        f.begin([(A, "copying")])
    with arrived(2):
        assert f.cancel(A, ["idle"], record=False) == 0
        waiting = f.cancel(A, ["copying"], record=False)
    with arrived(1):
        assert not f.cancelled([(A, "copying"), (A, "idle")])
    assert f.counts() == (1, 0) and isinstance(waiting, Future) and not waiting.done()
    f.end([(A, "copying")])
    assert waiting.result(0) == 1


# ---- bounds: a full fence refuses new cancels, never forgets confirmed ones --------------------


def test_a_full_record_refuses_without_forgetting() -> None:
    f = fence(max_cancelled=3, reserve_per_instance=0)
    with arrived(2):
        f.cancel(A, ["r1", "r2"])
        f.cancel(B, ["s1"])
    with arrived(5), pytest.raises(ServerError) as err:
        f.cancel(B, ["s1", "s2"])  # one new pair is one too many
    assert overloaded(err, "cancelled-transfer record is full") and "nothing recorded" in err.value.message
    assert f.counts() == (0, 3)
    with arrived(3):
        assert f.begin([(B, "s1")])  # s1's entry kept its arrival (2): the refused CANCEL moved nothing
        assert f.begin([(B, "s2")])  # and recorded nothing
    with arrived(1):
        assert not any(f.begin([pair]) for pair in [(A, "r1"), (A, "r2"), (B, "s1")])  # all in force
    with arrived(6):
        assert f.cancel(A, ["r1", "r2"]) == 0  # re-sending recorded pairs needs no room


def test_each_instance_has_its_own_share() -> None:
    f = fence(max_per_instance=2)
    with arrived(2):
        f.cancel(A, ["r1", "r2"])
        with pytest.raises(ServerError) as err:
            f.cancel(A, ["r3"])
        assert overloaded(err, f"cancelled requests of instance {A} kept")
        assert f.cancel(B, ["r1", "r3"]) == 0  # the other instance has its share
    with arrived(1):
        assert f.begin([(A, "r3")]) and not f.begin([(A, "r1")])
    assert f.counts() == (1, 4)


def test_full_waiters_refuse_a_cancel_that_would_wait() -> None:
    f = fence(max_waiters=1)
    with arrived(1):
        f.begin([(A, "r1")])
        f.begin([(A, "r2")])
    with arrived(2):
        first = f.cancel(A, ["r1"])
    with arrived(3), pytest.raises(ServerError) as err:
        f.cancel(A, ["r2"])
    assert overloaded(err, "already wait for copies to stop")
    with arrived(1):
        assert not f.cancelled([(A, "r2")])  # refused: nothing recorded
    with arrived(3):
        assert f.cancel(A, ["idle"]) == 0  # a cancel that need not wait is still taken
    f.end([(A, "r1")])
    assert isinstance(first, Future) and first.result(0) == 1
    with arrived(4):
        second = f.cancel(A, ["r2"])  # the waiter's seat is free again
    f.end([(A, "r2")])
    assert isinstance(second, Future) and second.result(0) == 1


def test_a_cancel_refused_by_a_full_record_leaves_no_waiter() -> None:
    f = fence(max_cancelled=1, max_waiters=1, reserve_per_instance=0)
    with arrived(1):
        f.begin([(A, "copying")])
    with arrived(2):
        f.cancel(B, ["other"])  # the record is full
        with pytest.raises(ServerError) as err:
            f.cancel(A, ["copying"])
        assert overloaded(err, "record is full")
        waiting = f.cancel(A, ["copying"], record=False)  # the one waiter's seat is still free
    f.end([(A, "copying")])
    assert isinstance(waiting, Future) and waiting.result(0) == 1


def test_expired_entries_free_their_instances_share() -> None:
    """An entry is kept 2 * queue deadline + 1 s; a deadline of -0.5 s makes that 0 s, so entries
    expire at the next call, and the bookkeeping of forgetting is seen without waiting."""
    f = TransferFence(queue_deadline_s=-0.5, max_per_instance=1, max_cancelled=1)
    with arrived(2):
        f.cancel(A, ["r1"])
    assert f.counts() == (0, 0)
    with arrived(3):
        assert f.cancel(A, ["r2"]) == 0  # the instance's share was handed back
    with arrived(1):
        assert f.begin([(A, "r1")]) and f.begin([(A, "r2")])


def test_a_cancel_flood_never_evicts_a_confirmed_cancel() -> None:
    """A worker's STORE is queued (read 1st), its CANCEL confirmed (2nd); a flood naming 70,000
    other requests (3rd) must not make the STORE startable: it would copy blocks vLLM has
    reused since and publish them under the STORE's keys."""
    fence = TransferFence(queue_deadline_s=10)
    with arrived(2):
        assert fence.cancel(A, ["victim"]) == 0
    with arrived(3), pytest.raises(ServerError) as refused:
        fence.cancel(B, [f"unknown-{i}" for i in range(70_000)])
    assert refused.value.code is ErrorCode.OVERLOADED and "full" in refused.value.message
    with arrived(1):
        assert not fence.begin([(A, "victim")])  # still cancelled: the queued STORE never starts
    assert fence.counts() == (0, 1)  # nothing of the refused flood was recorded


def test_one_instance_filling_its_share_leaves_the_others_theirs() -> None:
    fence = TransferFence(queue_deadline_s=10, max_per_instance=100)
    with arrived(1):
        assert fence.cancel(B, [f"r{i}" for i in range(100)]) == 0
        assert fence.cancel(B, ["r0", "r99"]) == 0  # sent again: nothing new to keep
        with pytest.raises(ServerError) as refused:
            fence.cancel(B, ["r100"])
        assert refused.value.code is ErrorCode.OVERLOADED
        assert fence.cancel(A, ["mine"]) == 0
    with arrived(0):
        assert not fence.begin([(A, "mine")]) and not fence.begin([(B, "r99")])
        assert fence.begin([(B, "r100")])  # refused, so not cancelled: it runs
    assert fence.counts() == (1, 101)


def test_a_cancel_for_an_instance_not_registered_records_nothing_but_waits_for_its_copies() -> None:
    fence = TransferFence(queue_deadline_s=10)
    with arrived(1):
        assert fence.begin([(A, "copying")])  # a copy that outlived its registration
    with arrived(2):
        assert fence.cancel(A, [f"r{i}" for i in range(1000)], record=False) == 0
        waiting = fence.cancel(A, ["copying"], record=False)
    assert fence.counts() == (1, 0)
    assert not isinstance(waiting, int) and not waiting.done()
    fence.end([(A, "copying")])
    assert waiting.result(0) == 1


# ---- reserves: one client's instances fill the shared part, never another instance's reserve ----


def fill(f: TransferFence, instance_id: int, size: int = 8192) -> int:
    """Cancel new requests of the instance until not even one more is taken; how many were."""
    taken = 0
    while size:
        try:
            f.cancel(instance_id, [f"{instance_id}-{taken + i}" for i in range(size)])
            taken += size
        except ServerError:
            size //= 2
    return taken


def test_an_instance_can_cancel_while_other_instances_fill_the_record() -> None:
    """A client with 8 instances of its own filled the whole record (8 x 8,192) and renewed it:
    the victim's CANCEL got OVERLOADED 30 times out of 30, its blocks held all along. Now each
    instance's reserve is its own: the victim's cancels, up to its reserve, are always taken."""
    f = TransferFence(queue_deadline_s=10)
    hostile = range(100, 110)
    with arrived(1):
        filled = [fill(f, instance) for instance in hostile]
        assert filled[-1] < 8192  # the record is full: the last instance could not take its all
        for instance, taken in zip(hostile, filled, strict=True):  # renewed: sent again, no room taken
            if taken:
                f.cancel(instance, [f"{instance}-0"])
    with arrived(2):
        assert f.cancel(A, [f"mine-{i}" for i in range(256)]) == 0
    with arrived(1):
        assert not f.begin([(A, "mine-255")])  # recorded: a STORE queued before it never starts


def test_past_its_reserve_an_instance_draws_on_the_shared_part() -> None:
    f = fence(max_cancelled=4, reserve_per_instance=2)
    with arrived(1):
        assert fill(f, B) == 6  # its reserve, and all of the shared part
        assert f.cancel(A, ["r1", "r2"]) == 0  # A's reserve
        with pytest.raises(ServerError) as err:
            f.cancel(A, ["r3"])  # the shared part is B's
        assert overloaded(err, "record is full")
    assert f.counts() == (0, 8)


def test_a_dropped_instances_cancels_are_forgotten() -> None:
    """Its operations can start no more (the engine checks its registration once `begin` let
    one in): its entries would only keep the shared part from the instances still registered."""
    f = fence(max_cancelled=4, reserve_per_instance=2)
    with arrived(1):
        fill(f, B)
        f.forget_instance(B)
        assert f.counts() == (0, 0)
        assert fill(f, A) == 6  # the shared part is free again
        f.forget_instance(B)  # twice, or an instance with nothing recorded: nothing happens
    with arrived(0):
        assert f.begin([(B, f"{B}-0")]) and not f.begin([(A, f"{A}-0")])
