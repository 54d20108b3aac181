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
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import cast

from lmcache_mp.storage.pool import MemoryPool, PoolObject

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 65_536


@dataclass
class _Session:
    deadline: float
    # key -> (object, number of pins this session holds on it)
    held: dict[Hashable, tuple[PoolObject, int]] = field(default_factory=dict)


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
            for obj in objects:
                _, count = session.held.get(obj.key, (obj, 0))
                session.held[obj.key] = (obj, count + 1)
        if evicted:
            logger.warning("lease table full (%d sessions): ended the oldest", self._max_sessions)
        for old in evicted:
            self._unpin_all(old)

    def release(self, request_id: str | None, keys: Iterable[Hashable]) -> int:
        """Drop this request's pins on `keys`; returns how many pins were released."""
        if request_id is None:
            return 0
        released: list[PoolObject] = []
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                return 0
            for key in keys:
                entry = session.held.pop(key, None)
                if entry is not None:
                    released.extend([entry[0]] * entry[1])
            if not session.held:
                del self._sessions[request_id]
        self._pool.unpin(released)
        return len(released)

    def release_chunks(self, request_id: str, chunk_hashes: Iterable[bytes]) -> int:
        """Drop this request's pins on these chunks, on every rank and chunk format (the held
        keys are pool keys, `(chunk hash, fingerprint)`); returns how many pins were released."""
        wanted = set(chunk_hashes)
        with self._lock:
            session = self._sessions.get(request_id)
            keys = [] if session is None else [k for k in session.held if cast(tuple, k)[0] in wanted]
        return self.release(request_id, keys)  # a key released meanwhile is skipped there

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
            return len(self._sessions), sum(
                count for s in self._sessions.values() for _, count in s.held.values())

    def _unpin_all(self, session: _Session) -> int:
        objects = [obj for obj, count in session.held.values() for _ in range(count)]
        self._pool.unpin(objects)
        return len(objects)
