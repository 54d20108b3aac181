"""Blocking client calls with a deadline, for a tier whose client cannot be told one.

Some clients (Mooncake Store's) block inside native code for as long as they like: 4 s per call
while their master is gone, 30 s while a storage node hangs, minutes for a setup against a port
that is not theirs. A tier must answer in its own time, so each call runs on a thread of this
runner, and the caller waits for it at most `timeout_s`: past that, TimeoutError (an OSError, so
the tier goes down) while the call finishes on its own. A call still queued when its caller gave
up never starts.

The threads are daemon threads: a call stuck in the client must not hold up the process's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

R = TypeVar("R")
_STOP = object()


class CallRunner:
    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = 0
        self._idle = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._serve, daemon=True, name=f"{name}-{i}")
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, call: Callable[..., R], *args: object) -> Future[R]:
        future: Future[R] = Future()
        self._queue.put((future, call, args))
        return future

    def call(self, timeout_s: float, call: Callable[..., R], *args: object) -> R:
        """`call(*args)`'s result, or TimeoutError once `timeout_s` have passed."""
        future = self.submit(call, *args)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()  # if it has not started, it never will
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether no call is running (waiting up to `timeout_s` for those that are to end)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout_s)

    def close(self) -> None:
        """Stop the threads once their calls end; never waits for a stuck one."""
        for _ in self._threads:
            self._queue.put(_STOP)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            self._run(*item)
            # Nothing of a call may outlive it here while the thread waits for the next: a client's
            # results can hold its memory (Mooncake's batch_get_buffer, pieces of its read buffer),
            # and 8 idle threads each holding their last batch starved the next reads.
            del item

    def _run(self, future: Future, call: Callable[..., object], args: tuple[object, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        with self._lock:
            self._running += 1
        try:
            future.set_result(call(*args))
        except BaseException as e:
            future.set_exception(e)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()
