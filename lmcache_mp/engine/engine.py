"""The daemon's semantics: LOOKUP / STORE / RETRIEVE / RELEASE_LEASES / END_SESSION / CLEAR / RESET_MODEL.

A chunk is keyed by `(chunk hash, fingerprint)` (`chunks.pool_key`), where the fingerprint is
the registering worker's `ChunkFormat` (model, world size, rank, layout, dtype, geometry, chunk
size): bytes stored by one kind of cache are never read into another, and a doubtful chunk is a
miss.

The engine holds no storage of its own: registrations live in `registry.py`, chunks in the
storage manager (L1 pool and lower tiers, the `storage` package's face), and what each request
holds (its leases, its last chunk, its promotions in flight) in `sessions.py`. Copies run
outside every lock, on the server's worker threads. `handlers()` binds each request type to its
operation here; where each runs is its row in `protocol.PROTOCOL`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from lmcache_mp.chunks import PoolKey, TierCleared, pool_key
from lmcache_mp.config import ServerConfig
from lmcache_mp.custom_types import IPCCacheEngineKey, KVCache
from lmcache_mp.engine.cancellation import Pair, TransferFence
from lmcache_mp.engine.capacity_advisor import CapacityAdvisor
from lmcache_mp.engine.dispatch import ARRIVAL, Handler, ReplyThen
from lmcache_mp.engine.keys import (
    ChunkMapper,
    OpChunks,
    check_keys_for,
    check_same_model,
    invalid,
    short_chunks,
)
from lmcache_mp.engine.registry import Instance, Registry
from lmcache_mp.engine.sessions import SessionTable
from lmcache_mp.engine.tails import TailIndex, tail_identity
from lmcache_mp.errors import FatalError, ServerError
from lmcache_mp.kv_events.log import EventLog, EventsReply
from lmcache_mp.kv_events.publisher import EventPublisher
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import (
    ChunkOutcome,
    ErrorCode,
    KVCacheRegistration,
    ModelReset,
    ModelScope,
    PrefixHit,
    RegisterReply,
    RequestType,
    RetrieveResult,
    StoreResult,
    TailHit,
    TailNote,
)
from lmcache_mp.storage import Hits, PoolObject, ReserveFailure, Slot, StorageManager
from lmcache_mp.storage.read_through import FormatCombo
from lmcache_mp.transfer import cuda
from lmcache_mp.transfer.context import Copies, Lane, TransferContext
from lmcache_mp.transfer.threads import CopyThreads

logger = logging.getLogger(__name__)

_OUTCOMES = {ReserveFailure.ALREADY_PRESENT: ChunkOutcome.ALREADY_PRESENT,
             ReserveFailure.NO_SPACE: ChunkOutcome.NO_SPACE}
_CANCELLED = RetrieveResult(b"", False, "cancelled")
MAX_EVENTS_PER_REPLY = 8192  # KV_EVENTS: a client asking for more gets this many, and asks again
# Models whose last RESET_MODEL is remembered, for the STOREs that arrived before it and run after
# (the oldest is forgotten first: a STORE queued that long was refused by the queue's deadline).
MAX_RESETS_REMEMBERED = 4096


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


class Engine:
    """The daemon's operations over its registrations, storage and sessions (module docstring)."""

    def __init__(self, config: ServerConfig, metrics: Metrics, epoch: int = 0):
        """`epoch`: the daemon's (HELLO's), which KV_EVENTS replies carry."""
        self.chunk_size = config.chunk_size
        self.metrics = metrics
        self.capacity = CapacityAdvisor()  # what other pool sizes would hit (STATUS, /metrics)
        self.tails = TailIndex()  # which requests' tails follow which chunk (LOOKUP_PREFIX)
        self.epoch = epoch
        self.events = EventLog(config.kv_events_log_records)
        # Where CUDA is present, the pool is page-locked as it is prepared, for DMA.
        self.storage = StorageManager.open(
            int(config.l1_size_gb * 2**30), config.l2, int(config.write_queue_gb * 2**30),
            pin=cuda.register_host_memory if torch.cuda.is_available() else None,
            pool_file=config.pool_path, fresh_pool=config.fresh_pool, events=self.events)
        self.publisher: EventPublisher | None = None
        self.sessions = SessionTable(self.storage.unpin, config.lease_ttl_s)
        self.fence = TransferFence(config.queue_deadline_s)
        self.keys = ChunkMapper(config.chunk_size)
        self.copy_threads = CopyThreads(config.max_workers)
        # Model -> the ARRIVAL of its last RESET_MODEL: a STORE that arrived before it stores nothing.
        self._resets: OrderedDict[str, int] = OrderedDict()
        self._resets_lock = threading.Lock()
        try:
            self.registry = Registry(config.attach_socket, config.socket_access, config.chunk_size,
                                     self.storage.admit, on_drop=self.fence.forget_instance)
            if config.kv_events_urls:
                self.publisher = EventPublisher(self.events, *config.kv_events_urls,
                                                curve=config.server_curve, access=config.socket_access,
                                                on_missed=self.storage.resync)
        except BaseException:
            self.copy_threads.close()
            self.storage.close()
            raise

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.registry.close()
        self.copy_threads.close()
        self.storage.close()  # the pool last, after the tiers' writers

    def handlers(self) -> dict[RequestType, Handler]:
        """What each request type means (where each runs: its row in `protocol.PROTOCOL`)."""
        return {
            RequestType.REGISTER_KV_CACHE: self.register,
            RequestType.UNREGISTER_KV_CACHE: self.unregister,
            RequestType.LOOKUP: self.lookup,
            RequestType.LOOKUP_CHUNKS: self.lookup_chunks,
            RequestType.LOOKUP_PREFIX: self.lookup_prefix,
            RequestType.NOTE_TAILS: self.note_tails,
            RequestType.STORE: self.store,
            RequestType.RETRIEVE: self.retrieve,
            RequestType.CANCEL_TRANSFERS: self.cancel_transfers,
            RequestType.RELEASE_LEASES: self.release_leases,
            RequestType.END_SESSION: self.end_session,
            RequestType.CLEAR: self.clear,
            RequestType.CLEAR_TIERS: self.clear_tiers,
            RequestType.RESET_MODEL: self.reset_model,
            RequestType.KV_EVENTS: self.kv_events,
        }

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

    def lookup_prefix(self, model: str, world_size: int, request_id: str | None, chunk_hashes: list[bytes],
                      window: list[bytes]) -> PrefixHit | ReplyThen | Future[PrefixHit]:
        """LOOKUP_PREFIX: `lookup_chunks`, and the tails after its last hit whose last full block
        is in `window` or that have none (`tails.py`)."""
        if not all(chunk_hashes):
            raise invalid("LOOKUP_PREFIX: a chunk hash is empty")
        return self._lookup(model, world_size, request_id, chunk_hashes, tails=window)

    def _lookup(self, model: str, world_size: int, request_id: str | None, hashes: list[bytes],
                tails: list[bytes] | None = None) -> Any:
        """The leading chunks held (with `tails`, a window, a PrefixHit with the tails after them
        too): the reply, a ReplyThen that leases the hits after it, or a Future of the reply when
        chunks must first be promoted from a lower tier."""
        combos = self.registry.format_combos(model, world_size)
        if not combos or not (hashes or tails is not None):
            # No chunk asked for; or some rank has no registered cache: nothing could be retrieved.
            return PrefixHit(0) if tails is not None else 0
        hits = self.storage.lookup(hashes, combos) if hashes else []

        if isinstance(hits, list):
            reply, tail_objects = (self._prefix_hit(model, world_size, hashes, hits, combos, tails)
                                   if tails is not None else (len(hits), None))
            # The hits are pinned already: nothing can evict them before the lease is recorded,
            # right after the reply (and before any later request, END_SESSION included, is read).
            return ReplyThen(reply, lambda: self._lease(request_id, hashes, hits, world_size, combos[0],
                                                        tail_objects=tail_objects))
        if request_id is not None:
            self.sessions.promoting(request_id)  # before the promotion can end (`promoted`)
        answer: Future[Any] = Future()

        def finish(done: Future[Hits]) -> None:
            error = None if done.cancelled() else done.exception()
            if done.cancelled() or error is not None:
                if request_id is not None:
                    self.sessions.promoted(request_id, [], None)  # over, with nothing to lease
                if error is None:  # cancelled: the daemon is stopping (the server answers SHUTTING_DOWN)
                    answer.cancel()
                else:
                    answer.set_exception(error)
                return
            try:
                promoted = done.result()
                reply, tail_objects = (self._prefix_hit(model, world_size, hashes, promoted, combos, tails)
                                       if tails is not None else (len(promoted), None))
                self._lease(request_id, hashes, promoted, world_size, combos[0], promoted=True,
                            tail_objects=tail_objects)
            except BaseException as err:
                answer.set_exception(err)
                return
            answer.set_result(reply)

        hits.add_done_callback(finish)
        return answer

    def _prefix_hit(self, model: str, world_size: int, hashes: list[bytes], hits: Hits,
                    combos: list[FormatCombo],
                    window: list[bytes]) -> tuple[PrefixHit, list[PoolObject]]:
        """LOOKUP_PREFIX's reply for these (pinned) hits, and the objects of the tails it pinned.
        The window is the prompt's last chunk and past it: 2 chunks' blocks at most are read."""
        anchor = hashes[len(hits) - 1] if hits else b""
        tails = self.tails.after(model, world_size, anchor, window[-2 * combos[0][0].blocks_per_chunk:])
        held, objects = self._pin_tails(tails, combos)
        return PrefixHit(len(hits), held), objects

    def _pin_tails(self, tails: list[TailHit],
                   combos: list[FormatCombo]) -> tuple[list[TailHit], list[PoolObject]]:
        """Those of `tails` the pool holds on every rank (in one combination), pinned. One held in a
        lower tier only is not promoted for this: a tail is worth at most one chunk's prefill."""
        held: list[TailHit] = []
        objects: list[PoolObject] = []
        for tail in tails:
            for combo in combos:
                pinned = self.storage.pin([pool_key(tail_identity(tail, spec), spec.fmt) for spec in combo])
                if pinned is not None:
                    held.append(tail)
                    objects += pinned
                    break
        self.tails.offered_total += len(held)
        return held, objects

    def note_tails(self, model: str, world_size: int, stored: list[TailNote],
                   superseded: list[TailNote]) -> None:
        """NOTE_TAILS: index the tails stored; forget the superseded ones, and free them from the
        pool unless a request holds them. (Their pool keys need the model's formats: once no rank
        of it is registered, as when an engine exits right after a turn, they are left to the LRU.)"""
        for note in stored:
            self.tails.note(model, world_size, note.anchor, note.tail)
        keys = []
        for note in superseded:
            self.tails.forget(model, world_size, note.anchor, note.tail)
            for combo in self.registry.format_combos(model, world_size):
                keys += [pool_key(tail_identity(note.tail, spec), spec.fmt) for spec in combo]
        if keys:
            self.storage.discard(keys)

    def _lease(self, request_id: str | None, hashes: list[bytes], hits: Hits, world_size: int,
               combo: FormatCombo, promoted: bool = False,
               tail_objects: list[PoolObject] | None = None) -> int:
        """Count a LOOKUP (its chunks, of `combo`'s size in the pool, for the capacity advisor too)
        and lease its hits, and the tails' `tail_objects`, to its request (`promoted`: a
        promotion's, which the sessions unpin instead if the request ended while they were read).
        A chunk has one object per rank of its combination, or one for all (replicated)."""
        objects_per_chunk = len(hits[0]) if hits else len(combo)
        objects = [o for chunk in hits for o in chunk]
        if tail_objects:
            objects += tail_objects
        self.metrics.looked_up(len(hashes), len(hits))
        self.capacity.record(hashes, combo[0].chunk_nbytes * objects_per_chunk)
        if request_id is None:
            self.storage.unpin(objects)  # nobody to retrieve them: count, but lease nothing
            return len(hits)
        # A replicated cache's ranks share each chunk (one object for them all, pinned once by the
        # lookup): every rank's RETRIEVE spends a pin of its own, so each gets one. (A tail's
        # objects are a chunk's: one per rank, or one for all.)
        shares = world_size // objects_per_chunk
        if shares > 1:
            self.storage.repin(objects * (shares - 1))
            objects *= shares
        last_chunk = hashes[len(hits) - 1] if hits else None
        if promoted:
            self.sessions.promoted(request_id, objects, last_chunk)
        elif objects:  # a miss opens no session: END_SESSION would find nothing to release
            self.sessions.lease(request_id, objects, last_chunk)
        return len(hits)

    # ---- STORE / RETRIEVE ---------------------------------------------------------------------

    def store(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
              event_handle: bytes) -> StoreResult:
        instance = self.registry.instance(instance_id)
        check_keys_for(instance.registration, keys)
        chunks, chunk_blocks = self._op_chunks(keys, instance.context, block_ids, allow_skip=False)
        if not chunks.hashes:
            raise invalid(f"STORE: its keys name no chunk (no key, or token ranges shorter than a chunk "
                          f"of {self.chunk_size} tokens): nothing to store")
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
            self.sessions.release_chunks(request_id, hashes)

    def end_session(self, request_id: str) -> None:
        """Release everything the request holds; a promotion still in flight leases nothing."""
        self.sessions.end(request_id)

    def clear(self) -> int:
        self.tails.clear()  # the pool's tails go (those pinned stay, unfound: at most a recompute)
        return self.storage.clear()

    def clear_tiers(self) -> list[TierCleared]:
        return self.storage.clear_tiers()

    def reset_model(self, scope: ModelScope) -> ModelReset:
        """RESET_MODEL (see protocol.py): the models' chunks out of every tier, their tails out of the
        index; STOREs of theirs that arrived before it store nothing."""
        models = frozenset(scope.model_names)
        arrival = ARRIVAL.get()
        with self._resets_lock:  # before the drop: see `_copy_in`
            for model in models:
                self._resets.pop(model, None)
                self._resets[model] = arrival
            while len(self._resets) > MAX_RESETS_REMEMBERED:
                self._resets.popitem(last=False)
        pool_chunks, tiers = self.storage.drop_models(models)
        reset = ModelReset(pool_chunks, self.tails.forget_models(models), tiers)
        failed = "; ".join(f"{tier.name}: {tier.error}" for tier in tiers if tier.error)
        logger.log(logging.WARNING if failed else logging.INFO,
                   "RESET_MODEL %s: %d chunks dropped from the pool, %s%s", sorted(models), pool_chunks,
                   ", ".join(f"{t.removed} from {t.name}" for t in tiers if not t.error) or "no tier",
                   f"; not dropped from {failed}" if failed else "")
        return reset

    def _reset_since_arrival(self, model: str) -> bool:
        """Whether `model` was reset after the running request arrived."""
        return ARRIVAL.get() < self._resets.get(model, 0)

    def kv_events(self, since: int, models: list[str], max_events: int) -> EventsReply:
        """The event log's records of `models`' chunks from `since` (see `kv_events`)."""
        limit = min(max(max_events, 1), MAX_EVENTS_PER_REPLY)
        return self.events.chunk_events(since, limit, set(models), self.epoch)

    def kv_events_counters(self) -> dict[str, int]:
        """The publisher's counters (zeros without one), and the event log's resyncs."""
        published = self.publisher.counters() if self.publisher is not None else {
            "batches_total": 0, "events_total": 0, "dropped_total": 0, "replays_total": 0}
        return {**published, **self.storage.resync_counters()}

    def tick(self) -> None:
        self.sessions.expire()

    # ---- helpers -----------------------------------------------------------------------------

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
