"""This engine's chunks in vLLM's KV event stream (`KVConnectorBase_V1.take_events`).

When vLLM publishes KV events (`--kv-events-config`), a router learns from them which blocks an
engine holds on its GPU. This module adds the blocks the daemon holds for the engine, so a router
can send a returning conversation to the engine whose daemon still has it:

- the scheduler calls `track` for every chunk it plans to store, with what vLLM's own events
  carry for its blocks (block hashes, the parent block's hash, token ids, LoRA, KV cache group);
- `take` follows the daemon's event log (KV_EVENTS requests, one in flight at a time, never
  waited for) and turns each stored / removed record of a tracked chunk into vLLM's
  `BlockStored` / `BlockRemoved`: medium "CPU" for the daemon's pool, "STORAGE" for its lower
  tiers (the tier's name in `ownership`, locality LOCAL for a disk, REMOTE for a network tier).

A chunk counts as held in a tier while rank 0's object is there and no rank's has left since
(a tensor-parallel engine needs every rank's). Whenever the engine's view may be wrong (the daemon
restarted, cleared, or its log overran this reader), every block announced is removed, then
announced again as the daemon re-announces what it holds: a router briefly under-counts, never
over-counts. Tracked chunks are bounded (MAX_TRACKED): past it, the oldest is forgotten (its
blocks removed from the stream).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.kv_events.log import CLEARED, STORED, ChunkEvent, EventsReply
from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import RequestType

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

logger = logging.getLogger(__name__)

MAX_TRACKED = 32_768  # chunks (8M tokens of 256-token chunks; ~1.5 KiB each)
POLL_INTERVAL_S = 0.01
EVENTS_PER_POLL = 8192

Residence = tuple[str, str, str | None]  # medium, locality, ownership


@dataclass
class _Chunk:
    """What vLLM's events say of one stored chunk's blocks, and where the daemon holds it."""

    group_idx: int
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None
    ranks: dict[Residence, set[int]] = field(default_factory=dict)  # ranks whose object is there
    lost: dict[Residence, set[int]] = field(default_factory=dict)  # ranks whose object left since
    announced: set[Residence] = field(default_factory=set)

    def usable(self, where: Residence) -> bool:
        return 0 in self.ranks.get(where, ()) and not self.lost.get(where)


class EngineEvents:
    """The scheduler's follower of the daemon's event log (see the module docstring)."""

    def __init__(self, block_size: int):
        self._block_size = block_size
        self._chunks: OrderedDict[tuple[str, bytes], _Chunk] = OrderedDict()  # (namespace, hash)
        self._models: set[str] = set()
        self._pending: list[KVCacheEvent] = []
        self._since = 0  # the daemon's log, from its start: tracked chunks are all this engine's
        self._epoch: int | None = None
        self._asked: MessagingFuture[EventsReply] | None = None
        self._next_poll = 0.0

    def track(self, namespace: str, group_idx: int, chunk_hash: bytes, block_hashes: list[bytes],
              parent_hash: bytes | None, token_ids: list[int], lora: object | None = None) -> None:
        """Remember a chunk this engine stores (keyed as the daemon keys it: `chunk_hash` in
        `namespace`), with its blocks' event payload."""
        self._models.add(namespace)
        key = (namespace, chunk_hash)
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return
        self._chunks[key] = _Chunk(group_idx, tuple(block_hashes), parent_hash, tuple(token_ids),
                                   getattr(lora, "lora_int_id", None), getattr(lora, "lora_name", None))
        while len(self._chunks) > MAX_TRACKED:
            _, oldest = self._chunks.popitem(last=False)
            self._retract(oldest)

    def take(self, client: MessageQueueClient | None) -> list[KVCacheEvent]:
        """The events gathered since the last call; asks the daemon for more (never waits)."""
        if client is not None:
            self._poll(client)
        events, self._pending = self._pending, []
        return events

    # ---- following the log -------------------------------------------------------------------

    def _poll(self, client: MessageQueueClient) -> None:
        asked = self._asked
        if asked is not None:
            if not (asked.done() or asked.query()):
                return
            self._asked = None
            self._settle(asked)
        if self._models and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + POLL_INTERVAL_S
            self._asked = client.submit(RequestType.KV_EVENTS, [self._since, sorted(self._models),
                                                                 EVENTS_PER_POLL])

    def _settle(self, asked: MessagingFuture[EventsReply]) -> None:
        try:
            reply = asked.result(0)
        except LMCacheMPError as err:
            logger.debug("KV_EVENTS failed (asked again later): %s", err)
            return
        if reply.epoch != self._epoch:
            if self._epoch is not None:  # a new daemon: its log starts again, from nothing
                self._retract_all()
                self._epoch, self._since = reply.epoch, 0
                return  # what it answered was read at the old daemon's seq: ask again from 0
            self._epoch = reply.epoch
        if reply.missed:
            logger.warning("the daemon's KV event log overran this engine's reader; re-announcing")
            self._retract_all()
        for event in reply.events:
            self._apply(event)
        self._since = reply.next_seq
        if reply.events:
            self._next_poll = 0.0  # more may be waiting

    def _apply(self, event: ChunkEvent) -> None:
        if event.kind == CLEARED:
            self._retract_all()
            return
        chunk = self._chunks.get((event.model_name, event.chunk_hash))
        if chunk is None:
            return  # another engine's chunk
        where = (event.medium, event.locality, event.ownership)
        was = chunk.usable(where)
        ranks, lost = chunk.ranks.setdefault(where, set()), chunk.lost.setdefault(where, set())
        if event.kind == STORED:
            ranks.add(event.rank)
            lost.discard(event.rank)
        else:
            ranks.discard(event.rank)
            lost.add(event.rank)
        if chunk.usable(where) and not was:
            chunk.announced.add(where)
            self._pending.append(self._stored(chunk, where))
        elif was and not chunk.usable(where):
            chunk.announced.discard(where)
            self._pending.append(self._removed(chunk, where))

    def _retract_all(self) -> None:
        for chunk in self._chunks.values():
            self._retract(chunk)

    def _retract(self, chunk: _Chunk) -> None:
        """Remove every announcement of `chunk` and forget where it was."""
        for where in sorted(chunk.announced, key=str):
            self._pending.append(self._removed(chunk, where))
        chunk.announced.clear()
        chunk.ranks.clear()
        chunk.lost.clear()

    # ---- vLLM's events -------------------------------------------------------------------------

    def _stored(self, chunk: _Chunk, where: Residence) -> KVCacheEvent:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        medium, locality, ownership = where
        parent = chunk.parent_hash
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in chunk.block_hashes],
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=list(chunk.token_ids), block_size=self._block_size, lora_id=chunk.lora_id,
            medium=medium, lora_name=chunk.lora_name, group_idx=chunk.group_idx, locality=locality,
            ownership=ownership)

    def _removed(self, chunk: _Chunk, where: Residence) -> KVCacheEvent:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        medium, locality, ownership = where
        return BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in chunk.block_hashes],
                            medium=medium, group_idx=chunk.group_idx, locality=locality,
                            ownership=ownership)
