"""STORE and RETRIEVE: a worker's blocks copied into the pool, and the pool's chunks into its blocks.

A STORE reserves the chunks the pool lacks, copies them out of the worker's blocks and commits
them, visible to LOOKUP only once every byte is in place; a RETRIEVE pins its chunks (all of them,
or it loads nothing), copies them into the worker's blocks, and spends the leases its LOOKUP took.
Both run under the transfer fence (`cancellation.py`): a worker's CANCEL_TRANSFERS stops them
between chunks, and a cancelled STORE commits nothing (its blocks may hold another request's KV by
then). The copies themselves are the registration's context's (`transfer/context.py`); on CUDA
they wait for the worker's interprocess event first, and are complete when the reply leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from lmcache_mp.chunks import PoolKey, pool_key
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine.cancellation import Pair, TransferFence
from lmcache_mp.engine.keys import ChunkMapper, OpChunks, check_keys_for, invalid, short_chunks
from lmcache_mp.engine.registry import Instance, Registry
from lmcache_mp.engine.sessions import SessionTable
from lmcache_mp.errors import FatalError, ServerError
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, RetrieveResult, StoreResult
from lmcache_mp.storage import PoolObject, ReserveFailure, Slot, StorageManager
from lmcache_mp.transfer.context import Copies, Lane, TransferContext
from lmcache_mp.transfer.threads import CopyThreads

_OUTCOMES = {ReserveFailure.ALREADY_PRESENT: ChunkOutcome.ALREADY_PRESENT,
             ReserveFailure.NO_SPACE: ChunkOutcome.NO_SPACE}
_CANCELLED = RetrieveResult(b"", False, "cancelled")


def _pairs(instance_id: int, request_ids: list[str | None]) -> set[Pair]:
    """What CANCEL_TRANSFERS names an operation by: (instance, request) of each of its chunks."""
    return {(instance_id, rid) for rid in request_ids if rid is not None}


def _store_cancelled() -> ServerError:
    return ServerError(ErrorCode.CANCELLED, "the STORE was cancelled by its worker (CANCEL_TRANSFERS): "
                                            "nothing of it was stored")


def _chunk_views(context: TransferContext, slots: Sequence[Slot]) -> list[tuple[int, torch.Tensor]]:
    """(position, `chunk_view`) of each slot that is an object, made before any copy: a torch call
    right after a chunk's copy runs with the caches that copy flushed, and costs several times more."""
    return [(i, context.chunk_view(slot.data)) for i, slot in enumerate(slots)
            if isinstance(slot, PoolObject)]


@contextmanager
def _operation(context: TransferContext, block_ids: list[int], event_handle: bytes,
               lane: Lane, chunk_blocks: list[int] | None) -> Iterator[Copies]:
    """An operation's copies (see `TransferContext.operation`), with its failures typed. The reply
    is the completion signal: every copy is done when this exits."""
    try:
        with context.operation(block_ids, event_handle, lane, chunk_blocks) as copies:
            yield copies
    except ValueError as err:
        raise invalid(str(err)) from None
    except torch.OutOfMemoryError:
        # The device is full (vLLM's own headroom): this request fails, the daemon serves on.
        raise ServerError(ErrorCode.OVERLOADED, f"no device memory left on {context.device} for this "
                                                "copy's block ids; try again later") from None


