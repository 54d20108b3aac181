"""Leases: the pool objects a request holds pinned between its LOOKUP and its RETRIEVE.

A LOOKUP pins its hits so they cannot be evicted before the RETRIEVE that follows. Every
lease has a way out: the RETRIEVE releases what it read, RELEASE_LEASES what the request will
not read, END_SESSION the rest of that request, and a TTL what a vanished client never will.
The table is bounded: past `max_sessions`, the oldest session is ended to admit a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import cast

from lmcache_mp.storage.pool import MemoryPool, PoolObject

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 65_536


@dataclass
class _Session:
    deadline: float
    # One entry per pin this session holds (an object leased twice is here twice), in the order
    # taken: chunk-major, as `MemoryPool.unpin` wants them back. A plain list, because the hot path
    # is a LOOKUP leasing its whole prefix and END_SESSION giving it all back: each one C-level
    # call; the rarer partial releases (RETRIEVE, RELEASE_LEASES) filter it.
    pins: list[PoolObject] = field(default_factory=list)


class LeaseTable:
    def __init__(self, pool: MemoryPool, ttl_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS):
        self._pool = pool
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # oldest deadline first
        self._lock = threading.Lock()
        self.expired_total = 0

    def add(self, request_id: str, objects: list[PoolObject]) -> None:
        """Take ownership of one pin on each object (already pinned by the caller)."""
        evicted: list[_Session] = []
        with self._lock:
            session = self._sessions.pop(request_id, None)
            if session is None:
                session = _Session(0.0)
                while len(self._sessions) >= self._max_sessions:
                    evicted.append(self._sessions.popitem(last=False)[1])
            session.deadline = time.monotonic() + self._ttl_s
            self._sessions[request_id] = session  # most recent deadline last
            session.pins.extend(objects)
        if evicted:
            logger.warning("lease table full (%d sessions): ended the oldest", self._max_sessions)
        for old in evicted:
            self._unpin_all(old)

    def release(self, request_id: str | None, keys: Iterable[Hashable]) -> int:
        """Drop one of this request's pins per occurrence of a key in `keys` (a RETRIEVE's chunks:
        the ranks of a replicated cache read one chunk, and each holds a pin on it); returns how
        many pins were released."""
        if request_id is None:
            return 0
        wanted = Counter(keys)
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                return 0
            released, kept = [], []
            for obj in session.pins:
                if wanted[obj.key] > 0:
                    wanted[obj.key] -= 1
                    released.append(obj)
                else:
                    kept.append(obj)
            session.pins = kept
            if not kept:
                del self._sessions[request_id]
        self._pool.unpin(released)
        return len(released)

    def release_chunks(self, request_id: str, chunk_hashes: Iterable[bytes]) -> int:
        """Drop this request's pins on these chunks, on every rank and chunk format (the held
        keys are pool keys, `(chunk hash, fingerprint)`); returns how many pins were released."""
        wanted = set(chunk_hashes)
        return self._release_where(request_id, lambda key: cast(tuple, key)[0] in wanted)

    def _release_where(self, request_id: str, match: Callable[[Hashable], bool]) -> int:
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                return 0
            released = [obj for obj in session.pins if match(obj.key)]
            if released:
                session.pins = [obj for obj in session.pins if not match(obj.key)]
            if not session.pins:
                del self._sessions[request_id]
        self._pool.unpin(released)
        return len(released)

    def end(self, request_id: str) -> int:
        with self._lock:
            session = self._sessions.pop(request_id, None)
        return self._unpin_all(session) if session is not None else 0

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired: list[_Session] = []
        with self._lock:
            while self._sessions:
                request_id, session = next(iter(self._sessions.items()))
                if session.deadline > now:
                    break
                del self._sessions[request_id]
                expired.append(session)
        released = sum(self._unpin_all(s) for s in expired)
        if expired:
            self.expired_total += len(expired)
            logger.info("expired %d lease sessions (%d pins) after %.0f s", len(expired), released,
                        self._ttl_s)
        return released

    def counts(self) -> tuple[int, int]:
        """(sessions, pins held)."""
        with self._lock:
            return len(self._sessions), sum(len(s.pins) for s in self._sessions.values())

    def _unpin_all(self, session: _Session) -> int:
        self._pool.unpin(session.pins)
        return len(session.pins)
