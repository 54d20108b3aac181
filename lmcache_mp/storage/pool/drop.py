"""The pool's model-scoped drop (`PoolDrop`, a base of `pool.MemoryPool`): when a model's KV is reset
(its weights changed), every object of it leaves readers' sight at once, whatever holds it.

- READY and unpinned: freed at once.
- READY and pinned (a lease for a RETRIEVE, a write-behind queue, a checksum in progress): hidden
  at once and *doomed*. Hidden: out of the index (no LOOKUP, RETRIEVE or STORE finds it; its key is
  free for a new object), recorded as removed, and its pool-file record cleared (no restart adopts
  it). Doomed: freed when its last pin goes. A RETRIEVE that pins after the drop finds it gone (a
  failed load: recomputed); one already copying reads bytes that stay in place until it ends.
- WRITING (a STORE copying, a promotion reading from a lower tier): doomed too, and its commit
  frees it instead of publishing it: a STORE reserved before the drop and committed after leaves
  nothing behind.

A mixin: it works on `MemoryPool`'s state, declared below for the type checker, under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from lmcache_mp.kv_events.log import EventLog
from lmcache_mp.storage.pool.objects import ObjectState, PoolObject
from lmcache_mp.storage.pool.records import PoolRecords
from lmcache_mp.storage.pool.slabs import Slab


class PoolDrop:
    """See the module docstring."""

    _lock: threading.Lock
    _records: PoolRecords | None
    _events: EventLog | None
    _index: dict[Hashable, PoolObject]
    _readable: dict[Hashable, PoolObject]
    _doomed: set[PoolObject]
    _num_writing: int

    if TYPE_CHECKING:  # `MemoryPool`'s, used here
        def _settle(self) -> None: ...
        def _remove_evictable(self, obj: PoolObject) -> None: ...
        def _drop(self, obj: PoolObject) -> None: ...
        def _unstick(self, slab: Slab[PoolObject]) -> None: ...

    def drop(self, match: Callable[[Hashable], bool]) -> int:
        """Take every object whose key `match`es out of readers' sight (see the module docstring);
        returns how many of them were READY (stored chunks, not writes in progress)."""
        with self._lock:
            self._settle()  # pinned objects leave the LRU: what is left on it is unpinned
            victims = [obj for key, obj in self._index.items() if match(key)]
            for obj in victims:
                if obj.state is ObjectState.READY and not obj.held:
                    self._remove_evictable(obj)
                else:
                    self._hide(obj)
            return sum(obj.state is not ObjectState.WRITING for obj in victims)

    def doomed(self, obj: PoolObject) -> bool:
        """Whether `obj` was dropped while held (see the module docstring): write-behind skips it."""
        return obj in self._doomed

    def _hide(self, obj: PoolObject) -> None:
        del self._index[obj.key]
        if self._readable.pop(obj.key, None) is not None and self._events is not None:
            self._events.removed(0, obj.key)  # type: ignore[arg-type]
        if self._records is not None:
            self._records.dropped(obj)
        self._doomed.add(obj)

    def _spare_doomed(self, objects: list[PoolObject],
                      records: list[tuple[bytes, bytes] | None] | None
                      ) -> tuple[list[PoolObject], list[tuple[bytes, bytes] | None] | None]:
        """A commit's WRITING objects that were not dropped meanwhile (and their records); the
        others are freed."""
        kept = [i for i, obj in enumerate(objects) if obj not in self._doomed]
        for obj in objects:
            if obj in self._doomed:
                self._num_writing -= 1
                self._drop(obj)
                self._unstick(obj.slab)
        return [objects[i] for i in kept], None if records is None else [records[i] for i in kept]

    def _free_doomed(self, objects: list[PoolObject]) -> list[PoolObject]:
        """Of objects that just lost their last pin, free the doomed ones; the others are returned."""
        survivors = []
        for obj in objects:
            if obj not in self._doomed:
                survivors.append(obj)
                continue
            if self._records is not None:  # a checksum sealed while it was doomed must not revive it
                self._records.file.clear_state(obj.offset)
            # Held since `drop` settled its pins (or since its reserve): off the LRU, its slab stuck.
            obj.held = False
            self._drop(obj)
            self._unstick(obj.slab)
        return survivors
