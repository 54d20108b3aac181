"""Sessions: what the daemon holds for one request, from its LOOKUP or STORE to its END_SESSION.

One table, keyed by request id; END_SESSION ends a request's session in one call. A session holds:
- its leases: the pool objects its LOOKUPs pinned for the RETRIEVE that follows. Every lease has
  a way out: the RETRIEVE releases what it read, RELEASE_LEASES what the request will not read,
  END_SESSION the rest, and the TTL what a vanished client never will.
- its last chunk: the chunk hash it looked up or stored last, so that its next STORE links its
  first chunk to it (the pool's prefix-aware eviction). A STORE of a request that holds no lease
  opens a session for this alone.
- its promotions in flight: LOOKUPs whose hits are still being read up from a lower tier. Their
  hits are leased when the read ends, unless the session ended meanwhile (END_SESSION, its TTL,
  or the table's bound): nobody is left to retrieve them, so they are unpinned instead. The
  check and the lease are one step under the table's lock, as END_SESSION is: an END_SESSION
  between them would otherwise find no leases yet, and these would then be held until their TTL.

Each LOOKUP and STORE of the request refreshes its session's deadline (`ttl_s` from then); a
session past it is ended by `expire`. The table is bounded: past `max_sessions`, the oldest
session is ended to admit a new one. STATUS counts *lease* sessions: those holding a pin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_mp.chunks import chunk_hash_of

if TYPE_CHECKING:
    from lmcache_mp.storage import PoolObject

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 65_536


@dataclass
class _Session:
    deadline: float
    # One entry per pin this session holds (an object leased twice is here twice), in the order
    # taken: chunk-major, as `unpin` wants them back. A plain list, because the hot path is a
    # LOOKUP leasing its whole prefix and END_SESSION giving it all back: each one C-level call;
    # the rarer partial releases (RETRIEVE, RELEASE_LEASES) filter it.
    pins: list[PoolObject] = field(default_factory=list)
    last_chunk: bytes | None = None  # the chunk hash the request looked up or stored last
    promotions: int = 0  # LOOKUPs of the request still reading from a lower tier

    @property
    def idle(self) -> bool:
        """Holds nothing: no reason to stay in the table."""
        return not self.pins and self.last_chunk is None and not self.promotions


class SessionTable:
    """Per request: its leases, its last chunk, its promotions in flight (see the module docstring).
    `unpin(objects)` gives pins back (the storage manager's)."""

    def __init__(self, unpin: Callable[[list[PoolObject]], None], ttl_s: float,
                 max_sessions: int = DEFAULT_MAX_SESSIONS):
        self._unpin = unpin
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # oldest deadline first
        self._lock = threading.Lock()
        self.expired_total = 0  # lease sessions ended by their TTL

    # ---- LOOKUP and STORE ---------------------------------------------------------------------

    def lease(self, request_id: str, objects: list[PoolObject], last_chunk: bytes | None) -> None:
        """Take ownership of one pin on each object (already pinned by the caller)."""
        with self._lock:
            session, evicted = self._touch_locked(request_id)
            session.pins.extend(objects)
            if last_chunk is not None:
                session.last_chunk = last_chunk
        self._end_evicted(evicted)

    def remember(self, request_id: str, last_chunk: bytes) -> None:
        """The request's STORE ended with this chunk."""
        with self._lock:
            session, evicted = self._touch_locked(request_id)
            session.last_chunk = last_chunk
        self._end_evicted(evicted)

    def last_chunk(self, request_id: str) -> bytes | None:
        with self._lock:
            session = self._sessions.get(request_id)
            return session.last_chunk if session is not None else None

    def promoting(self, request_id: str) -> None:
        """A LOOKUP of the request reads its hits from a lower tier: `promoted` follows."""
        with self._lock:
            session, evicted = self._touch_locked(request_id)
            session.promotions += 1
        self._end_evicted(evicted)

    def promoted(self, request_id: str, objects: list[PoolObject], last_chunk: bytes | None) -> bool:
        """A promotion announced by `promoting` is over, with these hits (pinned by the caller):
        leased to the request, or, if its session ended meanwhile, unpinned. Whether leased."""
        evicted: list[_Session] = []
        with self._lock:
            session = self._sessions.get(request_id)
            ended = session is None or not session.promotions
            if not ended:
                session.promotions -= 1
                if objects:
                    session, evicted = self._touch_locked(request_id)
                    session.pins.extend(objects)
                    if last_chunk is not None:
                        session.last_chunk = last_chunk
                elif session.idle:
                    del self._sessions[request_id]
        if ended:
            self._unpin(objects)
        self._end_evicted(evicted)
        return not ended

    def _touch_locked(self, request_id: str) -> tuple[_Session, list[_Session]]:
        """The request's session, made if new, with its deadline refreshed; and the sessions
        ended to make room for it."""
        evicted: list[_Session] = []
        session = self._sessions.pop(request_id, None)
        if session is None:
            session = _Session(0.0)
            while len(self._sessions) >= self._max_sessions:
                evicted.append(self._sessions.popitem(last=False)[1])
        session.deadline = time.monotonic() + self._ttl_s
        self._sessions[request_id] = session  # most recent deadline last
        return session, evicted

    def _end_evicted(self, evicted: list[_Session]) -> None:
        if any(old.pins for old in evicted):
            logger.warning("session table full (%d sessions): ended the oldest", self._max_sessions)
        for old in evicted:
            self._unpin_all(old)

    # ---- releases -----------------------------------------------------------------------------

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
            if session.idle:
                del self._sessions[request_id]
        self._unpin(released)
        return len(released)

    def release_chunks(self, request_id: str, chunk_hashes: Iterable[bytes]) -> int:
        """Drop this request's pins on these chunks, on every rank and chunk format (the held
        keys are pool keys); returns how many pins were released."""
        wanted = set(chunk_hashes)
        return self._release_where(request_id, lambda key: chunk_hash_of(key) in wanted)

    def release_all(self, request_id: str) -> int:
        """Drop every pin of this request (its session, last chunk and promotions stay)."""
        return self._release_where(request_id, lambda key: True)

    def _release_where(self, request_id: str, match: Callable[[Hashable], bool]) -> int:
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                return 0
            released = [obj for obj in session.pins if match(obj.key)]
            if released:
                session.pins = [obj for obj in session.pins if not match(obj.key)]
            if session.idle:
                del self._sessions[request_id]
        self._unpin(released)
        return len(released)

    # ---- ends ---------------------------------------------------------------------------------

    def end(self, request_id: str) -> int:
        """END_SESSION: forget the request, releasing its pins (and the leases of promotions still
        in flight, once they end); how many pins were released."""
        with self._lock:
            session = self._sessions.pop(request_id, None)
        return self._unpin_all(session) if session is not None else 0

    def expire(self, now: float | None = None) -> int:
        """End the sessions past their deadline; how many pins were released."""
        now = time.monotonic() if now is None else now
        expired: list[_Session] = []
        with self._lock:
            while self._sessions:
                request_id, session = next(iter(self._sessions.items()))
                if session.deadline > now:
                    break
                del self._sessions[request_id]
                expired.append(session)
        leased = [s for s in expired if s.pins]
        released = sum(self._unpin_all(s) for s in leased)
        if leased:
            self.expired_total += len(leased)
            logger.info("expired %d lease sessions (%d pins) after %.0f s", len(leased), released,
                        self._ttl_s)
        return released

    def counts(self) -> tuple[int, int]:
        """(lease sessions, pins held)."""
        with self._lock:
            holding = [len(s.pins) for s in self._sessions.values() if s.pins]
        return len(holding), sum(holding)

    def _unpin_all(self, session: _Session) -> int:
        self._unpin(session.pins)
        return len(session.pins)
