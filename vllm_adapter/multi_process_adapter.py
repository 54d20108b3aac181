"""Scheduler and worker adapters: vLLM-side clients of the lmcache-mp daemon.

The API follows the seed's `multi_process_adapter` (same classes, constructors and method
names). Differences, each fixing a known failure of the seed:
- every operation is tracked per request, also inside batches, so no request id is lost;
- a failed or refused retrieve is reported (`take_failed_retrieves`), never passed off as
  loaded, so vLLM recomputes instead of attending over garbage;
- when the daemon is unreachable the adapters fail closed: lookups count 0 hits, retrieves
  fail; the worker re-registers by itself when the daemon comes back, and sends then the
  stores it held meanwhile (bounded in number and age);
- a store whose chunks did not land for a reason that may pass (no space, an overloaded or
  restarting daemon, a timeout) is sent again with backoff, and its request is reported
  finished only after that (vLLM keeps its blocks until then);
- a worker registers under a random 63-bit instance id, never its pid (pids repeat across
  containers sharing one daemon, and one worker's RETRIEVEs would land in another's cache);
- a registration the daemon refuses as invalid (unsupported layout, a chunk larger than its
  pool) is not retried: one ERROR, then the worker serves without the cache; other failures
  are retried with exponential backoff;
- a RETRIEVE or STORE that got no reply in time is not given up at once: the daemon may still
  run it, and once vLLM reuses the blocks a late copy would overwrite another request's KV or
  cache it under this request's keys. It is *fenced* (`fences.py`) until the daemon confirms
  CANCEL_TRANSFERS or is gone; `retrieve_now` (sync loads) and `wait_for_stores`
  (preemption) wait for that too. The store retries' books are kept in `store_retry.py`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import KVExportError, LMCacheMPError, RequestTimeoutError, ServerError
from lmcache_mp.mq import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import (
    PERMANENT_ERRORS,
    PHASE_STARTING,
    PROTOCOL_VERSION,
    ChunkOutcome,
    ErrorCode,
    KVCacheRegistration,
    RegisterReply,
    RequestType,
    RetrieveResult,
)
from lmcache_mp.transfer.attach import AttachChannel
from vllm_adapter.fences import Fences, Target
from vllm_adapter.store_retry import (
    MAX_HELD_STORES,
    MAX_STORE_SENDS,
    STORE_FIRST_RETRY_S,
    STORE_MAX_RETRY_S,
    PendingStore,
    StoreBatch,
    StoreTracker,
)
from vllm_adapter.utils import export_kv_caches, send_lmcache_request, striding_block_hashes

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TIMEOUT_S = 30.0
REREGISTER_INTERVAL_S = 1.0
# A probe sent just as the daemon died is lost with its connection; waiting out a long probe
# timeout then delays re-registration after a restart. Probes are tiny: retry them quickly.
MAX_PROBE_INTERVAL_S = 0.25
# Registration attempts that failed for a reason that may pass (timeout, overloaded daemon,
# attach socket error) are retried after a delay doubling from the first to the last.
FIRST_RETRY_S = 0.25
MAX_RETRY_S = 30.0
# Finished request ids remembered to report each exactly once (bounded).
_REPORTED_MEMORY = 100_000
# Fire-and-forget requests (END_SESSION, RELEASE_LEASES) whose replies the scheduler adapter
# watches for failures (bounded: past it, the oldest is no longer watched), and how long its
# shutdown waits for those still unanswered.
MAX_WATCHED_RELEASES = 4096
SHUTDOWN_RELEASE_WAIT_S = 1.0


def new_instance_id() -> int:
    """A random instance id: unique per worker among every container sharing a daemon (a pid is
    not: it repeats across PID namespaces). 63 bits, so it fits any signed 64-bit field."""
    return secrets.randbits(63)


@dataclass
class LoadStoreOp:
    block_ids: list[int]
    """Block ids for the load/store operation (-1: skip that block on load)"""
    token_ids: list[int] | None = None
    """Token IDs for the load/store operation (token mode)"""
    block_hashes: list[bytes] | None = None
    """Block hashes for the load/store operation (hash mode)"""
    start: int = 0
    """Start token index (token mode only)"""
    end: int = 0
    """End token index (token mode only)"""

    def __len__(self) -> int:
        return len(self.block_ids)


class _KeyMaker:
    """Builds IPC keys for one (model, world size, rank)."""

    def __init__(self, model_name: str, world_size: int, worker_id: int | None, blocks_in_chunk: int):
        self.model_name = model_name
        self.world_size = world_size
        self.worker_id = worker_id
        self.blocks_in_chunk = blocks_in_chunk

    def keys_for(self, request_id: str, op: LoadStoreOp) -> list[IPCCacheEngineKey]:
        if op.block_hashes is not None:
            return [
                IPCCacheEngineKey(self.model_name, self.world_size, self.worker_id,
                                  chunk_hash=h, request_id=request_id)
                for h in striding_block_hashes(op.block_hashes, self.blocks_in_chunk)
            ]
        if op.token_ids is None:
            raise ValueError("a LoadStoreOp needs block_hashes (hash mode) or token_ids (token mode)")
        return [IPCCacheEngineKey(self.model_name, self.world_size, self.worker_id,
                                  token_ids=tuple(op.token_ids), start=op.start, end=op.end,
                                  request_id=request_id)]


def _connect(server_url: str, context: zmq.Context | None, name: str, timeout_s: float,
             vllm_block_size: int, connect_timeout_s: float | None,
             curve: ClientCurve | None) -> tuple[MessageQueueClient, int]:
    """Connect and say HELLO (waiting `connect_timeout_s`, default `timeout_s`); returns the
    client and the daemon's chunk size."""
    client = MessageQueueClient(server_url, context, request_timeout_s=timeout_s, curve=curve)
    try:
        hello = client.handshake(name, timeout_s=connect_timeout_s or timeout_s)
    except BaseException:
        client.close()
        raise
    if hello.chunk_size % vllm_block_size:
        client.close()
        raise ValueError(
            f"the lmcache-mp daemon at {server_url} stores chunks of {hello.chunk_size} tokens, "
            f"not a multiple of vLLM's block size {vllm_block_size}: restart it with "
            f"--chunk-size a multiple of {vllm_block_size}, or change vLLM's --block-size"
        )
    return client, hello.chunk_size


