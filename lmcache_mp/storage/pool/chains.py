"""Prefix chains in the pool: the recency rules that make eviction eat each chain from its tail.

A key in the daemon names a chunk and the whole token prefix before it, and a LOOKUP counts hits
only up to the first missing chunk, so a chunk whose predecessor is gone can never be hit. Each
`PoolObject` may name its parent (the chunk before it, `MemoryPool.link`); these functions walk
those links and order the size classes' LRUs so that an ancestor is always more recently used
than its READY unpinned descendants. They change only the objects' LRU positions (and clear links
to freed parents); the pool calls them under its lock.
"""

from __future__ import annotations

from lmcache_mp.storage.pool.objects import ObjectState, PoolObject


def refresh(objects: list[PoolObject]) -> None:
    """Make `objects` and all their ancestors the most recently used, each ancestor after its
    descendants and `objects` in reverse (objects[0] the most recent of them); only the READY
    unpinned ones move, but walks go through the rest. Every walk stops at an object already
    seen, so this is O(objects + ancestors walked), and parent cycles can't trap it.

    The prefix rules (module docstring), which keep every ancestor more recently used than its
    READY unpinned descendants, so that the LRU object of a size class has no evictable
    descendant in that class (only pinned, WRITING or gone ones) and eviction eats each chain
    from its tail:
    - Objects that become evictable (a commit without pin, the last unpin) are refreshed, in
      the order of the call's list, which callers give in chunk order (`pin` and `pin_prefix`
      return theirs in that order, `pin_prefix` chunk-major): the first chunk ends up the most
      recent, and every READY unpinned ancestor reachable through parent links (walking
      through pinned and WRITING ones too) more recent still, each after its descendants.
    - `MemoryPool.link` refreshes the chain it links, and its parent. A STORE links before reserving, so
      that its reserve spares the prefix it extends, and again after.
    - Pins protect objects, not prefixes: a pinned chunk's ancestors stay evictable (a lookup
      pins the whole prefix it reads, and its unpin refreshes them)."""
    ready = ObjectState.READY
    for obj in reversed(walk_up(objects)):  # the last walk first, each nearest first
        if obj.state is ready and obj.pins == 0:
            obj.slab.size_class.evictable.move_to_end(obj)

def descends_from(obj: PoolObject, others: set[PoolObject | None]) -> bool:
    """Whether `obj` or one of its ancestors is in `others`: linking it as their parent would
    close a cycle. O(ancestors)."""
    return any(node in others for node in walk_up([obj]))

def walk_up(starts: list[PoolObject]) -> list[PoolObject]:
    """Each start and its ancestors, stopping at the first object an earlier walk (or this
    one) met, so no walk ever loops, even over a parent cycle; the walks in order, each
    laid out from its farthest ancestor to its start. A parent that was freed counts as none
    and is cleared. One loop, no call per object: an END_SESSION gives a LOOKUP's whole
    prefix back through `refresh`."""
    walked: list[PoolObject] = []
    seen: set[PoolObject] = set()
    freed = ObjectState.FREED
    for start in starts:
        first = len(walked)
        node: PoolObject | None = start
        while node is not None and node not in seen:
            seen.add(node)
            walked.append(node)
            parent = node.parent
            if parent is not None and parent.state is freed:
                node.parent = parent = None
            node = parent
        if len(walked) - first > 1:
            walked[first:] = reversed(walked[first:])
    return walked
