"""The lmcache door: LMCache's vLLM connector served by the daemon's own engine.

A ROUTER at each `lmcache_listen` URL reads LMCache's request frames (`wire.py`) and gives each
operation its meaning in the engine's terms:
- lookup: the engine's LOOKUP of the key's tokens (its hits leased to the request, as ours are); the
  count waits in a bounded table for query_prefetch_status / wait_prefetch_status, which LMCache's
  scheduler sends next (None while a lower tier is still read).
- store / retrieve: the engine's STORE / RETRIEVE of the key's token range, with the registration's
  block ids (retrieve's `skip_first_n_tokens` as blocks left alone); free_lookup_locks releases the
  leases of a range, end_session everything the request holds.
- register_kv_cache: CPU shared-memory segments, opened under checks and copied without mapping them
  (`segments.py`), or CUDA memory by IPC handle (`cuda_caches.py`), as a registration of the engine's
  registry; dropped when its worker is gone (`liveness.py`).
- the engine-driven mode's operations: `engine_driven.py`.
- subscribe_kv_events: a stream of the pool's stores and evictions, from the engine's event log, in
  LMCache's names for the chunks (`events.py`).
Chunks are keyed by our own token-mode chain of the key's tokens (in the chain of its `cache_salt`
where it has one: `keys.py`) and the registration's format, whose layout name is the door's own: they
are not shared with our connector's.

Every request gets a reply its client reads (`wire.failure_frames`): a result, or a failure or a miss;
the first of each kind of refusal is logged, an ERROR naming the lmcache version this daemon speaks when
the request is of a wire it does not know. Cheap requests run on the door's I/O thread; registrations,
stores and waits on a bounded worker pool, retrieves on a pool of their own (a load never queues behind
stores). Requests that need the engine wait for it while the daemon starts (up to ENGINE_WAIT_S).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lmcache_mp.config import ServerConfig
from lmcache_mp.engine.dispatch import ARRIVAL, PEER, ReplyThen
from lmcache_mp.lmcache_door import cuda_caches, wire
from lmcache_mp.lmcache_door.engine_driven import EngineDriven
from lmcache_mp.lmcache_door.events import Bindings, EventStreams
from lmcache_mp.lmcache_door.keys import Refusal, engine_keys
from lmcache_mp.lmcache_door.liveness import Registration, Registrations, SegmentId, rank_binder
from lmcache_mp.lmcache_door.staging import remove_orphans
from lmcache_mp.lmcache_door.views import layout_name
from lmcache_mp.mq.server import MessageQueueServer
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.sockets import ipc_path

if TYPE_CHECKING:
    from lmcache_mp.engine.engine import Engine
    from lmcache_mp.transfer.context import TransferContext

logger = logging.getLogger(__name__)

ENGINE_WAIT_S = 120.0  # a request that needs the engine waits this long for the daemon's start
WAIT_PREFETCH_MAX_S = 30.0  # the longest wait_prefetch_status holds a worker thread
MAX_PREFETCHES = 65_536  # lookups whose counts wait for their query; the oldest is forgotten past it
MAX_LOGGED = 1024  # kinds of refusal logged (each once)
PEER_PREFIX = b"lmcache-door:"  # registrations' owners: never equal to a native client's routing id
DOOR_LAYOUT = "LMCACHE_CPU_SHM"
UNKNOWN_OP = "unknown"  # the metrics' operation of a request that named none of 0.5.6's

INLINE_OPS = frozenset({"ping", "get_chunk_size", "get_experimental", "noop", "lookup",
                        "query_prefetch_status", "free_lookup_locks", "end_session",
                        "report_block_allocation", "prepare_store", "commit_retrieve"})
LOAD_OPS = frozenset({"retrieve", "prepare_retrieve"})
STREAM_OPS = frozenset({"subscribe_kv_events"})  # answered by the event streams' thread


class _Prefetches:
    """Each request's looked-up chunk count, or the Future of it, until queried; bounded."""

    def __init__(self, limit: int = MAX_PREFETCHES):
        self._limit = limit
        self._entries: OrderedDict[str, int | Future[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, value: int | Future[Any]) -> None:
        with self._lock:
            self._entries.pop(request_id, None)
            self._entries[request_id] = value
            while len(self._entries) > self._limit:
                self._entries.popitem(last=False)  # its leases end with its session or their TTL

    def future(self, request_id: str) -> Future[Any] | None:
        with self._lock:
            value = self._entries.get(request_id)
        return value if isinstance(value, Future) else None

    def take(self, request_id: str) -> int | None:
        """The count once known (and forgotten then); None while pending; 0 for an unknown request."""
        with self._lock:
            value = self._entries.get(request_id)
            if value is None:
                return 0
            if isinstance(value, Future):
                if not value.done():
                    return None
                value = _count(value)
            del self._entries[request_id]
            return value

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)


