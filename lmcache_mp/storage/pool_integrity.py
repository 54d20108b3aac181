"""The thread that keeps a file-backed pool's checksums: it verifies the chunks a restart adopted
(most recently used first; until then readers can't see them) and seals the chunks committed since
(their checksum is computed here, off the request path, so a STORE costs what it cost without a
pool file). Between slices of either it waits for a gap in the request path's copies (`pace`).

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

_IDLE_WAIT_S = 1.0  # a commit wakes the thread (`poke`); this only bounds a missed wake-up


def _yield_cpu() -> None:
    """Run this thread only on CPU time nothing else wants (SCHED_IDLE; else the lowest nice): on a
    busy machine checksums wait, copies do not. Measured: sealing at normal priority cost STOREs 3%
    of their speed in scripts/bench_data_plane.py (2 cores, three daemons); see docs/benchmarks.md."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


class PoolIntegrity:
    def __init__(self, pool: MemoryPool, pace: Callable[[], None] | None):
        self._pool = pool
        self._pace = pace
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-integrity", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Objects were committed: seal them."""
        self._wake.set()

    def step(self, pace: Callable[[], None] | None) -> bool:
        """Verify one adopted object, else seal one committed object; False if neither was left."""
        return self._verify_one(pace) or self._seal_one(pace)

    def close(self, seal_for_s: float) -> None:
        """Stop the thread, then seal (at full speed) what is left for up to `seal_for_s`."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        left = self._pool.stats().unsealed
        deadline = time.monotonic() + seal_for_s
        while time.monotonic() < deadline and self._seal_one(None):
            pass
        if left:
            still = self._pool.stats().unsealed
            logger.info("pool: sealed %d chunks at shutdown, %d left unsealed", left - still, still)

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

    def _run(self) -> None:
        _yield_cpu()
        while not self._stop.is_set():
            try:
                busy = self.step(self._pace)
            except Exception:  # a bug: logged, and the loop goes on (the pool serves regardless)
                logger.exception("pool integrity: a seal or check failed")
                busy = False
            if not busy:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
