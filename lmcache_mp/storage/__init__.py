"""The daemon's storage: the CPU memory pool (L1), the tiers below it, and the manager over both.

This package's face is what the rest of the daemon uses of it: the `StorageManager` (its only
door to storage, see `manager.py`; LOOKUP's part in `read_through.py`) and the names of what it hands out:

    StorageManager      builds, serves and closes the pool and the tiers
    Hits                a LOOKUP's result: per leading chunk, one pinned L1 object per rank
    PoolObject          one chunk's bytes in L1 (`.data`), as `reserve`, `lookup` and `pin` hand them out
    Slot                what `reserve` gives per chunk: a `PoolObject` to fill, or a `ReserveFailure`
    ReserveFailure      why a chunk got no slot (ALREADY_PRESENT, NO_SPACE)
    RankSpec, FormatCombo  how each rank of a registered engine stores a chunk (LOOKUP's question)

The names are loaded on first use (PEP 562): the pool loads torch, and torch-free modules
(the wire protocol's `chunks.py`, the CLI's `storage.urls`) live under or beside this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_mp.storage.manager import StorageManager
    from lmcache_mp.storage.pool.pool import PoolObject, ReserveFailure
    from lmcache_mp.storage.read_through import FormatCombo, Hits, RankSpec

    Slot = PoolObject | ReserveFailure

_READ_THROUGH_NAMES = frozenset({"Hits", "RankSpec", "FormatCombo"})
_POOL_NAMES = frozenset({"PoolObject", "ReserveFailure"})

__all__ = ["FormatCombo", "Hits", "PoolObject", "RankSpec", "ReserveFailure", "Slot", "StorageManager"]


def __getattr__(name: str) -> Any:
    if name == "StorageManager":
        import lmcache_mp.storage.manager as manager
        value = manager.StorageManager
    elif name in _READ_THROUGH_NAMES:
        import lmcache_mp.storage.read_through as read_through
        value = getattr(read_through, name)
    elif name in _POOL_NAMES or name == "Slot":
        import lmcache_mp.storage.pool.pool as pool
        value = pool.PoolObject | pool.ReserveFailure if name == "Slot" else getattr(pool, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value
