"""KV events: what the daemon's tiers gain and lose, in the order it happens, for KV-aware routers.

Every tier tells the event log when a chunk becomes readable there and when it stops being so:

    stored(source, key, parent)   the chunk is readable in `source` (a STORE committed it, a
                                  promotion read it into the pool, a tier wrote it, a warm restart
                                  verified it); `parent`: the chunk hash before it, when known
    removed(source, key)          it no longer is (LRU eviction, CLEAR, a failed check, a lost file)
    cleared()                     forget everything: the stream (re)starts, or a resync follows
                                  (CLEAR, or records lost before the publisher read them), in which
                                  every source announces what it holds again

Records are plain tuples appended under one lock (a STORE pays a deque append per chunk), in a
bounded ring: a reader that falls further behind than the ring misses records and is told so
(`Records.missed`), never slowed down, never slowing a writer. One writer alone waits: a resync's
announcements (`kv_events/resync.py`), which may outnumber the ring, wait for room past what the
publisher has read (`pace_by`, `wait_for_room`), so that a resync never overruns it.

Two readers: the daemon's PUB endpoint (`kv_events/publisher.py`, every engine and tier of the node)
and the KV_EVENTS request, with which each engine's connector follows its own chunks and hands
them to vLLM's event stream (`vllm_adapter/kv_events.py`).

The wire schema is vLLM's (`vllm/distributed/kv_events.py`, version 0.32): a batch is the
array [ts, events], each event a map tagged "BlockStored", "BlockRemoved" or "AllBlocksCleared".
One chunk is one block here: `block_hashes` is [the chunk's hash] and `block_size` the chunk's
tokens. For a chunk keyed by vLLM's block hashes (the connector's usual keys) that hash is the
vLLM block hash of the chunk's last block, so a router that knows vLLM's hashes meets the same
numbers. Hashes are sent as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1):
the low 64 bits as an unsigned integer. vLLM's decoder ignores the fields it does not know, so
each event also names the cache it belongs to (`model_name`, `world_size`, `rank`, and the
format's `fingerprint`): one daemon serves several models and ranks on one stream.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from lmcache_mp.chunks import ChunkFormat, ChunkKey, PoolKey

# Records kept for readers that lag (the PUB's publisher thread, connectors' KV_EVENTS polls): at
# about 150 bytes each, some 40 MB. A reader further behind is told (`Records.missed`); a resync,
# however large, waits for the publisher instead (`wait_for_room`).
DEFAULT_LOG_RECORDS = 262_144
MIN_LOG_RECORDS = 256  # a resync's slices need a few records of room

STORED, REMOVED, CLEARED = 0, 1, 2
POOL_SOURCE = 0  # the CPU pool's source number; lower tiers get theirs from `add_source`


class Residence(NamedTuple):
    """Where a source's chunks are, in vLLM's terms."""

    medium: str  # "CPU" (the pool) or "STORAGE" (a disk or network tier)
    locality: str  # "LOCAL" (this machine) or "REMOTE" (a network tier)
    ownership: str | None  # the tier's name for a lower tier ("disk:///...", "redis://..."), else None


POOL_RESIDENCE = Residence("CPU", "LOCAL", None)

# (kind, source, chunk hash, format fingerprint, parent chunk hash or None); CLEARED's others empty.
Record = tuple[int, int, bytes, bytes, bytes | None]


# ---- the wire schema (vLLM's, plus the cache's identity) ------------------------------------------


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _Placed(_Event, kw_only=True):
    """What stores and removals both say besides their blocks: where, and which cache's."""

    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    model_name: str | None = None
    world_size: int | None = None
    rank: int | None = None
    fingerprint: str | None = None


class BlockStored(_Placed):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Placed):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def external_hash(chunk_hash: bytes) -> int:
    """A hash as vLLM publishes it by default: its low 64 bits, unsigned."""
    return int.from_bytes(chunk_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


# ---- what KV_EVENTS answers (the connector's view: raw hashes, its models' chunks only) ---------


class ChunkEvent(msgspec.Struct, array_like=True, gc=False):
    kind: int  # STORED, REMOVED or CLEARED
    medium: str = ""
    locality: str = ""
    ownership: str | None = None
    chunk_hash: bytes = b""
    parent_hash: bytes | None = None
    model_name: str = ""
    world_size: int = 0
    rank: int = 0


class EventsReply(msgspec.Struct, array_like=True, gc=False):
    epoch: int  # the daemon's (HELLO's): a new one means a new daemon, whose log starts again at 0
    next_seq: int  # ask from here next time
    missed: bool  # records between the asked seq and the first one here are lost
    events: list[ChunkEvent]


@dataclass(frozen=True)
class Records:
    """What a reader gets: records from `first_seq` on; `missed` if some it asked for are gone."""

    first_seq: int
    records: list[Record]
    missed: bool

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.records)


