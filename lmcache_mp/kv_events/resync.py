"""Resyncs of the KV event log: AllBlocksCleared, then every source announces again what it holds.

A resync is asked for wherever the stream must start over: CLEAR, CLEAR_TIERS, a model dropped,
or records the publisher lost (its reader fell further behind than the log's ring). `request`
records the AllBlocksCleared at once, in the asker's order; the announcements follow on a thread
of their own (`lmcache-mp-resync`), which is also where a start announces the tiers' chunks.

Why so:
- A pass may hold more records than the ring (a pool or a disk of millions of chunks). Written at
  once it would overrun the publisher, which would lose records, ask for another resync, and so on
  for ever. So each slice of a pass waits until the publisher has read far enough
  (`EventLog.wait_for_room`); live writes (STOREs, evictions) never wait.
- Each source snapshots the keys it holds and records them slice by slice, holding its lock for
  one slice at a time: a LOOKUP waits for a slice, never for a pass. A chunk gone before its slice
  is skipped (its removal is in the log already), a chunk new since the snapshot is in the log by
  its own store; each announcement says what was true when it was recorded.
- A request during a pass restarts it: after the new AllBlocksCleared the pass's earlier
  announcements are forgotten anyway. Twenty CLEAR_TIERS at once cost one pass, not twenty.

`counters` says how many passes finished and whether one is asked for or running (STATUS, /metrics):
the stream has settled once none is and the publisher has published what the log holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from lmcache_mp.kv_events.log import EventLog

logger = logging.getLogger(__name__)

SLICE_RECORDS = 256  # announcements per slice: a source's lock is held for about 0.3 ms
ROOM_POLL_S = 0.1  # how often a pass waiting for the publisher looks whether it was abandoned

T = TypeVar("T")


class Pass:
    """One pass, as a source sees it: its keys in slices, each once the log has room for it."""

    def __init__(self, resync: Resync, generation: int, slice_records: int):
        self._resync = resync
        self._generation = generation
        self._slice_records = slice_records
        self.abandoned = False  # a newer request, or shutdown: the announcing stops

    def slices(self, items: Sequence[T]) -> Iterator[Sequence[T]]:
        """`items` in slices, each yielded once the log has room for it; none more once the pass is
        abandoned (the source then stops announcing)."""
        for start in range(0, len(items), self._slice_records):
            piece = items[start:start + self._slice_records]
            if self.abandoned or not self._resync.wait_for_room(len(piece), self._generation):
                self.abandoned = True
                return
            yield piece


Announcer = Callable[[Pass], None]  # a source's `announce`: records what it holds, slice by slice


class Resync:
    """The log's resyncs, on a thread of their own (see the module docstring). `close` when done."""

    def __init__(self, log: EventLog, sources: list[tuple[str, Announcer]],
                 first: list[tuple[str, Announcer]]):
        """`sources`: every source by name, in the order a pass announces them; `first`: those the
        start announces (the stream starts from nothing: no AllBlocksCleared before them)."""
        self._log = log
        self._sources = sources
        self._slice_records = max(1, min(SLICE_RECORDS, log.capacity // 4))
        self._cond = threading.Condition()
        self._asked: list[tuple[str, Announcer]] | None = first or None
        self._running = False
        self._generation = 0
        self._closing = False
        self._finished_total = 0
        self._thread = threading.Thread(target=self._run, name="lmcache-mp-resync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Start the stream over: AllBlocksCleared now, every source's announcements on the thread."""
        with self._cond:
            self._log.cleared()
            self._asked = self._sources
            self._generation += 1
            self._cond.notify_all()

    def counters(self) -> dict[str, int]:
        """Passes finished since start; 1 while one is asked for or running, else 0."""
        with self._cond:
            return {"resyncs_total": self._finished_total,
                    "resyncing": int(self._asked is not None or self._running)}

    def close(self) -> None:
        """Abandon any pass and stop the thread (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def wait_for_room(self, records: int, generation: int) -> bool:
        """Until the log has room for `records` more; False once the pass of `generation` is
        abandoned (a newer request, or shutdown)."""
        while True:
            with self._cond:
                if self._closing or generation != self._generation:
                    return False
            if self._log.wait_for_room(records, ROOM_POLL_S):
                return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._asked is not None)
                if self._closing:
                    return
                sources, self._asked = self._asked or [], None
                this = Pass(self, self._generation, self._slice_records)
                self._running = True
            for name, announce in sources:
                try:
                    announce(this)
                except Exception:  # a source's failure must not stop the others' announcements
                    logger.exception("%s: announcing its chunks to the event log failed", name)
            with self._cond:
                self._running = False
                self._finished_total += not this.abandoned
