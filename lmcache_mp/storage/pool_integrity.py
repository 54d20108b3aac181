"""The threads that keep a file-backed pool's checksums.

- The verifier, started only after an adoption: it checks the chunks a restart adopted, the most
  recently used first (until then readers can't see them, so it runs at normal priority: every
  chunk it has not reached yet is a miss), and ends when none is left.
- The sealer: it computes the checksum of every chunk committed since, off the request path, so
  that a STORE costs what it cost without a pool file. It runs at the lowest priority (nice 19):
  measured, sealing at normal priority cost STOREs 3% of their speed in
  scripts/bench_data_plane.py (2 cores; docs/benchmarks.md section 13). Never SCHED_IDLE: a
  thread of this process that holds the GIL (or the pool's lock) when it is preempted stalls every
  other until it runs again, and on a machine with no idle CPU a SCHED_IDLE thread does not (a
  tensor-parallel vLLM engine busy on both cores stalled the daemon for minutes, STATUS
  included). At nice 19 it still gets a share of the CPU, so such a stall lasts milliseconds.
Between slices of either, they wait for a gap in the request path's copies (`pace`).

A chunk committed but not yet sealed when the daemon dies is adopted on the strength of the commit
order (`pool_file`), sealed then, and counted (`AdoptionStats.adopted_unsealed`); a clean shutdown
seals what is left first, within a bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from lmcache_mp.storage.pool import MemoryPool
from lmcache_mp.storage.pool_file import verify

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # a commit wakes the sealer (`poke`); this only bounds a missed wake-up


def _yield_cpu() -> None:
    """Run the calling thread at the lowest priority (see the module docstring: not SCHED_IDLE)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class PoolIntegrity:
    def __init__(self, pool: MemoryPool, pace: Callable[[], None] | None):
        self._pool = pool
        self._pace = pace
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._seal_loop, name="pool-seal", daemon=True)]
        if pool.stats().unverified:
            self._threads.append(threading.Thread(target=self._verify_all, name="pool-verify", daemon=True))
        for thread in self._threads:
            thread.start()

    def poke(self) -> None:
        """Objects were committed: seal them."""
        self._wake.set()

    def step(self, pace: Callable[[], None] | None) -> bool:
        """Verify one adopted object, else seal one committed object; False if neither was left."""
        return self._verify_one(pace) or self._seal_one(pace)

    def close(self, seal_for_s: float) -> None:
        """Stop the threads, then seal (at full speed) what is left for up to `seal_for_s`."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        left = self._pool.stats().unsealed
        deadline = time.monotonic() + seal_for_s
        while time.monotonic() < deadline and self._seal_one(None):
            pass
        if left:
            still = self._pool.stats().unsealed
            logger.info("pool: sealed %d chunks at shutdown, %d left unsealed", left - still, still)

    def _verify_all(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop.is_set() and self._verify_one(self._pace):
                pass
        except Exception:  # a bug: logged; what is left stays unverified (misses), never served
            logger.exception("pool: verifying adopted chunks failed")
            return
        adoption = self._pool.stats().adoption
        logger.info("pool: verified %d adopted chunks in %.2f s, %d dropped", adoption.verified_total,
                    time.monotonic() - started, adoption.dropped_total)

    def _seal_loop(self) -> None:
        _yield_cpu()
        while not self._stop.is_set():
            try:
                busy = self._seal_one(self._pace)
            except Exception:  # a bug: logged, and the loop goes on (the pool serves regardless)
                logger.exception("pool: sealing a chunk failed")
                busy = False
            if not busy:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()

    def _verify_one(self, pace: Callable[[], None] | None) -> bool:
        taken = self._pool.take_unverified()
        if taken is None:
            return False
        obj, record = taken
        ok = False
        try:
            ok = verify(record, obj.data, pace)
        finally:
            self._pool.verified(obj, ok)
        return True

    def _seal_one(self, pace: Callable[[], None] | None) -> bool:
        obj = self._pool.take_unsealed()
        if obj is None:
            return False
        try:
            self._pool.seal(obj, pace)
        finally:
            self._pool.sealed(obj)
        return True