class Transfers:
    """STORE, RETRIEVE and CANCEL_TRANSFERS over the engine's registrations, storage and sessions
    (module docstring). `reset_since_arrival(model)`: whether that model's KV was reset after the
    running request arrived (the engine's RESET_MODEL): its STORE then stores nothing."""

    def __init__(self, registry: Registry, storage: StorageManager, sessions: SessionTable, keys: ChunkMapper,
                 fence: TransferFence, copy_threads: CopyThreads, metrics: Metrics,
                 reset_since_arrival: Callable[[str], bool]):
        self.registry = registry
        self.storage = storage
        self.sessions = sessions
        self.keys = keys
        self.fence = fence
        self.copy_threads = copy_threads
        self.metrics = metrics
        self._reset_since_arrival = reset_since_arrival

    def store(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
              event_handle: bytes) -> StoreResult:
        instance = self.registry.instance(instance_id)
        check_keys_for(instance.registration, keys)
        chunks, chunk_blocks = self._op_chunks(keys, instance.context, block_ids, allow_skip=False)
        if not chunks.hashes:
            raise invalid(f"STORE: its keys name no chunk (no key, or token ranges shorter than a chunk "
                          f"of {self.keys.chunk_size} tokens): nothing to store")
        pairs = _pairs(instance_id, chunks.request_ids)
        if not self._begin(instance, pairs):
            raise _store_cancelled()
        try:
            slots = self._copy_in(instance, chunks, chunk_blocks, block_ids, event_handle, pairs)
        finally:
            self.fence.end(pairs)  # after the commit: a CANCEL answered now finds it stored or not
        outcomes = [ChunkOutcome.STORED if isinstance(s, PoolObject) else _OUTCOMES[s] for s in slots]
        self.metrics.stored(outcomes, instance.context.chunk_nbytes)
        return StoreResult(b"", outcomes)

    def held(self, keys: list[IPCCacheEngineKey], instance_id: int) -> list[bool]:
        """Which chunks of a STORE's keys the pool holds already: a worker may skip copying them."""
        instance = self.registry.instance(instance_id)
        check_keys_for(instance.registration, keys)
        return self.storage.holds(instance.fmt, self.keys.op_chunks(keys, lookup=False).hashes)

    def _begin(self, instance: Instance, pairs: set[Pair]) -> bool:
        """`fence.begin` for an operation on `instance`'s blocks, which must still be registered
        once let in: a dropped instance's cancels are forgotten (`TransferFence.forget_instance`),
        so one dropped since this operation looked it up must not have it start now."""
        if not self.fence.begin(pairs):
            return False
        if pairs and not self.registry.current(instance):
            self.fence.end(pairs)
            raise ServerError(ErrorCode.UNKNOWN_INSTANCE, f"instance {instance.instance_id} was "
                                                          "unregistered while this request waited")
        return True

    def _copy_in(self, instance: Instance, chunks: OpChunks, chunk_blocks: list[int] | None,
                 block_ids: list[int], event_handle: bytes, pairs: set[Pair]) -> list[Slot]:
        """Copy the chunks the pool lacks out of the worker's blocks, then publish them, or none
        of them if the store is cancelled meanwhile (its blocks may hold another request's KV)."""
        request_id = chunks.request_ids[0] if chunks.request_ids else None
        parent = chunks.parent
        if parent is None and request_id is not None:
            parent = self.sessions.last_chunk(request_id)  # the chunk it looked up or stored last
        context = instance.context
        slots = self.storage.reserve(instance.fmt, chunks.hashes, context.chunk_nbytes, parent)
        fresh = [slot for slot in slots if isinstance(slot, PoolObject)]
        if self._reset_since_arrival(instance.fmt.model_name):
            # After the reserve: a reset that began before it is seen here, one that begins after
            # it finds the slots WRITING and frees them at their commit (`pool/drop.py`).
            self.storage.abort(fresh)
            return [ReserveFailure.ALREADY_PRESENT] * len(slots)
        try:
            # Nothing fresh (every chunk present already, or no room): no copy, and no wait for
            # the worker's event, which holds the store lane while its forward pass runs.
            if fresh:
                with (self.copy_threads.seat(), self.storage.copying(),
                      _operation(context, block_ids, event_handle, Lane.STORE, chunk_blocks) as copies):
                    for i, chunk in _chunk_views(context, slots):
                        if pairs and self.fence.cancelled(pairs):
                            raise _store_cancelled()
                        copies.gather(i, chunk)
            if pairs and self.fence.cancelled(pairs):
                raise _store_cancelled()
        except FatalError:
            raise  # copies may still be writing into `fresh`: never hand them out (the daemon exits)
        except BaseException:
            self.storage.abort(fresh)
            raise
        # Visible to LOOKUP only now, with every byte in place; then queued for lower tiers.
        self.storage.commit_store(instance.fmt, chunks.hashes, slots, parent)
        if request_id is not None and chunks.hashes:
            self.sessions.remember(request_id, chunks.hashes[-1])
        return slots

    def retrieve(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
                 event_handle: bytes) -> RetrieveResult:
        pool_keys: list[PoolKey] | None = None
        request_ids: list[str | None] = []
        try:
            instance = self.registry.instance(instance_id)
            check_keys_for(instance.registration, keys)
            context = instance.context
            chunks, chunk_blocks = self._op_chunks(keys, context, block_ids, allow_skip=True)
            request_ids = chunks.request_ids
            pool_keys = [pool_key(h, instance.fmt) for h in chunks.hashes]
            pairs = _pairs(instance_id, request_ids)
            if not self._begin(instance, pairs):
                return _CANCELLED
            try:
                return self._copy_out(context, pool_keys, chunk_blocks, block_ids, event_handle, pairs)
            finally:
                self.fence.end(pairs)
        finally:
            # Whatever happened, the leases this retrieve was for are spent, errors before the
            # copy included (an unknown instance, bad block ids, keys of another model).
            self._spend_leases(keys, request_ids, pool_keys)

    def _copy_out(self, context: TransferContext, pool_keys: list[PoolKey], chunk_blocks: list[int] | None,
                  block_ids: list[int], event_handle: bytes, pairs: set[Pair]) -> RetrieveResult:
        """Copy the chunks (all of them, from L1, or none) into the worker's blocks; stop
        between chunks once the retrieve is cancelled (the worker treats it as failed)."""
        objects = self.storage.pin(pool_keys)
        self.metrics.retrieved(len(pool_keys), objects is not None, context.chunk_nbytes)
        if objects is None:
            return RetrieveResult(b"", False, "some chunks are no longer stored (evicted, "
                                              "cleared, or stored by another kind of cache)")

        chunks = [chunk for _, chunk in _chunk_views(context, objects)]

        def copy(i: int) -> bool:
            if pairs and self.fence.cancelled(pairs):
                return False  # stop between chunks: the CANCEL waits for every thread to stop
            copies.scatter(chunks[i], i)
            return True

        try:
            with (self.copy_threads.seat(), self.storage.copying(),
                  _operation(context, block_ids, event_handle, Lane.LOAD, chunk_blocks) as copies):
                # Split over free copy threads: the request waits for these copies, and one
                # thread does not use all the memory bandwidth (transfer/threads.py).
                self.copy_threads.run(len(objects), copy, split=copies.splittable)
        finally:
            self.storage.unpin(objects)
        return _CANCELLED if pairs and self.fence.cancelled(pairs) else RetrieveResult(b"", True)

    def _spend_leases(self, keys: list[IPCCacheEngineKey], request_ids: list[str | None],
                      pool_keys: list[PoolKey] | None) -> None:
        """Release a retrieve's leases: its chunks', one release per request (each unpin
        refreshes the chain's recency, so not one per chunk); or, when the request failed before
        its chunks were known, every lease of the requests its keys name."""
        if pool_keys is None:
            for request_id in {key.request_id for key in keys if key.request_id is not None}:
                self.sessions.release_all(request_id)
            return
        by_request: dict[str | None, list[PoolKey]] = {}
        for request_id, key in zip(request_ids, pool_keys, strict=True):
            by_request.setdefault(request_id, []).append(key)
        for request_id, request_keys in by_request.items():
            self.sessions.release(request_id, request_keys)

    def cancel_transfers(self, instance_id: int, request_ids: list[str]) -> int | Future[int]:
        """CANCEL_TRANSFERS (see protocol.py); a Future while transfers of these requests copy."""
        # Only the instance's own connection may cancel its transfers; one not registered
        # (any more) can start none, so nothing is recorded for it (engine/cancellation.py).
        return self.fence.cancel(instance_id, request_ids, record=self.registry.owned(instance_id))

    def _op_chunks(self, keys: list[IPCCacheEngineKey], context: TransferContext, block_ids: list[int],
                   allow_skip: bool) -> tuple[OpChunks, list[int] | None]:
        """The chunks a STORE's or RETRIEVE's keys cover, short ones known by their own identity
        (`keys.short_chunks`), and each chunk's block count (None: all whole), checked against
        the block ids."""
        chunks, chunk_blocks = short_chunks(self.keys.op_chunks(keys, lookup=False), context.blocks_per_chunk)
        try:
            context.check_block_ids(block_ids, chunk_blocks, len(chunks.hashes), allow_skip)
        except ValueError as err:
            raise invalid(str(err)) from None
        return chunks, chunk_blocks