class LMCacheMPSchedulerAdapter:
    def __init__(self, server_url: str, context: zmq.Context | None, model_name: str, world_size: int,
                 kv_rank: int, vllm_block_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float | None = None, curve: ClientCurve | None = None):
        """`curve`: the keys to authenticate with, for a daemon that requires CURVE."""
        self.mq_client, self.chunk_size = _connect(server_url, context, "vllm-scheduler", timeout_s,
                                                   vllm_block_size, connect_timeout_s, curve)
        self.model_name = model_name
        self.world_size = world_size
        self.worker_id = kv_rank
        self.blocks_in_chunk = self.chunk_size // vllm_block_size
        self._keys = _KeyMaker(model_name, world_size, None, self.blocks_in_chunk)
        self.lookup_futures: dict[str, MessagingFuture[int]] = {}
        # (what, reply) of the releases sent, oldest first: the scheduler never waits for them, but
        # one that fails (leases then held until the daemon's TTL) is logged, not lost.
        self._releases: deque[tuple[str, MessagingFuture[None]]] = deque()
        self.unwatched_releases = 0  # dropped from the watch unanswered (MAX_WATCHED_RELEASES)

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes] | None = None,
                                    token_ids: list[int] | None = None) -> None:
        """Submit one LOOKUP per request id (later calls are no-ops). Its hits stay leased
        for the RETRIEVE that follows, until `end_session` or the daemon's lease TTL."""
        if request_id in self.lookup_futures:
            return
        if (block_hashes is None) == (token_ids is None):
            raise ValueError("exactly one of block_hashes or token_ids must be given")
        if token_ids is not None:
            aligned_end = len(token_ids) // self.chunk_size * self.chunk_size
            op = LoadStoreOp([], token_ids=token_ids, start=0, end=aligned_end)
            keys = self._keys.keys_for(request_id, op)
            request: tuple[RequestType, list[Any]] | None = (
                (RequestType.LOOKUP, [keys]) if aligned_end else None)
        else:
            # The usual case: every key one chunk hash, their shared fields sent once.
            hashes = list(striding_block_hashes(block_hashes or [], self.blocks_in_chunk))
            request = ((RequestType.LOOKUP_CHUNKS, [self.model_name, self.world_size, request_id, hashes])
                       if hashes else None)
        if request is None:
            future: MessagingFuture[int] = MessagingFuture.settled(RequestType.LOOKUP, 0)
        else:
            future = send_lmcache_request(self.mq_client, *request)
        self.lookup_futures[request_id] = future

    def check_lookup_result(self, request_id: str, wait_s: float = 0.0) -> int | None:
        """Tokens hit (a multiple of the chunk size), or None while the lookup is pending after
        waiting up to `wait_s`. A failed lookup (daemon down, error) counts as 0: a miss, never
        a guess."""
        future = self.lookup_futures[request_id]
        if wait_s > 0:
            future.wait(wait_s)
        # Polling drives the socket (settling earlier releases' replies too), but a lookup that
        # was waited on is settled already: then skip the poll's system calls.
        settled = future.done() or future.query()
        self._check_releases()
        if not settled:
            return None
        error = future.exception()
        if error is not None:
            logger.warning("lookup for request %s failed, counting a miss: %s", request_id, error)
            return 0
        return future.result() * self.chunk_size

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

    def cleanup_lookup_result(self, request_id: str) -> None:
        self.lookup_futures.pop(request_id, None)

    def release_leases(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Release the leases the request's lookup took on these chunks (their vLLM block
        hashes, whole chunks as in the lookup): chunks it will not retrieve need not stay
        pinned until `end_session` (fire and forget)."""
        keys = self._keys.keys_for(request_id, LoadStoreOp([], block_hashes=block_hashes))
        if keys:
            self._release(f"RELEASE_LEASES for request {request_id}", RequestType.RELEASE_LEASES, [keys])

    def end_session(self, request_id: str) -> None:
        """Release whatever the request still holds at the daemon (fire and forget: a failure is
        logged once its reply, or its timeout, is seen)."""
        self._release(f"END_SESSION for request {request_id}", RequestType.END_SESSION, [request_id])

    def _release(self, what: str, request_type: RequestType, payload: list[Any]) -> None:
        # Sent with the next request (or within mq.LATER_FLUSH_S): the scheduler doesn't pay a
        # send per finished request, and the leases end only milliseconds later.
        self._releases.append((what, self.mq_client.submit_later(request_type, payload)))
        self._check_releases()
        if len(self._releases) > MAX_WATCHED_RELEASES:  # the oldest is unanswered
            what, _ = self._releases.popleft()
            self.unwatched_releases += 1
            if self.unwatched_releases == 1 or self.unwatched_releases % 1000 == 0:
                logger.warning("%d releases sent to the daemon got no reply yet and are no longer "
                               "watched (the latest: %s); their leases end by the daemon's TTL",
                               self.unwatched_releases, what)

    def _check_releases(self) -> None:
        """Log the failures of the releases answered so far (never waits)."""
        releases = self._releases
        while releases and releases[0][1].done():
            what, future = releases.popleft()
            error = future.exception()
            if error is not None:
                logger.warning("%s failed: %s; the daemon releases its leases after their TTL", what, error)

    def shutdown(self) -> None:
        """Close the connection once the releases sent have been answered (up to
        SHUTDOWN_RELEASE_WAIT_S): closing drops requests still queued in the socket."""
        deadline = time.monotonic() + SHUTDOWN_RELEASE_WAIT_S
        for _, future in self._releases:
            future.wait(max(0.0, deadline - time.monotonic()))
        self._check_releases()
        self.mq_client.close()


@dataclass(frozen=True)
class _Outcome:
    failure: str | None  # None: all of the request's operations succeeded
    unanswered: bool  # some operation got no reply before its deadline (the daemon may still run it)


@dataclass
class _Sent:
    """Where a request's operations went, and the CUDA events they carry: the daemon opens an
    event's IPC handle when it runs the operation, so the event lives until the daemon is done
    with it (replied, or confirmed the cancel of an operation that got no reply)."""

    target: Target
    events: list[torch.cuda.Event] = field(default_factory=list)


class _PerRequestOps:
    """Outstanding operations per request id. A batched operation counts for each of its
    requests; a request is done when all of its operations are."""

    def __init__(self) -> None:
        self._pending: dict[str, list[MessagingFuture]] = {}
        self._blocks: dict[str, list[int]] = {}
        self._sent: dict[str, _Sent] = {}

    def add(self, request_ids: list[str], ops: list[LoadStoreOp], future: MessagingFuture,
            target: Target | None = None, event: torch.cuda.Event | None = None) -> None:
        for request_id, op in zip(request_ids, ops, strict=True):
            self._pending.setdefault(request_id, []).append(future)
            self._blocks.setdefault(request_id, []).extend(b for b in op.block_ids if b >= 0)
            if target is not None:
                sent = self._sent.setdefault(request_id, _Sent(target))
                sent.target = target
                if event is not None:
                    sent.events.append(event)

    def has(self, request_id: str) -> bool:
        return request_id in self._pending

    def wait(self, request_ids: Iterable[str] | None, timeout_s: float) -> None:
        """Block until the given requests' operations (None: all) are done, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        for request_id in list(self._pending) if request_ids is None else request_ids:
            for future in self._pending.get(request_id, ()):
                future.wait(max(0.0, deadline - time.monotonic()))

    def poll(self) -> dict[str, _Outcome]:
        """Requests whose operations are all done -> how they went."""
        done: dict[str, _Outcome] = {}
        for request_id, futures in list(self._pending.items()):
            if not all(f.query() for f in futures):
                continue
            del self._pending[request_id]
            done[request_id] = _Outcome(next(filter(None, map(_failure, futures)), None),
                                        any(isinstance(f.exception(), RequestTimeoutError) for f in futures))
        return done

    def take_blocks(self, request_id: str) -> list[int]:
        return self._blocks.pop(request_id, [])

    def take_sent(self, request_id: str) -> _Sent | None:
        return self._sent.pop(request_id, None)


