"""The call runner of tiers whose client takes no deadline (`storage/tiers/calls.py`): a call's
result lives no longer than its caller keeps it (Mooncake's read results hold pieces of its client's
buffer: 8 idle threads each keeping their last batch starved the next reads), and a call past its
deadline is a TimeoutError while the runner serves on."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from lmcache_mp.storage.tiers.calls import CallRunner

DEADLINE_S = 10.0


class Result:
    """What a client's call returns (weak-referenceable, so a test can see it go)."""


def test_an_idle_thread_keeps_nothing_of_its_last_call() -> None:
    runner = CallRunner(4, "test-calls")
    try:
        results = [runner.call(DEADLINE_S, Result) for _ in range(8)]
        alive = [weakref.ref(result) for result in results]
        del results
        deadline = time.monotonic() + DEADLINE_S
        while any(ref() is not None for ref in alive):  # a thread may still be returning from its call
            assert time.monotonic() < deadline, "a runner thread holds a result of its last call"
            time.sleep(0.01)
        assert runner.wait_idle(DEADLINE_S)
    finally:
        runner.close()


def test_a_call_past_its_deadline_times_out_and_the_runner_serves_on() -> None:
    runner = CallRunner(1, "test-calls")
    stuck = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="no answer within"):
            runner.call(0.05, stuck.wait)
        stuck.set()  # the stuck call ends on its own; the next call runs
        assert isinstance(runner.call(DEADLINE_S, Result), Result)
    finally:
        stuck.set()
        runner.close()
