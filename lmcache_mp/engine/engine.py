"""The daemon's semantics: LOOKUP / STORE / RETRIEVE / RELEASE_LEASES / END_SESSION / CLEAR / RESET_MODEL.

A chunk is keyed by `(chunk hash, fingerprint)` (`chunks.pool_key`), where the fingerprint is
the registering worker's `ChunkFormat` (model, world size, rank, layout, dtype, geometry, chunk
size): bytes stored by one kind of cache are never read into another, and a doubtful chunk is a
miss.

The engine holds no storage of its own: registrations live in `registry.py`, chunks in the
storage manager (L1 pool and lower tiers, the `storage` package's face), and what each request
holds (its leases, its last chunk, its promotions in flight) in `sessions.py`. STORE and RETRIEVE,
the copies between a worker's blocks and the pool, are `transfers.py`'s; they run outside every
lock, on the server's worker threads. `handlers()` binds each request type to its
operation here; where each runs is its row in `protocol.PROTOCOL`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from lmcache_mp.chunks import TierCleared, pool_key
from lmcache_mp.config import ServerConfig
from lmcache_mp.custom_types import IPCCacheEngineKey, KVCache
from lmcache_mp.engine.cancellation import TransferFence
from lmcache_mp.engine.capacity_advisor import CapacityAdvisor
from lmcache_mp.engine.dispatch import ARRIVAL, Handler, ReplyThen
from lmcache_mp.engine.keys import (
    ChunkMapper,
    check_same_model,
    invalid,
)
from lmcache_mp.engine.registry import Registry
from lmcache_mp.engine.sessions import SessionTable
from lmcache_mp.engine.tails import TailIndex, tail_identity
from lmcache_mp.engine.transfers import Transfers
from lmcache_mp.kv_events.log import EventLog, EventsReply
from lmcache_mp.kv_events.publisher import EventPublisher
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import (
    KVCacheRegistration,
    ModelReset,
    ModelScope,
    PrefixHit,
    RegisterReply,
    RequestType,
    TailHit,
    TailNote,
)
from lmcache_mp.storage import Hits, PoolObject, StorageManager
from lmcache_mp.storage.read_through import FormatCombo
from lmcache_mp.transfer import cuda
from lmcache_mp.transfer.threads import CopyThreads

logger = logging.getLogger(__name__)

MAX_EVENTS_PER_REPLY = 8192  # KV_EVENTS: a client asking for more gets this many, and asks again
# Models whose last RESET_MODEL is remembered, for the STOREs that arrived before it and run after
# (the oldest is forgotten first: a STORE queued that long was refused by the queue's deadline).
MAX_RESETS_REMEMBERED = 4096


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
            self.transfers = Transfers(self.registry, self.storage, self.sessions, self.keys, self.fence,
                                       self.copy_threads, metrics, self._reset_since_arrival)
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
            RequestType.STORE: self.transfers.store,
            RequestType.RETRIEVE: self.transfers.retrieve,
            RequestType.CANCEL_TRANSFERS: self.transfers.cancel_transfers,
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
