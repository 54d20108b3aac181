"""The v1 remote server's store: objects by key, least recently used first, bounded by bytes
(`LRUStore`). A PUT reserves its room before its payload is received, so stored plus in-flight
payloads never exceed the capacity (see `server.py`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lmcache_mp.v1remote.protocol import MemoryFormat, Shape, WireDtype

# Counted against the capacity for every object besides its payload (key, header fields, dict
# slot), so that floods of empty objects are bounded too.
ENTRY_OVERHEAD_BYTES = 256


@dataclass(slots=True)
class Entry:
    fmt: MemoryFormat
    dtype: WireDtype
    shape: Shape
    location: int
    payload: np.ndarray  # uint8; never mutated once stored: GETs send it without holding the lock
    cost: int  # bytes counted against the capacity


class LRUStore:
    """Objects by key string, bounded by `capacity_bytes` (payloads + ENTRY_OVERHEAD_BYTES each,
    plus the reservations of PUTs being received). Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._used = 0  # cost of the stored entries
        self._reserved = 0  # cost of the PUTs being received
        self._payload_bytes = 0
        self.counters = dict.fromkeys(("gets", "hits", "exists", "puts", "discarded_puts", "evictions"), 0)

    @staticmethod
    def cost(length: int) -> int:
        return length + ENTRY_OVERHEAD_BYTES

    def reserve(self, cost: int) -> bool:
        """Make room for an object of `cost` by evicting the least recently used ones; False (and
        nothing evicted) when it cannot fit even in an empty store."""
        with self._lock:
            if cost > self.capacity - self._reserved:
                return False
            while self._used + self._reserved + cost > self.capacity:
                _, old = self._entries.popitem(last=False)
                self._forget(old)
                self.counters["evictions"] += 1
            self._reserved += cost
            return True

    def release(self, cost: int) -> None:
        """Give back a reservation whose payload never arrived."""
        with self._lock:
            self._reserved -= cost

    def commit(self, key: str, entry: Entry) -> None:
        """Store `entry` in place of its reservation (replacing any object under `key`)."""
        with self._lock:
            self._reserved -= entry.cost
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
            self._entries[key] = entry
            self._used += entry.cost
            self._payload_bytes += len(entry.payload)
            self.counters["puts"] += 1

    def _forget(self, entry: Entry) -> None:
        self._used -= entry.cost
        self._payload_bytes -= len(entry.payload)

    def count_discarded(self) -> None:
        with self._lock:
            self.counters["discarded_puts"] += 1

    def get(self, key: str) -> Entry | None:
        with self._lock:
            self.counters["gets"] += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.counters["hits"] += 1
            return entry

    def contains(self, key: str) -> bool:
        with self._lock:
            self.counters["exists"] += 1
            return key in self._entries  # no move_to_end: asking is not using

    def listing(self, max_bytes: int) -> bytes:
        """The keys, least recently used first, joined by newlines, cut at a key boundary."""
        with self._lock:
            keys = list(self._entries)
        out: list[bytes] = []
        size = 0
        for key in keys:
            raw = key.encode("utf-8")
            size += len(raw) + bool(out)
            if size > max_bytes:
                break
            out.append(raw)
        return b"\n".join(out)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"objects": len(self._entries), "bytes": self._payload_bytes,
                    "accounted_bytes": self._used, "reserved_bytes": self._reserved,
                    "capacity": self.capacity, **self.counters}
