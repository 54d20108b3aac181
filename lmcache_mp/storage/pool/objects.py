"""The pool's vocabulary: its objects (`PoolObject`) and their states, why a reserve fails, and the
pool's counters (`PoolStats`). `pool.MemoryPool` holds the objects; see its docstring for their
lifecycle."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from lmcache_mp.storage.pool.slabs import Slab


@dataclass
class AdoptionStats:
    """What a start found in its pool file. Cumulative counters end in `_total`."""

    adopted_objects: int = 0  # chunks served again after the restart (sealed or not)
    adopted_bytes: int = 0
    adopted_unsealed: int = 0  # of which committed but not yet checksummed when the daemon died
    verified_total: int = 0  # adopted chunks whose checksum was checked since
    dropped_total: int = 0  # adopted chunks that failed their check, or duplicates: freed


class ObjectState(enum.Enum):
    WRITING = enum.auto()  # reserved and being filled: invisible to readers, never evicted
    READY = enum.auto()  # committed: visible, evictable while unpinned
    FREED = enum.auto()  # aborted, evicted or cleared: its memory may already hold another object


class ReserveFailure(enum.Enum):
    """Why `reserve` handed out no object for a key; the caller maps it to its own outcome code."""

    ALREADY_PRESENT = enum.auto()  # the key is live, READY or still WRITING
    NO_SPACE = enum.auto()  # nothing evictable would free a slot of the right size


@dataclass(eq=False)
class PoolObject:
    """One stored chunk. Compared by identity, so the pool can key its LRU dicts by the object."""

    key: Hashable
    nbytes: int
    data: torch.Tensor  # uint8 view of exactly `nbytes` of pool memory, `align`-aligned
    slab: Slab[PoolObject] = field(repr=False)
    slot: int = field(repr=False)
    offset: int = field(repr=False)  # of its data in the pool's memory (a pool file's records: by it)
    recorded: bool = field(default=False, repr=False)  # its record in the pool file is live
    state: ObjectState = ObjectState.WRITING
    pins: int = 0
    # Off its class's LRU and counted stuck in its slab: WRITING, or pinned and settled (see
    # `_settle`; a pin taken since the last eviction decision has only raised `pins`).
    held: bool = True
    # The chunk before this one in its chain (see `MemoryPool.link`); one that is FREED counts as
    # None and is cleared when next met.
    parent: PoolObject | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    num_pinned: int
    num_writing: int
    evictions: int  # cumulative; `clear` doesn't count
    ready_bytes: int  # prepared so far, from the start; == capacity_bytes once the pool is ready
    # Page-locked for DMA (cudaHostRegister, where CUDA is present), from the start: not the object
    # pins above. Why pinning stopped short, if it did ("" otherwise): the rest is used unpinned.
    pinned_bytes: int
    pin_error: str
    # The pool file (warm restart): "" for a pool in anonymous memory; what its start adopted.
    pool_file: str = ""
    adoption: AdoptionStats = field(default_factory=AdoptionStats)
    unverified: int = 0  # adopted objects not yet checked (invisible to readers until then)
    unsealed: int = 0  # committed objects whose checksum is still to be written