class EventLog:
    """The bounded, ordered log of every source's stores and removals (see the module docstring)."""

    def __init__(self, capacity: int = DEFAULT_LOG_RECORDS):
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # the paced reader read on (`pace_by`)
        self._paced_by: int | None = None  # where the paced reader stands; None: nobody to wait for
        # A ring: record `seq` at `seq % capacity`, the last `capacity` kept (read by index, in
        # O(1) each, wherever a reader stands).
        self._ring: list[Record | None] = [None] * capacity
        self._end = 0  # seq of the next record
        self._sources: list[Residence] = [POOL_RESIDENCE]
        self._formats: dict[bytes, ChunkFormat] = {}
        self._record((CLEARED, 0, b"", b"", None))  # the stream starts from nothing

    # ---- writers ---------------------------------------------------------------------------------

    def add_source(self, residence: Residence) -> int:
        with self._lock:
            self._sources.append(residence)
            return len(self._sources) - 1

    def know(self, fmt: ChunkFormat) -> None:
        """Learn what a fingerprint means (events name the cache a chunk belongs to)."""
        if fmt.fingerprint not in self._formats:
            with self._lock:
                self._formats[fmt.fingerprint] = fmt

    def stored(self, source: int, key: PoolKey, parent: bytes | None = None) -> None:
        self._record((STORED, source, key[0], key[1], parent))

    def removed(self, source: int, key: PoolKey) -> None:
        self._record((REMOVED, source, key[0], key[1], None))

    def cleared(self) -> None:
        self._record((CLEARED, 0, b"", b"", None))

    def _record(self, record: Record) -> None:
        with self._lock:
            self._ring[self._end % len(self._ring)] = record
            self._end += 1

    # ---- readers ---------------------------------------------------------------------------------

    @property
    def end(self) -> int:
        with self._lock:
            return self._end

    def read(self, since: int, limit: int) -> Records:
        """Up to `limit` records from seq `since` (from the oldest kept, if it is gone)."""
        with self._lock:
            ring = self._ring
            oldest = max(0, self._end - len(ring))
            first = min(max(since, oldest), self._end)
            count = min(limit, self._end - first)
            records = [ring[seq % len(ring)] for seq in range(first, first + count)]
            return Records(first, records, missed=since < oldest)  # type: ignore[arg-type]

    # ---- pacing (a resync's announcements wait for the publisher) ---------------------------------

    def pace_by(self, seq: int | None) -> None:
        """The paced reader (the publisher) has read every record before `seq`; None: there is none
        (any more), nobody waits."""
        with self._room:
            self._paced_by = seq
            self._room.notify_all()

    def wait_for_room(self, records: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until `records` more records keep the paced reader within half the
        ring (the other half is for live writes meanwhile); whether they do."""
        with self._room:
            return self._room.wait_for(lambda: self._has_room(records), timeout_s)

    def _has_room(self, records: int) -> bool:
        return self._paced_by is None or self._end + records - self._paced_by <= len(self._ring) // 2

    @property
    def capacity(self) -> int:
        return len(self._ring)

    def residence(self, source: int) -> Residence:
        return self._sources[source]

    def format_of(self, fingerprint: bytes) -> ChunkFormat | None:
        return self._formats.get(fingerprint)

    # ---- the two views ---------------------------------------------------------------------------

    def vllm_event(self, record: Record) -> KVEvent:
        """One record in vLLM's schema (the PUB endpoint's)."""
        kind, source, chunk_hash, fingerprint, parent = record
        if kind == CLEARED:
            return AllBlocksCleared()
        where = self._sources[source]
        fmt = self._formats.get(fingerprint)
        ident: dict[str, Any] = {"fingerprint": fingerprint.hex()}
        if fmt is not None:
            ident.update(model_name=fmt.model_name, world_size=fmt.world_size, rank=fmt.worker_id)
        if kind == REMOVED:
            return BlockRemoved([external_hash(chunk_hash)], where.medium, locality=where.locality,
                                ownership=where.ownership, **ident)
        return BlockStored([external_hash(chunk_hash)], external_hash(parent) if parent else None, [],
                           fmt.chunk_tokens if fmt is not None else 0, None, where.medium, None,
                           locality=where.locality, ownership=where.ownership, **ident)

    def chunk_events(self, since: int, limit: int, models: set[str], epoch: int) -> EventsReply:
        """KV_EVENTS: the records of `models`' chunks (and every clear) from `since`; `since` < 0
        asks for none, only where the log ends now (a connector starting to follow)."""
        if since < 0:
            return EventsReply(epoch, self.end, False, [])
        got = self.read(since, limit)
        events = []
        for kind, source, chunk_hash, fingerprint, parent in got.records:
            if kind == CLEARED:
                events.append(ChunkEvent(CLEARED))
                continue
            fmt = self._formats.get(fingerprint)
            if fmt is None or fmt.model_name not in models:
                continue
            where = self._sources[source]
            events.append(ChunkEvent(kind, where.medium, where.locality, where.ownership, chunk_hash,
                                     parent, fmt.model_name, fmt.world_size, fmt.worker_id))
        return EventsReply(epoch, got.next_seq, got.missed, events)


class SourceEvents:
    """A lower tier's door to the log: its stores and removals, by `ChunkKey`."""

    def __init__(self, log: EventLog, residence: Residence):
        self._log = log
        self._source = log.add_source(residence)

    def stored(self, key: ChunkKey) -> None:
        self._log.know(key.fmt)
        self._log.stored(self._source, key.ident)

    def removed(self, key: ChunkKey) -> None:
        self._log.removed(self._source, key.ident)


def encode_batch(encoder: msgspec.msgpack.Encoder, events: list[KVEvent]) -> bytes:
    return encoder.encode(EventBatch(time.time(), events))
