"""Where a request's tail is: the index that lets a returning turn find its history's last part.

A chunk is `--chunk-size` tokens, and a conversation's history seldom ends on a chunk boundary.
When a request finishes, its connector stores the part past its last full chunk as one short
chunk, its *tail* (up to a chunk's blocks, the last one maybe partly filled), keyed by a hash of
what precedes it and of its own tokens (`vllm_adapter.tails`). A returning turn cannot compute
that key from its prompt alone, since it does not know where the stored tail ends; so the
connector also tells the daemon (NOTE_TAILS) which tails follow which chunk, the *anchor* (the
chunk key just before the tail, or b"" for a tail that starts at token 0). LOOKUP_PREFIX then
answers with the tails held after the last chunk it found, and the connector keeps the longest
one whose key its own tokens reproduce: the daemon never sees tokens, and a wrong or stale
entry here is a miss, never wrong KV (RETRIEVE computes the stored identity itself).

Many conversations may follow one anchor: every short one follows b"", and every one that
shares a system prompt of a chunk or more follows its last chunk. So a tail of a full block or
more is indexed by its last full block instead (vLLM's block hash, which chains through every
token before it: one conversation's), and a lookup sends the block hashes of its prompt's last
chunk and past it (the *window*, a bounded number): the tails offered are those indexed by a
block of the window, and those shorter than a block after the anchor.

Bounded: at most `MAX_PER_KEY` tails per key (the newest) and `MAX_TAILS` in all (the least
recently noted or found keys go first). Memory only: after a restart, the tails the daemon still
holds (pool file, disk) are found again once a request notes them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Set

from lmcache_mp.engine.keys import short_chunk_hash
from lmcache_mp.protocol import TailHit
from lmcache_mp.storage.read_through import RankSpec

MAX_PER_KEY = 8
MAX_TAILS = 262_144  # ~150 bytes each: ~40 MiB at most

# Where a tail is indexed: (model, world size, "block", its last full block's hash), or, for a
# tail shorter than a block, (model, world size, "anchor", the key of the chunk before it).
_Key = tuple[str, int, str, bytes]


def _key(model: str, world_size: int, anchor: bytes, tail: TailHit) -> _Key:
    if tail.last_block:
        return model, world_size, "block", tail.last_block
    return model, world_size, "anchor", anchor


class TailIndex:
    """The tails noted, newest first per key. Thread-safe: NOTE_TAILS on the socket thread,
    LOOKUP_PREFIX there or on a promotion's reader thread."""

    def __init__(self, max_tails: int = MAX_TAILS, max_per_key: int = MAX_PER_KEY):
        self._max_tails = max_tails
        self._max_per_key = max_per_key
        self._count = 0
        self._lock = threading.Lock()
        self._tails: OrderedDict[_Key, list[TailHit]] = OrderedDict()
        # Per (model, world size), the last blocks indexed: a lookup intersects its window with
        # them (at C speed) rather than looking up a key per block of the window.
        self._blocks: dict[tuple[str, int], set[bytes]] = {}
        self.noted_total = 0  # tails NOTE_TAILS indexed (STATUS, /metrics)
        self.offered_total = 0  # tails a LOOKUP_PREFIX answered with (STATUS, /metrics)

    def note(self, model: str, world_size: int, anchor: bytes, tail: TailHit) -> None:
        """A tail stored (or about to be) after the chunk `anchor`: the newest of its key."""
        key = _key(model, world_size, anchor, tail)
        with self._lock:
            old = self._tails.pop(key, [])
            tails = [tail, *(t for t in old if t.tail_hash != tail.tail_hash)][:self._max_per_key]
            self._set(key, tails, len(old))
            self.noted_total += 1
            while self._count > self._max_tails:
                dropped_key, dropped = self._tails.popitem(last=False)
                self._set(dropped_key, [], len(dropped))  # its count, and its block

    def forget(self, model: str, world_size: int, anchor: bytes, tail: TailHit) -> None:
        key = _key(model, world_size, anchor, tail)
        with self._lock:
            tails = self._tails.get(key)
            if tails is not None:
                self._set(key, [t for t in tails if t.tail_hash != tail.tail_hash], len(tails))

    def _set(self, key: _Key, tails: list[TailHit], before: int) -> None:
        """Under the lock: `key`'s tails are now `tails` (none: the key goes), `before` earlier."""
        self._count += len(tails) - before
        model, world_size, kind, value = key
        blocks = self._blocks.setdefault((model, world_size), set()) if kind == "block" else None
        if tails:
            self._tails[key] = tails
            if blocks is not None:
                blocks.add(value)
            return
        self._tails.pop(key, None)
        if blocks is not None:
            blocks.discard(value)

    def after(self, model: str, world_size: int, anchor: bytes, window: Iterable[bytes]) -> list[TailHit]:
        """The tails that may follow the chunk `anchor` in a prompt whose last blocks are
        `window`: those indexed by a block of the window, and those shorter than a block after
        `anchor`; newest first within each key."""
        found: list[TailHit] = []
        with self._lock:
            blocks = self._blocks.get((model, world_size))
            keys = [(model, world_size, "anchor", anchor)]
            if blocks:
                keys += [(model, world_size, "block", b) for b in blocks.intersection(window)]
            for key in keys:
                tails = self._tails.get(key)
                if tails is not None:
                    self._tails.move_to_end(key)
                    found += tails
        return found

    def forget_models(self, models: Set[str]) -> int:
        """Forget every tail of these models (their KV was reset); how many."""
        with self._lock:
            keys = [key for key in self._tails if key[0] in models]
            forgotten = sum(len(self._tails[key]) for key in keys)
            for key in keys:
                self._set(key, [], len(self._tails[key]))
            for scope in [scope for scope in self._blocks if scope[0] in models]:
                del self._blocks[scope]
            return forgotten

    def clear(self) -> None:
        with self._lock:
            self._tails.clear()
            self._blocks.clear()
            self._count = 0

    def __len__(self) -> int:
        return self._count


def tail_identity(tail: TailHit, spec: RankSpec) -> bytes:
    """The identity a STORE gave `tail` on a rank of `spec`: a short chunk's (`keys.short_chunk`),
    unless the tail fills all of a chunk's blocks."""
    if tail.num_blocks >= spec.blocks_per_chunk:
        return tail.tail_hash
    return short_chunk_hash(tail.tail_hash, tail.num_blocks)
