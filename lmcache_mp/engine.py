"""The daemon's semantics: LOOKUP / STORE / RETRIEVE / RELEASE_LEASES / END_SESSION / CLEAR.

A chunk is keyed by `(chunk hash, fingerprint)`, where the fingerprint is the registering
worker's `ChunkFormat` (model, world size, rank, layout, dtype, geometry, chunk size): bytes
stored by one kind of cache are never read into another, and a doubtful chunk is a miss.

The engine holds no storage of its own: registrations live in `registry.py`, chunks in the
storage manager (L1 pool and lower tiers), pins taken by a LOOKUP in `leases.py`. Copies run
outside every lock, on the server's worker threads.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from lmcache_mp.cancellation import Pair, TransferFence
from lmcache_mp.config import ServerConfig
from lmcache_mp.custom_types import IPCCacheEngineKey, KVCache
from lmcache_mp.errors import FatalError, ServerError
from lmcache_mp.keys import ChunkMapper, OpChunks, check_keys_for, check_same_model, invalid
from lmcache_mp.leases import LeaseTable
from lmcache_mp.observability import Metrics
from lmcache_mp.protocol import (
    ChunkOutcome,
    ErrorCode,
    KVCacheRegistration,
    RegisterReply,
    ReplyThen,
    RetrieveResult,
    StoreResult,
)
from lmcache_mp.registry import Instance, Registry
from lmcache_mp.storage.base import TierCleared
from lmcache_mp.storage.manager import Hits, StorageManager
from lmcache_mp.storage.pool import MemoryPool, PoolObject, ReserveFailure
from lmcache_mp.storage.tiers import open_tier, redact_url
from lmcache_mp.transfer import cuda
from lmcache_mp.transfer.context import Copies, Lane, TransferContext
from lmcache_mp.transfer.threads import CopyThreads

_OUTCOMES = {ReserveFailure.ALREADY_PRESENT: ChunkOutcome.ALREADY_PRESENT,
             ReserveFailure.NO_SPACE: ChunkOutcome.NO_SPACE}
# Requests whose last chunk (looked up or stored) is remembered, so the next STORE of the
# same request can link its first chunk to it (prefix-aware eviction). Bounded, oldest out.
_MAX_REMEMBERED_REQUESTS = 65_536
_CANCELLED = RetrieveResult(b"", False, "cancelled")


def _pairs(instance_id: int, request_ids: list[str | None]) -> set[Pair]:
    """What CANCEL_TRANSFERS names an operation by: (instance, request) of each of its chunks."""
    return {(instance_id, rid) for rid in request_ids if rid is not None}


def _store_cancelled() -> ServerError:
    return ServerError(ErrorCode.CANCELLED, "the STORE was cancelled by its worker (CANCEL_TRANSFERS): "
                                            "nothing of it was stored")


@contextmanager
def _operation(context: TransferContext, block_ids: list[int], event_handle: bytes,
               lane: Lane) -> Iterator[Copies]:
    """An operation's copies (see `TransferContext.operation`), with its failures typed. The reply
    is the completion signal: every copy is done when this exits."""
    try:
        with context.operation(block_ids, event_handle, lane) as copies:
            yield copies
    except ValueError as err:
        raise invalid(str(err)) from None
    except torch.OutOfMemoryError:
        # The device is full (vLLM's own headroom): this request fails, the daemon serves on.
        raise ServerError(ErrorCode.OVERLOADED, f"no device memory left on {context.device} for this "
                                                "copy's block ids; try again later") from None


class Engine:
    def __init__(self, config: ServerConfig, metrics: Metrics):
        self.chunk_size = config.chunk_size
        self.metrics = metrics
        # Page-aligned objects: the disk tier writes them with direct I/O, straight from the pool.
        # Its memory is prepared in the background: the daemon answers at once for any pool size.
        pool = MemoryPool(int(config.l1_size_gb * 2**30), align=mmap.PAGESIZE, background=True,
                          pin=cuda.register_host_memory if torch.cuda.is_available() else None)
        tiers = []
        try:
            for url in config.l2:
                tiers.append((redact_url(url), open_tier(url)))
        except BaseException:
            for _, tier in tiers:
                tier.close()
            pool.close()
            raise
        self.storage = StorageManager(pool, tiers, int(config.write_queue_gb * 2**30))
        self.leases = LeaseTable(pool, config.lease_ttl_s)
        self.fence = TransferFence(config.queue_deadline_s)
        self.keys = ChunkMapper(config.chunk_size)
        self.copy_threads = CopyThreads(config.max_workers)
        self._last_chunk: OrderedDict[str, bytes] = OrderedDict()  # request id -> chunk hash
        # Requests with a LOOKUP in promotion -> whether END_SESSION came meanwhile (bounded by
        # the manager's bound on promotions in flight).
        self._deferred: dict[str, bool] = {}
        self._ending = threading.Lock()  # guards `_deferred`, and orders END_SESSION and leases
        self._lock = threading.Lock()
        try:
            self.registry = Registry(config.attach_socket, config.socket_access, config.chunk_size,
                                     pool.admit)
        except BaseException:
            self.copy_threads.close()
            self.storage.close()
            pool.close()
            raise

    def close(self) -> None:
        self.registry.close()
        self.copy_threads.close()
        self.storage.close()
        self.storage.pool.close()  # last: the tiers' writers copy out of the pool until closed

    def register(self, instance_id: int, kv_caches: KVCache, reg: KVCacheRegistration) -> RegisterReply:
        return self.registry.register(instance_id, kv_caches, reg)

    def unregister(self, instance_id: int) -> bool:
        return self.registry.unregister(instance_id)

    # ---- LOOKUP -------------------------------------------------------------------------------

    def lookup(self, keys: list[IPCCacheEngineKey]) -> int | ReplyThen | Future[int]:
        """Leading chunks present on every rank (in any tier); the hits are leased to the keys'
        request. A Future when chunks must first be promoted from a lower tier."""
        if not keys:
            return 0
        model, world_size = check_same_model(keys)
        return self._lookup(model, world_size, keys[0].request_id, self.keys.lookup_hashes(keys))

    def lookup_chunks(self, model: str, world_size: int, request_id: str | None,
                      chunk_hashes: list[bytes]) -> int | ReplyThen | Future[int]:
        """LOOKUP_CHUNKS: `lookup` of one hash-mode key per chunk hash."""
        if not all(chunk_hashes):
            raise invalid("LOOKUP_CHUNKS: a chunk hash is empty")
        return self._lookup(model, world_size, request_id, chunk_hashes)

    def _lookup(self, model: str, world_size: int, request_id: str | None,
                hashes: list[bytes]) -> int | ReplyThen | Future[int]:
        if not hashes:
            return 0
        combos = self.registry.format_combos(model, world_size)
        if not combos:
            return 0  # some rank has no registered cache: nothing could be retrieved
        hits = self.storage.lookup(hashes, combos)
        if isinstance(hits, list):
            # The hits are pinned already: nothing can evict them before the lease is recorded,
            # right after the reply (and before any later request, END_SESSION included, is read).
            return ReplyThen(len(hits), lambda: self._lease(request_id, hashes, hits, world_size))
        if request_id is not None:
            with self._ending:
                self._deferred[request_id] = False
        answer: Future[int] = Future()

        def finish(done: Future[Hits]) -> None:
            # Under `_ending` from the check to the lease: an END_SESSION between them would
            # find no leases yet, and these would then be held until their TTL.
            with self._ending:
                ended = request_id is not None and self._deferred.pop(request_id, False)
                if done.cancelled():  # the daemon is stopping: the server answers SHUTTING_DOWN
                    answer.cancel()
                    return
                try:
                    # A request ended while its hits were read has no one left to retrieve them.
                    found = self._lease(None if ended else request_id, hashes, done.result(), world_size)
                except BaseException as err:
                    answer.set_exception(err)
                    return
            answer.set_result(found)

        hits.add_done_callback(finish)
        return answer

    def _lease(self, request_id: str | None, hashes: list[bytes], hits: Hits, world_size: int) -> int:
        objects = [o for chunk in hits for o in chunk]
        self.metrics.looked_up(len(hashes), len(hits))
        if request_id is None:
            self.storage.unpin(objects)  # nobody to retrieve them: count, but lease nothing
        elif hits:  # a miss opens no session: END_SESSION would find nothing to release
            # A replicated cache's ranks share each chunk (one object for them all, pinned once by
            # the lookup): every rank's RETRIEVE spends a pin of its own, so each gets one.
            shares = world_size // len(hits[0])
            if shares > 1:
                self.storage.pool.repin(objects * (shares - 1))
                objects *= shares
            self.leases.add(request_id, objects)
            self._remember(request_id, hashes[len(hits) - 1])
        return len(hits)

    # ---- STORE / RETRIEVE ---------------------------------------------------------------------

    def store(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
              event_handle: bytes) -> StoreResult:
        instance = self.registry.instance(instance_id)
        check_keys_for(instance.registration, keys)
        chunks = self.keys.op_chunks(keys, lookup=False)
        self._check_block_ids(instance.context, block_ids, len(chunks.hashes), allow_skip=False)
        pairs = _pairs(instance_id, chunks.request_ids)
        if not self.fence.begin(pairs):
            raise _store_cancelled()
        try:
            slots = self._copy_in(instance, chunks, block_ids, event_handle, pairs)
        finally:
            self.fence.end(pairs)  # after the commit: a CANCEL answered now finds it stored or not
        outcomes = [ChunkOutcome.STORED if isinstance(s, PoolObject) else _OUTCOMES[s] for s in slots]
        self.metrics.stored(outcomes, instance.context.chunk_nbytes)
        return StoreResult(b"", outcomes)

    def _copy_in(self, instance: Instance, chunks: OpChunks, block_ids: list[int], event_handle: bytes,
                 pairs: set[Pair]) -> list[PoolObject | ReserveFailure]:
        """Copy the chunks the pool lacks out of the worker's blocks, then publish them, or none
        of them if the store is cancelled meanwhile (its blocks may hold another request's KV)."""
        request_id = chunks.request_ids[0] if chunks.request_ids else None
        parent = chunks.parent
        if parent is None and request_id is not None:
            parent = self._recall(request_id)  # the chunk this request looked up or stored last
        context = instance.context
        slots = self.storage.reserve(instance.fmt, chunks.hashes, context.chunk_nbytes, parent)
        fresh = [slot for slot in slots if isinstance(slot, PoolObject)]
        try:
            # Nothing fresh (every chunk present already, or no room): no copy, and no wait for
            # the worker's event, which holds the store lane while its forward pass runs.
            if fresh:
                with (self.copy_threads.seat(), self.storage.copying(),
                      _operation(context, block_ids, event_handle, Lane.STORE) as copies):
                    for i, slot in enumerate(slots):
                        if pairs and self.fence.cancelled(pairs):
                            raise _store_cancelled()
                        if isinstance(slot, PoolObject):
                            copies.gather(i, context.chunk_view(slot.data))
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
            self._remember(request_id, chunks.hashes[-1])
        return slots

    def retrieve(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
                 event_handle: bytes) -> RetrieveResult:
        pool_keys: list[tuple[bytes, bytes]] | None = None
        request_ids: list[str | None] = []
        try:
            instance = self.registry.instance(instance_id)
            check_keys_for(instance.registration, keys)
            chunks = self.keys.op_chunks(keys, lookup=False)
            request_ids = chunks.request_ids
            context = instance.context
            self._check_block_ids(context, block_ids, len(chunks.hashes), allow_skip=True)
            pool_keys = [instance.pool_key(h) for h in chunks.hashes]
            pairs = _pairs(instance_id, request_ids)
            if not self.fence.begin(pairs):
                return _CANCELLED
            try:
                return self._copy_out(context, pool_keys, block_ids, event_handle, pairs)
            finally:
                self.fence.end(pairs)
        finally:
            # Whatever happened, the leases this retrieve was for are spent, errors before the
            # copy included (an unknown instance, bad block ids, keys of another model).
            self._spend_leases(keys, request_ids, pool_keys)

    def _copy_out(self, context: TransferContext, pool_keys: list[tuple[bytes, bytes]], block_ids: list[int],
                  event_handle: bytes, pairs: set[Pair]) -> RetrieveResult:
        """Copy the chunks (all of them, from L1, or none) into the worker's blocks; stop
        between chunks once the retrieve is cancelled (the worker treats it as failed)."""
        objects = self.storage.pin(pool_keys)
        self.metrics.retrieved(len(pool_keys), objects is not None, context.chunk_nbytes)
        if objects is None:
            return RetrieveResult(b"", False, "some chunks are no longer stored (evicted, "
                                              "cleared, or stored by another kind of cache)")

        def copy(i: int) -> bool:
            if pairs and self.fence.cancelled(pairs):
                return False  # stop between chunks: the CANCEL waits for every thread to stop
            copies.scatter(context.chunk_view(objects[i].data), i)
            return True

        try:
            with (self.copy_threads.seat(), self.storage.copying(),
                  _operation(context, block_ids, event_handle, Lane.LOAD) as copies):
                # Split over free copy threads: the request waits for these copies, and one
                # thread does not use all the memory bandwidth (transfer/threads.py).
                self.copy_threads.run(len(objects), copy, split=copies.splittable)
        finally:
            self.storage.unpin(objects)
        return _CANCELLED if pairs and self.fence.cancelled(pairs) else RetrieveResult(b"", True)

    def _spend_leases(self, keys: list[IPCCacheEngineKey], request_ids: list[str | None],
                      pool_keys: list[tuple[bytes, bytes]] | None) -> None:
        """Release a retrieve's leases: its chunks', one release per request (each unpin
        refreshes the chain's recency, so not one per chunk); or, when the request failed before
        its chunks were known, every lease of the requests its keys name."""
        if pool_keys is None:
            for request_id in {key.request_id for key in keys if key.request_id is not None}:
                self.leases.end(request_id)
            return
        by_request: dict[str | None, list[tuple[bytes, bytes]]] = {}
        for request_id, pool_key in zip(request_ids, pool_keys, strict=True):
            by_request.setdefault(request_id, []).append(pool_key)
        for request_id, request_keys in by_request.items():
            self.leases.release(request_id, request_keys)

    def cancel_transfers(self, instance_id: int, request_ids: list[str]) -> int | Future[int]:
        """CANCEL_TRANSFERS (see protocol.py); a Future while transfers of these requests copy."""
        # Only the instance's own connection may cancel its transfers; one not registered
        # (any more) can start none, so nothing is recorded for it (cancellation.py).
        return self.fence.cancel(instance_id, request_ids, record=self.registry.owned(instance_id))

    # ---- RELEASE_LEASES, END_SESSION, CLEAR, maintenance -------------------------------------

    def release_leases(self, keys: list[IPCCacheEngineKey]) -> None:
        """Release the leases the keys' requests hold on the chunks the keys name (on every rank):
        chunks a request will not retrieve need not stay pinned until its END_SESSION."""
        chunks = self.keys.op_chunks(keys, lookup=False)
        by_request: dict[str, set[bytes]] = {}
        for request_id, chunk_hash in zip(chunks.request_ids, chunks.hashes, strict=True):
            if request_id is not None:  # keys without a request id lease nothing
                by_request.setdefault(request_id, set()).add(chunk_hash)
        for request_id, hashes in by_request.items():
            self.leases.release_chunks(request_id, hashes)

    def end_session(self, request_id: str) -> None:
        with self._ending:  # ordered against a deferred LOOKUP's lease (see `_lookup`)
            if request_id in self._deferred:
                self._deferred[request_id] = True
            self.leases.end(request_id)
        with self._lock:
            self._last_chunk.pop(request_id, None)

    def clear(self) -> int:
        return self.storage.clear()

    def clear_tiers(self) -> list[TierCleared]:
        return self.storage.clear_tiers()

    def tick(self) -> None:
        self.leases.expire()

    # ---- helpers -----------------------------------------------------------------------------

    def _remember(self, request_id: str, chunk_hash: bytes) -> None:
        with self._lock:
            self._last_chunk[request_id] = chunk_hash
            self._last_chunk.move_to_end(request_id)
            if len(self._last_chunk) > _MAX_REMEMBERED_REQUESTS:
                self._last_chunk.popitem(last=False)

    def _recall(self, request_id: str) -> bytes | None:
        with self._lock:
            return self._last_chunk.get(request_id)

    @staticmethod
    def _check_block_ids(context: TransferContext, block_ids: list[int], num_chunks: int,
                         allow_skip: bool) -> None:
        try:
            context.check_block_ids(block_ids, num_chunks, allow_skip)
        except ValueError as err:
            raise invalid(str(err)) from None

    # ---- status ------------------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        stats = self.storage.pool.stats()
        sessions, leases = self.leases.counts()
        return {
            "pool_capacity_bytes": stats.capacity_bytes,
            "pool_used_bytes": stats.used_bytes,
            "pool_objects": stats.num_objects,
            "pool_pinned_objects": stats.num_pinned,
            "pool_writing_objects": stats.num_writing,
            "pool_evictions_total": stats.evictions,
            "pool_ready_bytes": stats.ready_bytes,
            "pool_pinned_bytes": stats.pinned_bytes,
            # 1 once pinning failed: the rest of the pool is used unpinned (slower copies to GPUs)
            "pool_pin_failed": int(bool(stats.pin_error)),
            "lease_sessions": sessions,
            "leases": leases,
            "lease_sessions_expired_total": self.leases.expired_total,
            "retrieve_split_chunks_total": self.copy_threads.helped_chunks,
            "registered_instances": len(self.registry.instance_ids()),
            "attach_channels": self.registry.num_attach_channels,
        }

    def tier_gauges(self) -> dict[str, dict[str, float]]:
        """Per lower tier: its counters by name (for /metrics, labelled by tier)."""
        _, tiers = self.storage.stats()
        return {t.name: {k: v for k, v in vars(t).items() if k != "name"} for t in tiers}

    def status(self) -> dict[str, object]:
        gauges = self.gauges()
        _, tiers = self.storage.stats()
        copying, cancelled = self.fence.counts()
        return {
            "pool_bytes": gauges["pool_capacity_bytes"],
            "pool_used_bytes": gauges["pool_used_bytes"],
            "pool_ready_bytes": gauges["pool_ready_bytes"],
            "pool_ready": gauges["pool_ready_bytes"] >= gauges["pool_capacity_bytes"],
            "pool_pinned_bytes": gauges["pool_pinned_bytes"],
            "pool_pin_error": self.storage.pool.stats().pin_error,
            "objects": gauges["pool_objects"],
            "registered_instances": self.registry.instance_ids(),
            "instances": self.registry.describe(),
            "lookup_chunks_total": self.metrics.lookup_chunks_total,
            "lookup_hits_total": self.metrics.lookup_hits_total,
            "sessions": gauges["lease_sessions"],
            "leases": gauges["leases"],
            "transfers_running": copying,
            "cancelled_transfers": cancelled,
            "split_chunks": self.copy_threads.helped_chunks,
            "tiers": tiers,
        }
