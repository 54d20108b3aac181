"""LMCache's `engine_driven` mode through the lmcache door: its worker copies its KV itself, into and
out of a staging segment of its registration's own (`staging.py`), never pickled.

- register_kv_cache_engine_driven_context: a staging segment for the worker's chunks, registered with
  the engine as a cache of `slots` blocks of one chunk each (`segments.SegmentContext` over it), so
  that a chunk is stored and loaded by the engine's own STORE and RETRIEVE, and keyed by the format
  of LMCache's chunk layout (its own layout name: never mixed with any other registration's chunks).
- prepare_store: slots for the key's chunks but the leading ones the pool holds already (their
  worker copies only the rest); commit_store: the engine's STORE from those slots (its data must be
  empty: a pickled payload is refused, never loaded); the slots are free again after.
- prepare_retrieve: slots for every chunk of the key, filled by the engine's RETRIEVE (all or none:
  its worker would load what it is given and report the rest loaded too); commit_retrieve frees them.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from lmcache_mp.config import ServerConfig
from lmcache_mp.engine.dispatch import PEER
from lmcache_mp.lmcache_door import wire
from lmcache_mp.lmcache_door.keys import Refusal, engine_keys
from lmcache_mp.lmcache_door.liveness import Registrations, rank_binder
from lmcache_mp.lmcache_door.staging import Staging, TransferKey

if TYPE_CHECKING:
    from lmcache_mp.engine.engine import Engine

logger = logging.getLogger(__name__)

LAYOUT = "LMCACHE_ENGINE_DRIVEN"  # the chunks' layout name: LMCache's chunk layout, as its worker writes it


class EngineDriven:
    """The engine-driven operations (module docstring), beside the door's own."""

    def __init__(self, config: ServerConfig, engine: Callable[[], Engine], registrations: Registrations,
                 before_store: Callable[[wire.Key], None]):
        """`before_store(key)`: told of each key about to be stored (the KV events' names of its chunks)."""
        self._chunk_size = config.chunk_size
        self._engine = engine
        self._registrations = registrations
        self._before_store = before_store

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"register_kv_cache_engine_driven_context": self.register,
                "unregister_kv_cache_engine_driven_context": self.unregister,
                "prepare_store": self.prepare_store, "commit_store": self.commit_store,
                "prepare_retrieve": self.prepare_retrieve, "commit_retrieve": self.commit_retrieve}

    # ---- registration -------------------------------------------------------------------------------

    def register(self, payload: wire.EngineDrivenRegistration) -> dict[str, Any]:
        engine = self._engine()
        known = self._registrations.refresh(payload.instance_id, PEER.get())
        if known is not None and known.staging is not None:
            return _registered(known.staging)  # its worker registers again: the same segment
        self._registrations.check_room()
        shape, pool_bytes = self._chunk_shape(payload), engine.storage.pool_stats().capacity_bytes
        chunk_nbytes = math.prod(shape) * wire.DTYPE_SIZES[payload.dtype_str]
        if chunk_nbytes > pool_bytes:
            raise Refusal(f"chunks of {chunk_nbytes} bytes: larger than the pool ({pool_bytes} bytes)")
        staging = Staging.create(shape, payload.dtype_str, pool_bytes)
        try:
            self._registrations.add(payload.instance_id, PEER.get(), [], staging,
                                    self._binder(engine, payload, staging), payload.world_size)
        except BaseException:
            staging.remove()
            raise
        logger.info("lmcache door: registered instance %d (%s, engine_driven: chunks of %d bytes, %d "
                    "staging slots in %s)", payload.instance_id, payload.model_name, staging.chunk_nbytes,
                    staging.slots, staging.name)
        return _registered(staging)

    def _chunk_shape(self, payload: wire.EngineDrivenRegistration) -> tuple[int, ...]:
        """The shape of the worker's chunks; Refusal for chunks this daemon does not serve."""
        if payload.dtype_str not in wire.DTYPE_SIZES:
            raise Refusal(f"dtype {payload.dtype_str!r} is not one this daemon copies")
        tokens = payload.num_physical_slots or self._chunk_size
        if tokens != self._chunk_size or self._chunk_size % payload.block_size:
            raise Refusal(f"chunks of {tokens} tokens in blocks of {payload.block_size}: this daemon's "
                          f"chunks are {self._chunk_size} tokens (the chunk size its worker asked for)")
        layers_and_tokens = (payload.num_layers, tokens, payload.hidden_dim_size)
        return layers_and_tokens if payload.use_mla else (2, *layers_and_tokens)

    def _binder(self, engine: Engine, payload: wire.EngineDrivenRegistration,
                staging: Staging) -> Callable[[int], None]:
        """What registers the staging segment with the engine as a rank's cache of `staging.slots`
        one-chunk blocks (at once for one rank; at the first transfer naming its rank otherwise)."""
        from lmcache_mp.lmcache_door.segments import Segment, SegmentContext

        segment = Segment(staging.name, staging.fd, staging.nbytes, staging.identity)
        try:  # from here on, the context closes the descriptor once dropped
            context = SegmentContext([staging.descriptor()], {staging.name: segment}, LAYOUT, None,
                                     self._chunk_size, self._chunk_size)
        except BaseException:
            os.close(staging.fd)
            raise
        return rank_binder(engine, payload.instance_id, payload.model_name, payload.world_size, context,
                           LAYOUT, self._chunk_size)

    def unregister(self, instance_id: int) -> None:
        self._engine().unregister(instance_id)  # refused (FORBIDDEN) from another connection
        self._registrations.forget(instance_id)

    # ---- transfers ----------------------------------------------------------------------------------

    def prepare_store(self, key: wire.Key, instance_id: int) -> dict[str, Any]:
        staging = self._staging(instance_id, key)
        chunks = self._chunks(key)
        first = self._held_ahead(key, instance_id, chunks)
        if first == chunks:  # every chunk held already (or none to store): its worker copies nothing
            return {"context": {"slots": [], "chunk_indices": []}}
        slots = staging.reserve(_transfer("store", key), chunks - first, first)
        if not slots:
            raise Refusal(f"all {staging.slots} staging slots of instance {instance_id} are in use")
        # Fewer slots than chunks: the leading chunks are stored (a later chunk is no use without them).
        return {"context": {"slots": staging.slot_descriptors(slots),
                            "chunk_indices": list(range(first, first + len(slots)))}}

    def _held_ahead(self, key: wire.Key, instance_id: int, chunks: int) -> int:
        """How many of the key's leading chunks the pool holds already: its worker need not copy
        them (LMCache's server skips the chunks it holds too). A chunk held after a missing one is
        copied again, so that what is stored stays one piece of its chain; one evicted before the
        commit is a miss later, never wrong KV."""
        if not chunks:
            return 0
        try:
            keys = engine_keys(key, self._chunk_size, lookup=False)
            held = self._engine().transfers.held(keys, instance_id)
        except Exception:  # the commit then refuses what is wrong with the key: copy them all
            return 0
        return next((i for i, present in enumerate(held[:chunks]) if not present), min(len(held), chunks))

    def commit_store(self, key: wire.Key, instance_id: int, data: bytes) -> bool:
        transfer = _transfer("store", key)
        if data:  # refused first, whoever sends it: never looked into
            staging = self._own_staging(instance_id)
            if staging is not None:
                # Its worker sent the bytes inline instead: the slots it was given are free again.
                staging.release(transfer)
            raise Refusal(f"a commit_store carrying {len(data)} bytes (pickled tensors, which this daemon "
                          "never loads): its worker writes into the staging segment its registration names")
        staging = self._staging(instance_id, key)
        held = staging.held(transfer)
        if held is None:
            raise Refusal("a commit_store without its prepare_store (or after its slots were taken back)")
        first, slots = held
        try:
            start = key.start + first * self._chunk_size
            stored = msgspec.structs.replace(key, start=start, end=start + len(slots) * self._chunk_size)
            self._before_store(stored)
            keys = engine_keys(stored, self._chunk_size, lookup=False)
            self._engine().transfers.store(keys, instance_id, slots, b"")
        finally:
            staging.release(transfer, slots)
        return True

    def prepare_retrieve(self, key: wire.Key, instance_id: int) -> dict[str, Any]:
        staging = self._staging(instance_id, key)
        transfer = _transfer("retrieve", key)
        chunks = self._chunks(key)
        slots = staging.reserve(transfer, chunks)
        try:
            if len(slots) < chunks:
                raise Refusal(f"a load of {chunks} chunks, {len(slots)} of instance {instance_id}'s "
                              f"{staging.slots} staging slots free")
            keys = engine_keys(key, self._chunk_size, lookup=False)
            result = self._engine().transfers.retrieve(keys, instance_id, slots, b"")
            if not result.ok:
                raise Refusal(f"the retrieve loaded nothing: {result.reason}")
        except BaseException:
            staging.release(transfer, slots)
            raise
        return {"success": True, "data": b"", "context": {"slots": staging.slot_descriptors(slots)}}

    def commit_retrieve(self, key: wire.Key, instance_id: int) -> bool:
        return self._staging(instance_id, key).release(_transfer("retrieve", key)) is not None

    def _staging(self, instance_id: int, key: wire.Key) -> Staging:
        """The staging segment of the request's own engine-driven registration, bound to `key`'s rank
        (`liveness.py`); Refusal otherwise."""
        staging = self._own_staging(instance_id)
        if staging is None:
            raise Refusal(f"no engine-driven registration of instance {instance_id} on this connection")
        self._registrations.transferred(instance_id, PEER.get(), key.worker_id)
        return staging

    def _own_staging(self, instance_id: int) -> Staging | None:
        registration = self._registrations.get(instance_id)
        if registration is None or registration.owner != PEER.get():
            return None
        return registration.staging

    def _chunks(self, key: wire.Key) -> int:
        """The whole chunks of the key's range, which must start on a chunk."""
        if key.start % self._chunk_size or key.end < key.start:
            raise Refusal(f"a range [{key.start}, {key.end}) that does not start on a chunk of "
                          f"{self._chunk_size} tokens")
        return (key.end - key.start) // self._chunk_size


def _registered(staging: Staging) -> dict[str, Any]:
    """LMCache's `RegisterEngineDrivenContextResponse`: the segment its worker maps."""
    return {"shm_name": staging.name, "pool_size": staging.nbytes}


def _transfer(kind: str, key: wire.Key) -> TransferKey:
    return kind, key.request_id, key.start, key.end
