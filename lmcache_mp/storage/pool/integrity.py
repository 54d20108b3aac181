"""The threads that keep a file-backed pool's checksums.

- The verifier, started only after an adoption: it checks the chunks a restart adopted, the most
  recently used first (until then readers can't see them, so it runs at normal priority: every
  chunk it has not reached yet is a miss), and ends when none is left.
- The sealer: it computes the checksum of every chunk committed since, off the request path, so
  that a STORE costs what it cost without a pool file. The hashing itself runs in a child process
  at nice 19 (`pool/seal_process.py`: why not a thread at low priority); the thread, at the daemon's own
  priority, only hands it each chunk and writes the result. Without the child (it could not
  start, or died) the thread hashes, at the daemon's priority.
Between slices of either, they wait for a gap in the request path's copies (`pace`). The sealer
also marks the file as used now and then (`PoolFile.mark_used`): how other daemons' starts tell a
live or recently stopped daemon's file from a stale one.

A chunk committed but not yet sealed when the daemon dies is adopted on the strength of the commit
order (`pool/file.py`), sealed then, and counted (`AdoptionStats.adopted_unsealed`); a clean shutdown
seals what is left first, within a bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lmcache_mp.storage.pool.file import verify
from lmcache_mp.storage.pool.objects import PoolObject
from lmcache_mp.storage.pool.pool import MemoryPool
from lmcache_mp.storage.pool.seal_process import ChecksumProcessGone

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # a commit wakes the sealer (`poke`); this only bounds a missed wake-up
# Well within the shortest time after which another daemon's start removes a file (600 s by
# default, pool_file_ttl_s), which matters only once the daemon is gone: a live one holds its file.
_MARK_USED_EVERY_S = 60.0


class PoolIntegrity:
    def __init__(self, pool: MemoryPool, pace: Callable[[], None] | None):
        self._pool = pool
        self._pace = pace
        self._hasher = pool.checksum_process()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._seal_loop, name="pool-seal", daemon=True)]
        if pool.stats().unverified:
            self._threads.append(threading.Thread(target=self._verify_all, name="pool-verify", daemon=True))
        for thread in self._threads:
            thread.start()

    @property
    def checksum_pid(self) -> int | None:
        """The checksum process's pid (`pool/seal_process.py`); None when the thread hashes itself."""
        return self._hasher.pid if self._hasher is not None else None

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
        if self._hasher is not None:
            self._hasher.close()

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
        marked = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - marked >= _MARK_USED_EVERY_S:
                marked = time.monotonic()
                self._pool.mark_file_used()
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
            self._seal(obj, pace)
        finally:
            self._pool.sealed(obj)
        return True

    def _seal(self, obj: PoolObject, pace: Callable[[], None] | None) -> None:
        hasher = self._hasher
        if hasher is not None:
            try:
                self._pool.seal(obj, pace, hasher)
                return
            except ChecksumProcessGone as err:
                logger.warning("pool: %s; sealing in the daemon's own thread from now on", err)
                self._hasher = None
                hasher.close()  # reaps it
        self._pool.seal(obj, pace)
