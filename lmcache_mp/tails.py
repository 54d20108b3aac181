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

Bounded: at most `MAX_PER_ANCHOR` tails per anchor (the newest) and `MAX_ANCHORS` anchors (the
least recently noted or found go first). Memory only: after a restart, the tails the daemon
still holds (pool file, disk) are found again once a request notes them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from lmcache_mp.keys import short_chunk_hash
from lmcache_mp.protocol import TailHit
from lmcache_mp.storage.manager import RankSpec

MAX_PER_ANCHOR = 8
MAX_ANCHORS = 65_536

Anchor = tuple[str, int, bytes]  # (model, world size, the key of the chunk before the tail)


class TailIndex:
    """The tails noted per anchor, newest first. Thread-safe: NOTE_TAILS on the socket thread,
    LOOKUP_PREFIX there or on a promotion's reader thread."""

    def __init__(self, max_anchors: int = MAX_ANCHORS, max_per_anchor: int = MAX_PER_ANCHOR):
        self._max_anchors = max_anchors
        self._max_per_anchor = max_per_anchor
        self._lock = threading.Lock()
        self._tails: OrderedDict[Anchor, list[TailHit]] = OrderedDict()
        self.offered_total = 0  # tails a LOOKUP_PREFIX answered with (STATUS, /metrics)

    def note(self, anchor: Anchor, tail: TailHit) -> None:
        """A tail stored (or about to be) after `anchor`: the newest of its anchor."""
        with self._lock:
            tails = self._tails.pop(anchor, [])
            tails = [tail, *(t for t in tails if t.tail_hash != tail.tail_hash)][:self._max_per_anchor]
            self._tails[anchor] = tails
            while len(self._tails) > self._max_anchors:
                self._tails.popitem(last=False)

    def forget(self, anchor: Anchor, tail_hash: bytes) -> None:
        with self._lock:
            tails = self._tails.get(anchor)
            if tails is None:
                return
            tails[:] = [t for t in tails if t.tail_hash != tail_hash]
            if not tails:
                del self._tails[anchor]

    def after(self, anchor: Anchor) -> list[TailHit]:
        """The tails noted after `anchor`, newest first."""
        with self._lock:
            tails = self._tails.get(anchor)
            if tails is None:
                return []
            self._tails.move_to_end(anchor)
            return list(tails)

    def clear(self) -> None:
        with self._lock:
            self._tails.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._tails.values()))


def tail_identity(tail: TailHit, spec: RankSpec) -> bytes:
    """The identity a STORE gave `tail` on a rank of `spec`: a short chunk's (`keys.short_chunk`),
    unless the tail fills all of a chunk's blocks."""
    if tail.num_blocks >= spec.blocks_per_chunk:
        return tail.tail_hash
    return short_chunk_hash(tail.tail_hash, tail.num_blocks)
