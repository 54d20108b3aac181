"""Write-behind: chunks committed to L1 are copied to a lower tier off the request path.

Off the critical path in time and in resources: writer threads run at a lower priority, and a
tier that writes in slices (`StorageTier.pacer`) waits between them, up to a bound, while a
STORE or RETRIEVE copies (`CopyGate`): on a small machine the copies and the writes would
otherwise share the cores and the memory bandwidth.

One `TierWriter` per lower tier: a bounded queue and the thread that drains it, so a slow
tier (a remote server) never holds up a fast one (a local disk). A queued chunk stays pinned
in L1 until its write is done, so an eviction never loses a chunk that is still queued. The
queue is bounded in bytes: when it is full, `offer` refuses the chunk at once (counted as
skipped) and the STORE that produced it never waits. A writer takes what is queued in batches
(`WRITE_BATCH_CHUNKS`, `WRITE_BATCH_BYTES`): a network tier sends a batch as one pipeline, and
skips the chunks it already holds (another daemon of the fleet may have stored them).

A model's reset (`drop_models`) takes its chunks out of the queue and waits for the batch being
written; a chunk the pool dropped while it was queued or committed (`skip`) is never written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Set

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.pool.pool import PoolObject
from lmcache_mp.storage.tiers.base import StorageTier

logger = logging.getLogger(__name__)

WRITER_NICE = 10
# The longest a writer waits for the request path's copies to pause, per slice of its work.
GATE_MAX_WAIT_S = 0.05
WRITE_BATCH_CHUNKS = 16
WRITE_BATCH_BYTES = 64 << 20


class CopyGate:
    """Copies in flight on the request path (STORE, RETRIEVE). Background writers wait for a gap
    between their slices, so that on a machine with few cores and little memory bandwidth they
    take what the request path leaves; the wait is bounded, so they never starve."""

    def __init__(self, max_wait_s: float = GATE_MAX_WAIT_S):
        self._max_wait_s = max_wait_s
        self._copying = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with self._cond:
            self._copying += 1
        try:
            yield
        finally:
            with self._cond:
                self._copying -= 1
                if not self._copying:
                    self._cond.notify_all()

    def wait_for_gap(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._copying, timeout=self._max_wait_s)


class TierWriter:
    def __init__(self, tier: StorageTier, name: str, capacity_bytes: int,
                 release: Callable[[list[PoolObject]], None],
                 skip: Callable[[PoolObject], bool] = lambda obj: False):
        self.tier = tier
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._release = release  # unpins an object once written (or given up on)
        self._skip = skip  # an object the pool dropped since it was queued: not written
        self._queue: deque[tuple[ChunkKey, PoolObject]] = deque()
        self._queued_bytes = 0
        self._busy = 0  # chunks that have left the queue but are still being written
        self._batches_done = 0
        self._closed = False
        self._cond = threading.Condition()
        self.skipped_total = 0
        self._thread = threading.Thread(target=self._run, name=f"lmcache-mp-write-{name}", daemon=True)
        self._thread.start()

    def offer(self, key: ChunkKey, obj: PoolObject) -> bool:
        """Queue `obj` (pinned by the caller; unpinned here once written). False when the queue
        is full or closed: the caller keeps its pin and must release it."""
        with self._cond:
            if self._closed or self._queued_bytes + obj.nbytes > self.capacity_bytes:
                self.skipped_total += 1
                return False
            self._queue.append((key, obj))
            self._queued_bytes += obj.nbytes
            self._cond.notify()
            return True

    def depth(self) -> tuple[int, int]:
        """(chunks, bytes) waiting, the one being written included."""
        with self._cond:
            return len(self._queue) + self._busy, self._queued_bytes

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is written; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def drop_models(self, models: Set[str], timeout_s: float) -> bool:
        """Forget the queued chunks of `models` and wait for the batch being written, so that no
        chunk of theirs queued so far reaches the tier after this; False if that batch took longer
        than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            dropped = [(key, obj) for key, obj in self._queue if key.fmt.model_name in models]
            if dropped:
                self._queue = deque(item for item in self._queue if item[0].fmt.model_name not in models)
                self._queued_bytes -= sum(obj.nbytes for _, obj in dropped)
            # The batch being written now, not those after it (they skip what the pool dropped).
            batch = self._batches_done + 1 if self._busy else self._batches_done
            while self._batches_done < batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            written = self._batches_done >= batch
        self._release([obj for _, obj in dropped])
        return written

    def close(self, timeout_s: float) -> None:
        """Write what is queued (up to `timeout_s`), then stop; what is left is dropped."""
        if not self.flush(timeout_s):
            logger.warning("%s: %d chunks still queued after %.0f s at shutdown; dropped", self.name,
                           self.depth()[0], timeout_s)
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        self._release([obj for _, obj in dropped])

    def _run(self) -> None:
        # Background work: let the request path (copies, replies) have the cores first. On
        # Linux, PRIO_PROCESS with a thread id renices that thread alone.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._take_batch()
            try:
                wanted = [(key, obj) for key, obj in batch if not self._skip(obj)]
                present = self.tier.batched_contains([key for key, _ in wanted])
                missing = [(key, obj.data)
                           for (key, obj), there in zip(wanted, present, strict=True) if not there]
                self.tier.batched_put(missing)  # a tier counts and swallows its own write errors
            except Exception:
                logger.exception("%s: writing %d chunks failed; skipped", self.name, len(batch))
            finally:
                self._release([obj for _, obj in batch])
                with self._cond:
                    self._busy = 0
                    self._batches_done += 1
                    self._queued_bytes -= sum(obj.nbytes for _, obj in batch)
                    self._cond.notify_all()

    def _take_batch(self) -> list[tuple[ChunkKey, PoolObject]]:
        """Up to WRITE_BATCH_CHUNKS queued chunks, WRITE_BATCH_BYTES in all (one at least)."""
        batch = [self._queue.popleft()]
        nbytes = batch[0][1].nbytes
        while (self._queue and len(batch) < WRITE_BATCH_CHUNKS
               and nbytes + self._queue[0][1].nbytes <= WRITE_BATCH_BYTES):
            batch.append(self._queue.popleft())
            nbytes += batch[-1][1].nbytes
        self._busy = len(batch)
        return batch