def _count(done: Future[Any]) -> int:
    """A finished lookup's chunk count; 0 (a miss) if it failed or was cancelled."""
    if done.cancelled() or done.exception() is not None:
        return 0
    return int(done.result())


class LMCacheDoor:
    """The ROUTER at the `lmcache_listen` URLs and each request's meaning (module docstring)."""

    def __init__(self, config: ServerConfig, arrivals: Callable[[], int], metrics: Metrics):
        """`arrivals()`: how many requests the native door has read so far, which orders the door's
        requests against its RESET_MODELs (`engine.dispatch.ARRIVAL`); `metrics` counts each reply."""
        self._config = config
        self._arrivals = arrivals
        self._answered = {(op, ok): metrics.lmcache_door_requests.labels(op, "ok" if ok else "failed")
                          for op in (*wire.SERVED, UNKNOWN_OP) for ok in (True, False)}  # series at 0
        self._metrics = metrics
        self._engine: Engine | None = None
        self._engine_ready = threading.Event()
        self._work = ThreadPoolExecutor(config.max_workers, thread_name_prefix="lmcache-door-worker")
        self._loads = ThreadPoolExecutor(config.max_workers, thread_name_prefix="lmcache-door-load")
        self._queued = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._prefetches = _Prefetches()
        self._registrations = Registrations()
        self._bindings = Bindings(config.chunk_size)
        self._streams = EventStreams(lambda identity, frames: self._mq.send(identity, frames), self._bindings)
        engine_driven = EngineDriven(config, self._require_engine, self._registrations, self._bindings.bind)
        self._handlers: dict[str, Callable[..., Any]] = {
            op: getattr(self, "_op_" + op) for op in wire.SERVED if hasattr(self, "_op_" + op)
        } | engine_driven.handlers()
        assert set(self._handlers) | STREAM_OPS == set(wire.SERVED), "every operation served has its handler"
        self._logged: set[str] = set()
        self._mq = MessageQueueServer(config.lmcache_listen, self._on_request, on_tick=self._tick)
        self.endpoints = self._mq.endpoints
        for url in config.lmcache_listen:
            path = ipc_path(url)
            if path is not None:
                config.socket_access.secure(path)

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        orphans = remove_orphans(os.geteuid())
        if orphans:
            logger.info("lmcache door: removed %d staging segments of daemons no longer running: %s",
                        len(orphans), " ".join(orphans))
        self._streams.start()
        self._mq.start()
        logger.info("lmcache door: serving LMCache's own connector, %s, on %s", wire.SPOKEN,
                    " ".join(self.endpoints))

    def serve(self, engine: Engine) -> None:
        """The engine is built: requests that wait for it go on."""
        self._engine = engine
        self._streams.serve(engine.events)
        self._engine_ready.set()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._engine_ready.set()  # requests waiting for the engine are answered (failed) now
        for pool in (self._work, self._loads):
            pool.shutdown(wait=False, cancel_futures=True)
        self._streams.stop()
        self._mq.stop()
        for pool in (self._work, self._loads):
            pool.shutdown(wait=True)
        for registration in self._registrations.take_all():
            registration.release()
        for url in self.endpoints:
            path = ipc_path(url)
            if path is not None:
                path.unlink(missing_ok=True)

    # ---- dispatch -----------------------------------------------------------------------------------

    def _on_request(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) >= 2 and frames[1] == b"":  # a stream's control frame: no reply, in LMCache's wire
            self._control(identity, frames)
            return
        try:
            request = wire.decode_request(frames)
        except wire.WireError as err:
            self._note(err.op or "request", err.message, unknown=err.unknown)
            self._count(err.op or UNKNOWN_OP, ok=False)
            self._mq.send(identity, wire.failure_frames(err.uid, err.op_frame, err.op, err.message))
            return
        if request.op in INLINE_OPS:
            self._run(identity, request)
            return
        if request.op in STREAM_OPS:
            self._count(request.op, ok=True)
            self._streams.subscribe(identity, request)
            return
        with self._lock:
            refusal = ("the daemon is stopping" if self._stopping
                       else f"{self._config.max_queued_requests} requests already queued"
                       if self._queued >= self._config.max_queued_requests else None)
            if refusal is None:
                self._queued += 1
        if refusal is not None:
            self._fail(identity, request, refusal)
            return
        pool = self._loads if request.op in LOAD_OPS else self._work
        try:
            queued = pool.submit(self._run_queued, identity, request)
        except RuntimeError:  # stop() shut the pool down meanwhile
            self._unqueue()
            self._fail(identity, request, "the daemon is stopping")
            return
        queued.add_done_callback(lambda done: done.cancelled() and self._cancelled(identity, request))

    def _control(self, identity: bytes, frames: list[bytes]) -> None:
        """A stream's ack or cancel, which LMCache's wire never answers; anything else with an empty op
        frame is answered as a request that names no operation."""
        if len(frames) == 3 and self._streams.control(identity, frames[0], frames[2]):
            return
        message = "an empty op frame that is no ack or cancel of an open KV event stream"
        self._note("request", message, unknown=True)
        self._count(UNKNOWN_OP, ok=False)
        self._mq.send(identity, wire.failure_frames(frames[0], frames[1], None, message))

    def _cancelled(self, identity: bytes, request: wire.Request) -> None:
        self._unqueue()
        self._fail(identity, request, "the daemon is stopping; not started")

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _run_queued(self, identity: bytes, request: wire.Request) -> None:
        try:
            self._run(identity, request)
        finally:
            self._unqueue()

    def _run(self, identity: bytes, request: wire.Request) -> None:
        handler = self._handlers[request.op]
        arrival, peer = ARRIVAL.set(self._arrivals()), PEER.set(PEER_PREFIX + identity)
        try:
            result = handler(*request.args)
        except Refusal as err:
            self._fail(identity, request, str(err))
            return
        except Exception as err:
            self._fail(identity, request, _describe(err))
            return
        finally:
            ARRIVAL.reset(arrival)
            PEER.reset(peer)
        self._count(request.op, ok=True)  # before the reply: a client that has it finds it counted
        self._mq.send(identity, wire.reply_frames(request, result))

    def _fail(self, identity: bytes, request: wire.Request, message: str) -> None:
        self._note(request.op, message, unknown=False)
        self._count(request.op, ok=False)
        self._mq.send(identity, wire.failure_frames(request.uid, request.op_frame, request.op, message))

    def _count(self, op: str, *, ok: bool) -> None:
        """One more reply, by operation (0.5.6's, so the series are bounded) and result."""
        series = self._answered.get((op, ok))
        if series is None:  # an operation of 0.5.6's that the door does not serve
            series = self._metrics.lmcache_door_requests.labels(op, "ok" if ok else "failed")
        series.inc()

    def _note(self, op: str, message: str, *, unknown: bool) -> None:
        """Log a refusal once per kind (its text without numbers): why a client missed or failed."""
        kind = op + ":" + re.sub(r"\d+", "N", message)[:80]
        with self._lock:
            if kind in self._logged or len(self._logged) >= MAX_LOGGED:
                return
            self._logged.add(kind)
        if unknown:
            logger.error("lmcache door: %s; this daemon speaks %s: the client's lmcache version may differ "
                         "(the request was answered as failed)", message, wire.SPOKEN)
        else:
            logger.warning("lmcache door: %s refused: %s (further ones like it are not logged)", op, message)

    def _require_engine(self) -> Engine:
        if not self._engine_ready.wait(ENGINE_WAIT_S) or self._engine is None:
            raise Refusal("the daemon's engine is not serving (still starting, or stopping)")
        return self._engine

    # ---- operations answered at once ----------------------------------------------------------------

    def _op_ping(self, instance_id: int | None) -> bool:
        if instance_id is not None:
            self._registrations.touch(instance_id, ping=True)
        return True

    def _op_get_chunk_size(self) -> int:
        return self._config.chunk_size

    def _op_get_experimental(self) -> list[str]:
        return [wire.KV_EVENT_CAPABILITY]

    def _op_noop(self) -> str:
        return "OK"

    def _op_lookup(self, key: wire.Key, tp_size: int) -> None:
        del tp_size  # LMCache's servers ignore it too
        engine = self._engine
        try:
            if engine is None:
                raise Refusal("the daemon's engine is still starting: a miss")
            keys = engine_keys(key, self._config.chunk_size, lookup=True)
            result = engine.lookup(keys) if keys else 0
        except Exception as err:
            self._prefetches.put(key.request_id, 0)  # queried next: a miss
            self._note("lookup", _describe(err), unknown=False)
            return None
        if isinstance(result, ReplyThen):
            result.then()  # the hits' leases, before the door's next request is read
            result = result.result
        self._prefetches.put(key.request_id, result)
        return None

    def _op_query_prefetch_status(self, request_id: str) -> int | None:
        return self._prefetches.take(request_id)

    def _op_free_lookup_locks(self, key: wire.Key, tp_size: int) -> None:
        del tp_size
        engine = self._engine
        if engine is not None:
            keys = engine_keys(key, self._config.chunk_size, lookup=False)
            if keys:
                engine.release_leases(keys)

    def _op_end_session(self, request_id: str) -> None:
        self._prefetches.drop(request_id)
        engine = self._engine
        if engine is not None:
            engine.end_session(request_id)

    def _op_report_block_allocation(self, instance_id: int, model_name: str, records: list[Any]) -> None:
        del instance_id, model_name, records  # LMCache's telemetry; nothing here uses it

    # ---- operations on the worker pools -------------------------------------------------------------

    def _op_wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        pending = self._prefetches.future(request_id)
        if pending is not None:
            # Timed out, failed or cancelled: `take` tells which.
            with contextlib.suppress(Exception):
                pending.result(min(max(timeout, 0.0), WAIT_PREFETCH_MAX_S))
        return self._prefetches.take(request_id)

    def _op_register_kv_cache(self, instance_id: int, descriptors: wire.Descriptors, model_name: str,
                              world_size: int, engine_type: str, hints: wire.LayoutHints,
                              groups: list[wire.EngineGroupInfo]) -> None:
        engine = self._require_engine()
        if self._registrations.refresh(instance_id, PEER.get()) is not None:
            return None  # its worker registers again after a heartbeat it missed: its caches are the same
        context, segments = self._open_caches(engine, descriptors, model_name, engine_type, hints, groups)
        bind = rank_binder(engine, instance_id, model_name, world_size, context, context.geometry.layout.name,
                           context.geometry.block_size)
        self._registrations.check_room()
        self._registrations.add(instance_id, PEER.get(), segments, None, bind, world_size)
        if world_size > 1:
            logger.info("lmcache door: instance %d of a %d-rank world of %s: its caches are registered once "
                        "a transfer names its rank", instance_id, world_size, model_name)
        return None

    def _open_caches(self, engine: Engine, descriptors: wire.Descriptors, model_name: str, engine_type: str,
                     hints: wire.LayoutHints, groups: list[wire.EngineGroupInfo]
                     ) -> tuple[TransferContext, list[SegmentId]]:
        """The registration's copy context, and the client's segments it opened (none for CUDA
        caches); Refusal for caches not served."""
        from lmcache_mp.lmcache_door.segments import SegmentContext, open_segments

        if engine_type != "vllm":
            raise Refusal(f"caches of engine {engine_type!r}: only vLLM's are served")
        if len({group.engine_group_id for group in groups}) > 1:
            raise Refusal("several KV cache groups (a hybrid model): not served by the lmcache door yet")
        block_size = (groups[0].tokens_per_block if groups else 0) or hints.tokens_per_block or 0
        if cuda_caches.is_cuda(descriptors):
            return cuda_caches.cuda_context(descriptors, hints, block_size, self._config.chunk_size), []
        shm = [d for d in descriptors if isinstance(d, wire.CpuShmDescriptor)]
        if not shm or len(shm) != len(descriptors):
            raise Refusal("caches must be CPU shared-memory segments (cpu_shm descriptors) or CUDA memory "
                          "(cuda descriptors), all of one kind")
        layout = layout_name(DOOR_LAYOUT, hints.kv_layout)
        segments = open_segments(shm, os.geteuid(), self._own_files())
        try:
            context = SegmentContext(shm, segments, layout, hints.kv_layout, block_size,
                                     self._config.chunk_size)
        except BaseException:
            for segment in segments.values():
                os.close(segment.fd)
            raise
        return context, [(s.name, s.identity) for s in context.segments]

    def _own_files(self) -> set[tuple[int, int]]:
        """The files a segment must never be: the pool file."""
        path = self._config.pool_path
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            return set()
        return {(st.st_dev, st.st_ino)} if st is not None else set()

    def _op_unregister_kv_cache(self, instance_id: int) -> None:
        # Refused (FORBIDDEN) from another connection; nothing to drop for caches not bound to a rank yet.
        self._require_engine().unregister(instance_id)
        self._registrations.forget(instance_id)
        self._streams.drop(instance_id)

    def _op_store(self, key: wire.Key, instance_id: int, block_ids: list[list[int]],
                  event_handle: bytes) -> tuple[bytes, bool]:
        engine = self._require_engine()
        self._registrations.transferred(instance_id, PEER.get(), key.worker_id)
        keys = engine_keys(key, self._config.chunk_size, lookup=False)
        if keys:
            self._bindings.bind(key)  # before its chunks' records can be read
            event = _device_event(engine.registry.instance(instance_id).context, event_handle)
            engine.transfers.store(keys, instance_id, _one_group(block_ids), event)
        # No event back: the copies are complete when the reply leaves, so its client waits for nothing.
        return b"", True

    def _op_retrieve(self, key: wire.Key, instance_id: int, block_ids: list[list[int]], event_handle: bytes,
                     skip_first_n_tokens: int) -> tuple[bytes, bool]:
        engine = self._require_engine()
        self._registrations.transferred(instance_id, PEER.get(), key.worker_id)
        context = engine.registry.instance(instance_id).context
        event = _device_event(context, event_handle)
        blocks = _one_group(block_ids)
        block_size = context.geometry.block_size
        skipped = min(max(skip_first_n_tokens, 0) // block_size, len(blocks))
        blocks[:skipped] = [-1] * skipped  # blocks vLLM already holds (its own prefix hit): left alone
        keys = engine_keys(key, self._config.chunk_size, lookup=False)
        if not keys:
            raise Refusal("a retrieve of no whole chunk")
        result = engine.transfers.retrieve(keys, instance_id, blocks, event)
        if not result.ok:
            raise Refusal(f"the retrieve loaded nothing: {result.reason}")
        return b"", True

    def _op_clear(self, force: bool) -> None:
        del force  # chunks in use stay, as for CLEAR
        self._require_engine().clear()

    # ---- registrations' liveness --------------------------------------------------------------------

    def _tick(self) -> None:
        """Drop the registrations whose worker is gone (`liveness.py`)."""
        engine = self._engine
        if engine is None:
            return
        for iid, registration in self._registrations.gone():
            self._drop(engine, iid, registration)

    def _drop(self, engine: Engine, instance_id: int, registration: Registration) -> None:
        token = PEER.set(registration.owner)
        try:
            engine.unregister(instance_id)
        finally:
            PEER.reset(token)
            registration.release()
            self._streams.drop(instance_id)
        logger.info("lmcache door: dropped instance %d: its worker is gone", instance_id)


def _device_event(context: TransferContext, event_handle: bytes) -> bytes:
    """What a transfer's copies wait for: the worker's event on CUDA caches (checked), nothing on CPU
    ones (their event is a constant; the forward pass is over when the request arrives)."""
    if context.device.type != "cuda":
        return b""
    cuda_caches.check_event_handle(event_handle)
    return event_handle


def _one_group(block_ids: list[list[int]]) -> list[int]:
    if len(block_ids) != 1:
        raise Refusal(f"block ids of {len(block_ids)} KV cache groups: one group is served as yet")
    return list(block_ids[0])


def _describe(err: BaseException) -> str:
    """An error as a client and a log line should read it."""
    message = getattr(err, "message", None)
    return message if isinstance(message, str) else f"{type(err).__name__}: {err}"
