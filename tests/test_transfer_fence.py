"""Issue 25 item 1: a confirmed cancel stays in force; the record refuses instead of forgetting.

The fence is the daemon's core for CANCEL_TRANSFERS (cancellation.py); these tests drive it in
process, ordered by `request_context.ARRIVAL` as the server orders requests, so that the order
that once let a cancelled STORE publish reused blocks is exact rather than timed. The daemon's
side of the same rules (who may cancel, what a full record answers) is in test_late_transfers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmcache_mp.cancellation import TransferFence
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode
from lmcache_mp.request_context import ARRIVAL

VICTIM, OTHER = 1, 2


@contextmanager
def arrived(order: int) -> Iterator[None]:
    """Handle what follows as the request the server read `order`-th."""
    token = ARRIVAL.set(order)
    try:
        yield
    finally:
        ARRIVAL.reset(token)


def test_a_cancel_flood_never_evicts_a_confirmed_cancel() -> None:
    """A worker's STORE is queued (read 1st), its CANCEL confirmed (2nd); a flood naming 70,000
    other requests (3rd) must not make the STORE startable: it would copy blocks vLLM has
    reused since and publish them under the STORE's keys."""
    fence = TransferFence(queue_deadline_s=10)
    with arrived(2):
        assert fence.cancel(VICTIM, ["victim"]) == 0
    with arrived(3), pytest.raises(ServerError) as refused:
        fence.cancel(OTHER, [f"unknown-{i}" for i in range(70_000)])
    assert refused.value.code is ErrorCode.OVERLOADED and "full" in refused.value.message
    with arrived(1):
        assert not fence.begin([(VICTIM, "victim")])  # still cancelled: the queued STORE never starts
    assert fence.counts() == (0, 1)  # nothing of the refused flood was recorded


def test_one_instance_filling_its_share_leaves_the_others_theirs() -> None:
    fence = TransferFence(queue_deadline_s=10, max_per_instance=100)
    with arrived(1):
        assert fence.cancel(OTHER, [f"r{i}" for i in range(100)]) == 0
        assert fence.cancel(OTHER, ["r0", "r99"]) == 0  # sent again: nothing new to keep
        with pytest.raises(ServerError) as refused:
            fence.cancel(OTHER, ["r100"])
        assert refused.value.code is ErrorCode.OVERLOADED
        assert fence.cancel(VICTIM, ["mine"]) == 0
    with arrived(0):
        assert not fence.begin([(VICTIM, "mine")]) and not fence.begin([(OTHER, "r99")])
        assert fence.begin([(OTHER, "r100")])  # refused, so not cancelled: it runs
    assert fence.counts() == (1, 101)


def test_a_cancel_for_an_instance_not_registered_records_nothing_but_waits_for_its_copies() -> None:
    fence = TransferFence(queue_deadline_s=10)
    with arrived(1):
        assert fence.begin([(VICTIM, "copying")])  # a copy that outlived its registration
    with arrived(2):
        assert fence.cancel(VICTIM, [f"r{i}" for i in range(1000)], record=False) == 0
        waiting = fence.cancel(VICTIM, ["copying"], record=False)
    assert fence.counts() == (1, 0)
    assert not isinstance(waiting, int) and not waiting.done()
    fence.end([(VICTIM, "copying")])
    assert waiting.result(0) == 1
