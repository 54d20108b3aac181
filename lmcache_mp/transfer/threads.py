"""Splitting one RETRIEVE's chunk copies over the daemon's idle copy threads.

A RETRIEVE is on the critical path of the request that waits for it (vLLM computes nothing for it
until its KV is in place), and one thread copying pages can leave memory bandwidth unused while
another core is free (`scripts/bench/bench_data_plane.py` measures the split RETRIEVE against the
one-thread one). So a RETRIEVE of several chunks hands chunks out to helper threads that are free at that
moment, and copies the rest itself.

Helpers are bounded by `threads` seats (the daemon's `--max-workers`): the worker threads running
a STORE or a RETRIEVE take a seat each, and a RETRIEVE takes helpers only for the seats left, so
two large operations at once are not split (each already has a core's worth of copying). A seat
is counted, never waited for: an operation's own thread copies whatever the count (a RETRIEVE,
on the server's load lane, never waits here for a STORE; the seats may then number more than
`threads` for a while, and no helper joins until they are fewer). A helper is never waited for
before it starts: the chunks go to whichever thread asks first, and a helper that starts after
the last chunk was handed out has nothing to do.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


class _Chunks:
    """One operation's chunk indices, handed out once each, to the threads that copy them."""

    def __init__(self, count: int, copy: Callable[[int], bool]):
        self._count = count
        self._copy = copy
        self._next = 0
        self._stopped = False  # a copy said stop (cancelled) or failed: hand out nothing more
        self._closed = False  # the operation's own thread is done: no helper may join any more
        self._helping = 0  # helpers inside `work`
        self._error: BaseException | None = None  # a helper's, raised on the operation's thread
        self._lock = threading.Condition()

    def _take(self) -> int | None:
        with self._lock:
            if self._stopped or self._next >= self._count:
                return None
            self._next += 1
            return self._next - 1

    def work(self, copied: Callable[[], None] = lambda: None) -> None:
        """Copy chunks until none is left or a copy says stop (returns False) or raises;
        `copied` is called after each chunk copied."""
        try:
            while (i := self._take()) is not None:
                if not self._copy(i):
                    self._stop()
                    return
                copied()
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True

    def help(self, copied: Callable[[], None]) -> None:
        """A helper's part (see `work`): join unless the operation has finished without it."""
        with self._lock:
            if self._closed:
                return
            self._helping += 1
        try:
            self.work(copied)
        except BaseException as err:
            with self._lock:
                self._error = self._error or err
        finally:
            with self._lock:
                self._helping -= 1
                self._lock.notify_all()

    def close(self) -> None:
        """Wait for the helpers that joined; raise the first error one of them met."""
        with self._lock:
            self._closed = True
            self._lock.wait_for(lambda: not self._helping)
            error = self._error
        if error is not None:
            raise error


class CopyThreads:
    def __init__(self, threads: int):
        self._limit = threads
        self._copying = 0  # seats taken: operations' own threads and helpers
        self.helped_chunks = 0  # chunks copied by helpers, ever (STATUS: split_chunks)
        self._lock = threading.Lock()
        self._helpers = (ThreadPoolExecutor(threads - 1, thread_name_prefix="lmcache-mp-copy")
                         if threads > 1 else None)

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    @contextmanager
    def seat(self) -> Iterator[None]:
        """The calling thread copies for the duration (a STORE's or a RETRIEVE's own thread)."""
        with self._lock:
            self._copying += 1
        try:
            yield
        finally:
            self._release()

    def run(self, count: int, copy: Callable[[int], bool], *, split: bool) -> None:
        """Call `copy(i)` once for each `i` in `range(count)`, on the calling thread (which must
        hold a seat) and, with `split`, on helpers free right now, until every chunk is copied
        or a copy returns False (cancelled: no further chunk starts). Returns once every copy
        that started is complete; raises the first error any of them raised."""
        chunks = _Chunks(count, copy)
        for _ in range(self._take_helpers(count - 1) if split else 0):
            # Each helper runs in a copy of this thread's context: the fence reads the arrival
            # order of the request being handled from it (dispatch.ARRIVAL).
            self._helpers.submit(self._help, contextvars.copy_context(), chunks)  # type: ignore[union-attr]
        try:
            chunks.work()
        finally:
            chunks.close()

    def _take_helpers(self, wanted: int) -> int:
        if self._helpers is None:
            return 0
        with self._lock:
            taken = max(0, min(wanted, self._limit - self._copying))
            self._copying += taken
        return taken

    def _help(self, context: contextvars.Context, chunks: _Chunks) -> None:
        try:
            context.run(chunks.help, self._helped)
        finally:
            self._release()

    def _helped(self) -> None:
        with self._lock:
            self.helped_chunks += 1

    def _release(self) -> None:
        with self._lock:
            self._copying -= 1