@dataclass
class SyncLoad:
    """A synchronous load on its way (`LMCacheMPWorkerAdapter.start_retrieve`)."""

    request_ids: list[str]
    tracker: _PerRequestOps


def _failure(future: MessagingFuture) -> str | None:
    error = future.exception()
    if error is not None:
        return str(error)
    result = future.result()
    if isinstance(result, RetrieveResult) and not result.ok:
        return result.reason or "retrieve refused"
    return None


class LMCacheMPWorkerAdapter:
    def __init__(self, server_url: str, context: zmq.Context | None, model_name: str, world_size: int,
                 kv_rank: int, vllm_block_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float | None = None,
                 reregister_interval_s: float = REREGISTER_INTERVAL_S, instance_id: int | None = None,
                 store_retry_s: float | None = None, max_held_stores: int = MAX_HELD_STORES,
                 curve: ClientCurve | None = None, replicated: bool = False):
        """`instance_id`: the id to register under (default: a random one, `new_instance_id`).
        `store_retry_s`: how long a store that did not land (or went unsent while the daemon
        was away) is tried again (default `timeout_s`); `max_held_stores`: how many such
        stores are held at most. `curve`: the keys to authenticate with, for a daemon that
        requires CURVE. `replicated`: every rank of the world holds the same KV bytes (MLA
        under tensor parallelism alone; `KVCacheRegistration.replicated`)."""
        self.server_url = server_url
        self._context = context
        self._timeout_s = timeout_s
        self._probe_interval_s = min(reregister_interval_s, MAX_PROBE_INTERVAL_S)
        self._vllm_block_size = vllm_block_size
        self._replicated = replicated
        self.mq_client, chunk_size = _connect(server_url, context, f"vllm-worker-{kv_rank}", timeout_s,
                                              vllm_block_size, connect_timeout_s, curve)
        self.instance_id = new_instance_id() if instance_id is None else instance_id
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.model_name = model_name
        self.world_size = world_size
        self.worker_id = kv_rank
        self.blocks_in_chunk = chunk_size // vllm_block_size
        self._keys = _KeyMaker(model_name, world_size, kv_rank, self.blocks_in_chunk)
        self._layout = ""
        self._channel: AttachChannel | None = None
        self._registered = False
        self._refused = False  # the daemon refused the registration as invalid: not retried
        self._retry_s = FIRST_RETRY_S  # delay after the next failed registration attempt
        self._next_try = 0.0  # no probe (and so no registration attempt) before this time
        self._probe: MessagingFuture | None = None  # HELLO sent while the daemon was away
        self._store_retry_s = timeout_s if store_retry_s is None else store_retry_s
        self._stores = StoreTracker(max_held_stores)
        self._retrieves = _PerRequestOps()
        self._finished_by_engine: set[str] = set()  # finished in vLLM, stores in flight or held
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._failed_retrieves: dict[str, list[int]] = {}
        self._fences = Fences(self.mq_client, server_url, timeout_s)  # held until the daemon confirms
        self._unfenced: dict[str, list[int]] = {}  # loads released, not reported yet -> blocks

    # ---- registration -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str | None = None) -> None:
        """Register the caches with the daemon. `layout` is vLLM's attention backend name
        (e.g. "CPU_ATTN"); without it the daemon infers the layout from the shapes. Raises what
        made it fail; `ensure_registered` then retries with backoff, unless the daemon refused
        the caches as invalid (logged once as an ERROR): the worker then serves without them."""
        self.kv_caches = kv_caches
        self._layout = layout or ""
        self._refused = False
        self._retry_s = FIRST_RETRY_S
        self._register()

    def _register(self) -> None:
        try:
            try:
                reply = self._register_as(self.instance_id)
            except ServerError as err:
                if err.code is not ErrorCode.ALREADY_REGISTERED:
                    raise
                # Another worker's id (forced ids), or our own registration that the daemon has
                # not dropped yet (its attach channel was closed just now): never take it over.
                taken, self.instance_id = self.instance_id, new_instance_id()
                logger.warning("instance id %d is already registered with lmcache-mp at %s; "
                               "registering as %d", taken, self.server_url, self.instance_id)
                reply = self._register_as(self.instance_id)
            if reply.block_size != self._vllm_block_size:
                self._withdraw(reply)  # raises: refused for good
        except (LMCacheMPError, OSError) as err:
            self._registration_failed(err)
            raise
        self._registered = True
        self._retry_s = FIRST_RETRY_S
        logger.info("registered %d KV cache layers with lmcache-mp at %s as %s (%d-byte chunks)",
                    len(self.kv_caches), self.server_url, reply.layout, reply.chunk_bytes)

    def _register_as(self, instance_id: int) -> RegisterReply:
        try:
            handles, fds = export_kv_caches(self.kv_caches)
        except (RuntimeError, ValueError) as err:
            # E.g. a cuMem/VMM or expandable-segments allocation, which CUDA IPC cannot export.
            raise KVExportError(f"cannot share this worker's KV caches with the daemon: {err}") from err
        hello = self.mq_client.handshake(f"vllm-worker-{self.worker_id}", timeout_s=self._timeout_s)
        if hello.phase == PHASE_STARTING:  # its attach socket is not there yet
            raise ServerError(ErrorCode.STARTING, "the daemon is starting: registering once it serves")
        if self._channel is not None:
            self._fences.retire(self._channel)  # the daemon drops the registration it kept alive
            self._channel = None
        self._channel = AttachChannel.open(hello.attach_socket, fds, timeout_s=self._timeout_s)
        registration = KVCacheRegistration(self.model_name, self.world_size, self.worker_id,
                                           self._layout, self._channel.token,
                                           block_size=self._vllm_block_size, replicated=self._replicated)
        return send_lmcache_request(self.mq_client, RequestType.REGISTER_KV_CACHE,
                                    [instance_id, handles, registration]).result(self._timeout_s)

    def _withdraw(self, reply: RegisterReply) -> None:
        """A daemon that reads the caches in blocks other than vLLM's (one that predates
        `KVCacheRegistration.block_size`, whose kernel blocks it takes for vLLM's) would count
        other block ids per chunk than this worker sends and refuse every STORE and RETRIEVE:
        unregister, and refuse for good (`_registration_failed`), rather than keep a cache that
        silently fails every operation. The attach channel stays open: a restarted daemon gets
        another try."""
        try:
            send_lmcache_request(self.mq_client, RequestType.UNREGISTER_KV_CACHE,
                                 [self.instance_id]).result(self._timeout_s)
        except LMCacheMPError as err:
            # Nothing is sent to it any more; the daemon drops it when this worker exits.
            logger.warning("unregistering the unusable registration failed: %s", err)
        raise KVExportError(f"the daemon reads these caches in blocks of {reply.block_size} tokens, "
                            f"vLLM's are {self._vllm_block_size} tokens: upgrade the daemon, which "
                            "then groups the attention backend's kernel blocks into vLLM's blocks")

    def _registration_failed(self, err: LMCacheMPError | OSError) -> None:
        if isinstance(err, ServerError) and err.code is ErrorCode.STARTING:
            # As for a daemon that is not there yet: probed again soon, no backoff.
            logger.debug("lmcache-mp at %s is starting; registering the KV caches once it serves",
                         self.server_url)
            self._next_try = time.monotonic() + self._probe_interval_s
            return
        if isinstance(err, KVExportError) or (isinstance(err, ServerError) and err.code in PERMANENT_ERRORS):
            self._refused = True
            logger.error("KV offload to lmcache-mp at %s is off for this worker (lookups miss, stores "
                         "are skipped) until the daemon restarts, not retrying: %s", self.server_url,
                         err if isinstance(err, KVExportError) else f"it refused the KV caches: {err}")
            return
        logger.warning("registering the KV caches with lmcache-mp at %s failed (%s); KV offload paused, "
                       "retrying in %.2f s", self.server_url, err, self._retry_s)
        self._next_try = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, MAX_RETRY_S)

    def _refused_by_daemon(self) -> bool:
        """Whether the daemon refused our caches for good. That holds as long as the daemon that
        said it: once it is gone (it closed its end of the attach channel), the next one, maybe
        configured otherwise, gets one more try."""
        if self._refused and self._channel is not None and not self._channel.is_open():
            self._refused = False
            self._retry_s = FIRST_RETRY_S
        return self._refused

    def ensure_registered(self) -> bool:
        """Fail closed while the daemon is away; re-register when it is back. Never waits
        on an absent daemon: a HELLO probe goes out (at most once per interval, or after the
        backoff of a failed registration) and the registration runs only after the daemon has
        answered one. The probes themselves do not back off: they cost the daemon nothing while
        it is away, and find it soon after it restarts."""
        if self._registered and self._channel is not None and self._channel.is_open():
            return True
        self._registered = False
        if not self.kv_caches or self._refused_by_daemon():
            return False
        probe = self._probe
        if probe is not None and probe.query():
            self._probe = None
            # A daemon still starting answers HELLO, but takes registrations only once it serves.
            if probe.exception() is None and probe.result().phase != PHASE_STARTING:
                try:
                    self._register()  # logs its failure
                except (LMCacheMPError, OSError):
                    return False
                return True
        if self._probe is None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + self._probe_interval_s
            self._probe = self.mq_client.submit(
                RequestType.HELLO, [PROTOCOL_VERSION, f"vllm-worker-{self.worker_id}"],
                timeout_s=self._probe_interval_s)
        return False

    # ---- stores and retrieves ---------------------------------------------------------------

    def submit_store_request(self, request_id: str, op: LoadStoreOp, event: torch.cuda.Event | None) -> None:
        self.batched_submit_store_requests([request_id], [op], event)

    def submit_retrieve_request(self, request_id: str, op: LoadStoreOp,
                                event: torch.cuda.Event | None) -> None:
        self.batched_submit_retrieve_requests([request_id], [op], event)

    def batched_submit_store_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                      event: torch.cuda.Event | None, step: int = 0) -> None:
        """Store these ops (asynchronously, sent again if they do not land). `step` tags them for
        `oldest_pending_store_step`."""
        registered = self.ensure_registered()
        if not registered and self._refused:
            return  # serving without the cache, as the one ERROR said: a skipped store is no failure
        parts = [PendingStore(rid, op, event, step) for rid, op in zip(request_ids, ops, strict=True)]
        self._stores.add(parts)
        if registered:
            self._send_stores(parts, event)
            return
        # The daemon is away (restarting, say): held, and sent once the worker has registered
        # again, so that a restart loses no chunk that vLLM still holds.
        now = time.monotonic()
        for part in parts:
            self._hold(part, part.op, now, "lmcache-mp daemon unavailable")

    def batched_submit_retrieve_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                         event: torch.cuda.Event | None) -> None:
        self._submit(RequestType.RETRIEVE, self._retrieves, request_ids, ops, event)

    def _submit(self, request_type: RequestType, tracker: _PerRequestOps, request_ids: list[str],
                ops: list[LoadStoreOp], event: torch.cuda.Event | None) -> None:
        registered = self.ensure_registered()
        target = None
        if not registered:
            unavailable = LMCacheMPError("KV offload to lmcache-mp is off for this worker" if self._refused
                                         else "lmcache-mp daemon unavailable")
            future = MessagingFuture.settled(request_type, error=unavailable)
        else:
            keys = [k for rid, op in zip(request_ids, ops, strict=True) for k in self._keys.keys_for(rid, op)]
            block_ids = [b for op in ops for b in op.block_ids]
            event_handle = event.ipc_handle() if event is not None else b""
            future = send_lmcache_request(self.mq_client, request_type,
                                          [keys, self.instance_id, block_ids, event_handle])
            if self._channel is not None:
                target = Target(self.instance_id, self._channel)  # to fence it, should it time out
        tracker.add(request_ids, ops, future, target, event)

    def holds_stores(self) -> bool:
        """Whether stores are held for another try (or for the daemon's return)."""
        return self._stores.num_held > 0

    def oldest_pending_store_step(self, request_id: str) -> int | None:
        """The oldest `step` tag among this request's stores that may still read its blocks (in
        flight, held for another try, or fenced after a timeout), None if none may; as of the last
        `get_finished`, which settles the replies."""
        return self._stores.oldest_step(request_id)

    def _send_stores(self, parts: list[PendingStore], event: torch.cuda.Event | None) -> None:
        keys = [k for p in parts for k in self._keys.keys_for(p.request_id, p.op)]
        block_ids = [b for p in parts for b in p.op.block_ids]
        event_handle = event.ipc_handle() if event is not None else b""
        for part in parts:
            part.sends += 1
        future = send_lmcache_request(self.mq_client, RequestType.STORE,
                                      [keys, self.instance_id, block_ids, event_handle])
        target = Target(self.instance_id, self._channel) if self._channel is not None else None
        self._stores.sent(future, parts, target)

    def _advance_stores(self) -> None:
        """Settle the stores whose replies came (holding what did not land), give up held ones
        past their time, and send again those due, once the worker is registered."""
        now = time.monotonic()
        for batch in self._stores.take_completed():
            self._settle_store(batch, now)
        for part in self._stores.take_held(lambda p: p.give_up_at <= now):
            self._give_up(part, f"not stored within {self._store_retry_s:g} s")
        if not self._stores.num_held:
            return
        if self.ensure_registered():
            for part in self._stores.take_held(lambda p: p.next_try <= now):
                self._send_stores([part], part.event)
        elif self._refused:  # serving without the cache from now on: skipped, as new stores are
            for part in self._stores.take_held(lambda p: True):
                self._finish_store(part)

    def _settle_store(self, batch: StoreBatch, now: float) -> None:
        error = batch.future.exception()
        if error is not None:
            self._note_error(str(error))
            for part in batch.parts:
                if isinstance(error, RequestTimeoutError) and batch.target is not None:
                    part.unanswered.add(batch.target)  # it may still run: fenced before it is done
                if isinstance(error, ServerError) and error.code in PERMANENT_ERRORS:
                    self._give_up(part, str(error))
                else:  # sent again: the daemon only reads the blocks, which vLLM keeps meanwhile
                    self._hold(part, part.op, now, str(error))
            return
        outcomes = batch.future.result().outcomes
        for part in batch.parts:
            count = self._num_chunks(part.op)
            mine, outcomes = outcomes[:count], outcomes[count:]
            no_space = [i for i, outcome in enumerate(mine) if outcome == ChunkOutcome.NO_SPACE]
            if no_space:
                why = f"no space for {len(no_space)} chunk(s) in the daemon's pool"
                self._hold(part, self._chunks_of(part.op, no_space), now, why)
            else:
                self._finish_store(part)

    def _hold(self, part: PendingStore, op: LoadStoreOp, now: float, why: str) -> None:
        """Hold what is left of a part for another try, unless its tries are spent."""
        if part.dropped:
            self._finish_store(part)
            return
        part.op = op
        part.give_up_at = min(part.give_up_at, now + self._store_retry_s)
        if part.sends >= MAX_STORE_SENDS or now >= part.give_up_at:
            self._give_up(part, why)
            return
        part.next_try = now + min(STORE_FIRST_RETRY_S * 2 ** max(part.sends - 1, 0), STORE_MAX_RETRY_S)
        for old in self._stores.held(part):
            self._give_up(old, "too many stores held for another try")

    def _give_up(self, part: PendingStore, why: str) -> None:
        logger.warning("store for request %s gave up after %d attempt(s), %d chunk(s) not stored: %s",
                       part.request_id, part.sends, self._num_chunks(part.op), why)
        self._finish_store(part)

    def _finish_store(self, part: PendingStore) -> None:
        """The part is done (stored, given up, or dropped): its request may be reported finished
        and its blocks freed, once each daemon registration that left a send of it unanswered
        has confirmed it will not read them any more (or is gone)."""
        targets, part.unanswered = part.unanswered, set()
        if not targets:
            self._stores.done(part)
            return
        left = [len(targets)]

        def release() -> None:
            left[0] -= 1
            if not left[0]:
                self._stores.done(part)

        for target in targets:
            self._fences.hold("store", part.request_id, target, release)

    def _num_chunks(self, op: LoadStoreOp) -> int:
        """The chunks a store of `op` covers: one outcome each in its reply."""
        if op.block_hashes is not None:
            return len(op.block_hashes) // self.blocks_in_chunk
        chunk_tokens = self.blocks_in_chunk * self._vllm_block_size
        end = min(op.end or len(op.token_ids or ()), len(op.token_ids or ()))
        return max(0, end // chunk_tokens - op.start // chunk_tokens)

    def _chunks_of(self, op: LoadStoreOp, chunks: list[int]) -> LoadStoreOp:
        """An op of just these chunks of `op`. A token-mode op is kept whole: its key names a
        token range (the chunks that landed come back ALREADY_PRESENT)."""
        if op.block_hashes is None:
            return op
        n = self.blocks_in_chunk
        spans = [slice(i * n, (i + 1) * n) for i in chunks]
        return LoadStoreOp([b for s in spans for b in op.block_ids[s]],
                           block_hashes=[h for s in spans for h in op.block_hashes[s]])

    def retrieve_now(self, request_ids: list[str], ops: list[LoadStoreOp], timeout_s: float,
                     event: torch.cuda.Event | None = None) -> dict[str, list[int]]:
        """A synchronous load: retrieve and wait (`start_retrieve`, then `finish_retrieve`)."""
        return self.finish_retrieve(self.start_retrieve(request_ids, ops, event), timeout_s)

    def start_retrieve(self, request_ids: list[str], ops: list[LoadStoreOp],
                       event: torch.cuda.Event | None = None) -> SyncLoad:
        """Send a synchronous load; `finish_retrieve` waits for it. Not reported by
        `get_finished`."""
        load = SyncLoad(request_ids, _PerRequestOps())
        self._submit(RequestType.RETRIEVE, load.tracker, request_ids, ops, event)
        return load

    def finish_retrieve(self, load: SyncLoad, timeout_s: float) -> dict[str, list[int]]:
        """Wait for a load sent by `start_retrieve`. Returns the requests that did not load
        (failed, refused or timed out) -> their block ids. One that got no reply in time is
        returned only once the daemon has confirmed that it will not write into its blocks any
        more, or is gone (see the module docstring)."""
        request_ids, tracker = load.request_ids, load.tracker
        tracker.wait(request_ids, timeout_s)
        done = tracker.poll()
        failed: dict[str, list[int]] = {}
        fenced: list[str] = []
        for rid in request_ids:
            outcome = done.get(rid)
            blocks, sent = tracker.take_blocks(rid), tracker.take_sent(rid)
            if sent is not None and (outcome is None or outcome.unanswered):
                self._fence_load(rid, blocks, sent)  # no reply yet: it may still run
                fenced.append(rid)
            elif outcome is None or outcome.failure:
                failed[rid] = blocks
                logger.warning("load for request %s failed, vLLM will recompute: %s", rid,
                               "timed out" if outcome is None else outcome.failure)
        if fenced:
            self._fences.wait(set(fenced))
            failed.update((rid, self._unfenced.pop(rid)) for rid in fenced)
        return failed

    def get_finished(self, finished_req_ids_from_engine: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose stores are all done and which vLLM has finished, requests whose
        retrieves are done). Each id is returned once. Failed retrieves are also recorded
        for `take_failed_retrieves`."""
        self._advance_stores()
        finished_stores: set[str] = set()
        for request_id in finished_req_ids_from_engine | self._finished_by_engine:
            if self._stores.has(request_id):
                self._finished_by_engine.add(request_id)
            elif request_id not in self._reported:
                finished_stores.add(request_id)
                self._finished_by_engine.discard(request_id)
                self._remember(request_id)
            else:
                self._finished_by_engine.discard(request_id)
        finished_retrieves: set[str] = set()
        for request_id, outcome in self._retrieves.poll().items():
            blocks, sent = self._retrieves.take_blocks(request_id), self._retrieves.take_sent(request_id)
            if outcome.unanswered and sent is not None:
                self._fence_load(request_id, blocks, sent)
                continue
            finished_retrieves.add(request_id)
            if outcome.failure:
                self._note_error(outcome.failure)
                logger.warning("retrieve for request %s failed, vLLM will recompute: %s", request_id,
                               outcome.failure)
                self._failed_retrieves[request_id] = blocks
        self._fences.advance()
        self._failed_retrieves.update(self._unfenced)
        finished_retrieves.update(self._unfenced)
        self._unfenced = {}
        return finished_stores, finished_retrieves

    def wait_for_retrieves(self, timeout_s: float) -> None:
        """Block until every retrieve in flight is answered (or times out), or `timeout_s` passed;
        `get_finished` reports them."""
        self._retrieves.wait(None, timeout_s)

    def take_failed_retrieves(self) -> dict[str, list[int]]:
        """Requests whose retrieve failed since the last call -> the block ids not loaded."""
        failed, self._failed_retrieves = self._failed_retrieves, {}
        return failed

    # ---- fenced loads (see fences.py) -----------------------------------------------------------

    def _fence_load(self, request_id: str, blocks: list[int], sent: _Sent) -> None:
        self._fences.hold("load", request_id, sent.target,
                          lambda: self._unfenced.__setitem__(request_id, blocks), keepalive=sent.events)

    def _note_error(self, failure: str) -> None:
        if ErrorCode.UNKNOWN_INSTANCE.name in failure:
            self._registered = False  # the daemon restarted: register again

    def _remember(self, request_id: str) -> None:
        self._reported[request_id] = None
        while len(self._reported) > _REPORTED_MEMORY:
            self._reported.popitem(last=False)

    def wait_for_stores(self, request_ids: Iterable[str], timeout_s: float) -> None:
        """Block until the stores of these requests are done: their blocks are about to be
        reused, e.g. after a preemption. None of their chunks is sent again after that. Sends
        on the wire get their reply or time out (within `timeout_s`); one that timed out is
        waited for until the daemon confirms it will not read the blocks (or is gone)."""
        request_ids = set(request_ids)
        self._stores.wait(request_ids, timeout_s)
        for part in self._stores.drop(request_ids):
            self._finish_store(part)
        self._advance_stores()  # settles the replies (and timeouts) that came meanwhile
        self._fences.wait(request_ids)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

    def shutdown(self) -> None:
        try:
            if self._registered:
                send_lmcache_request(self.mq_client, RequestType.UNREGISTER_KV_CACHE,
                                     [self.instance_id]).result(5.0)
        except (LMCacheMPError, ServerError) as err:
            logger.info("unregister at shutdown failed (%s); the daemon drops us anyway", err)
        finally:
            if self._channel is not None:
                self._channel.close()
            self._fences.close()
            self.mq_client.close()

