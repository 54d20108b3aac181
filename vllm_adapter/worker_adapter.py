"""The worker's adapter: its STOREs and RETRIEVEs, on the registration `registration.py` keeps.

The API follows the seed's `LMCacheMPWorkerAdapter` (same constructor and method names).
Differences, each fixing a known failure of the seed:
- every operation is tracked per request, also inside batches, so no request id is lost;
- a failed or refused retrieve is reported (`take_failed_retrieves`), never passed off as
  loaded, so vLLM recomputes instead of attending over garbage;
- while the daemon is away (until `registration.py` has registered again) retrieves fail and
  stores are held, sent once it is back (bounded in number and age);
- a store whose chunks did not land for a reason that may pass (no space, an overloaded or
  restarting daemon, a timeout) is sent again with backoff (`store_retry.py`), its request
  reported finished only after that (vLLM keeps its blocks until then);
- a RETRIEVE or STORE that got no reply in time is not given up at once: the daemon may still
  run it, and once vLLM reuses the blocks a late copy would overwrite another request's KV or
  cache it under this request's keys. It is *fenced* (`fences.py`) until the daemon confirms
  CANCEL_TRANSFERS or is gone; `retrieve_now` (sync loads) and `wait_for_stores`
  (preemption) wait for that too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import LMCacheMPError, RequestTimeoutError, ServerError
from lmcache_mp.mq.client import MessagingFuture
from lmcache_mp.protocol import PERMANENT_ERRORS, ChunkOutcome, ErrorCode, RequestType
from vllm_adapter.fences import Fences
from vllm_adapter.loads import LoadTracker, SentLoad, SyncLoad
from vllm_adapter.ops import DEFAULT_TIMEOUT_S, KeyMaker, LoadStoreOp, connect
from vllm_adapter.registration import REREGISTER_INTERVAL_S, WorkerRegistration
from vllm_adapter.store_retry import MAX_HELD_STORES, PendingStore, StoreBatch, StoreTracker

logger = logging.getLogger(__name__)

# Finished request ids remembered to report each exactly once (bounded).
_REPORTED_MEMORY = 100_000


class LMCacheMPWorkerAdapter:
    """A vLLM worker's client of the daemon: its caches' stores and loads."""

    def __init__(self, server_url: str, context: zmq.Context | None, model_name: str, world_size: int,
                 kv_rank: int, vllm_block_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float | None = None,
                 reregister_interval_s: float = REREGISTER_INTERVAL_S, instance_id: int | None = None,
                 store_retry_s: float | None = None, max_held_stores: int = MAX_HELD_STORES,
                 curve: ClientCurve | None = None, replicated: bool = False,
                 on_stored: Callable[[int, float], None] | None = None):
        """`instance_id`: the id to register under (default: a random one, `new_instance_id`).
        `store_retry_s`: how long a store that did not land (or went unsent while the daemon
        was away) is tried again (default `timeout_s`); `max_held_stores`: how many such
        stores are held at most. `curve`: the keys to authenticate with, for a daemon that
        requires CURVE. `replicated`: every rank of the world holds the same KV bytes (MLA
        under tensor parallelism alone; `KVCacheRegistration.replicated`). `on_stored(blocks, seconds)`
        hears of each STORE that copied blocks: how many, and how long after its sending."""
        self.server_url = server_url
        self.mq_client, chunk_size = connect(server_url, context, f"vllm-worker-{kv_rank}", timeout_s,
                                             vllm_block_size, connect_timeout_s, curve)
        self._keys = KeyMaker(model_name, world_size, kv_rank, chunk_size // vllm_block_size, vllm_block_size)
        self._fences = Fences(self.mq_client, server_url, timeout_s)  # held until the daemon confirms
        self.registration = WorkerRegistration(
            self.mq_client, server_url, self._keys, self._fences, timeout_s=timeout_s,
            reregister_interval_s=reregister_interval_s, instance_id=instance_id, replicated=replicated)
        self._store_retry_s = timeout_s if store_retry_s is None else store_retry_s
        self._stores = StoreTracker(max_held_stores)
        self._retrieves = LoadTracker()
        self._finished_by_engine: set[str] = set()  # finished in vLLM, stores in flight or held
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._failed_retrieves: dict[str, list[int]] = {}
        self._unfenced: dict[str, list[int]] = {}  # loads released, not reported yet -> blocks
        self._on_stored = on_stored

    @property
    def instance_id(self) -> int:
        return self.registration.instance_id

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self.registration.kv_caches

    @property
    def blocks_in_chunk(self) -> int:
        return self._keys.blocks_in_chunk

    # ---- registration (registration.py) ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str | None = None) -> None:
        """Register the caches with the daemon. `layout` is vLLM's attention backend name
        (e.g. "CPU_ATTN"); without it the daemon infers the layout from the shapes. Raises what
        made it fail; `ensure_registered` then retries with backoff, unless the daemon refused
        the caches as invalid (logged once as an ERROR): the worker then serves without them."""
        self.registration.register(kv_caches, layout)

    def ensure_registered(self) -> bool:
        """See `WorkerRegistration.ensure_registered`."""
        return self.registration.ensure_registered()

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
        if not registered and self.registration.refused:
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

    def _submit(self, request_type: RequestType, tracker: LoadTracker, request_ids: list[str],
                ops: list[LoadStoreOp], event: torch.cuda.Event | None) -> None:
        registered = self.ensure_registered()
        target = None
        if not registered:
            unavailable = LMCacheMPError("KV offload to lmcache-mp is off for this worker"
                                         if self.registration.refused else "lmcache-mp daemon unavailable")
            future = MessagingFuture.settled(request_type, error=unavailable)
        else:
            keys = [k for rid, op in zip(request_ids, ops, strict=True) for k in self._keys.keys_for(rid, op)]
            block_ids = [b for op in ops for b in op.block_ids]
            event_handle = event.ipc_handle() if event is not None else b""
            future = self.mq_client.submit(request_type, [keys, self.instance_id, block_ids, event_handle])
            target = self.registration.target()  # to fence it, should it time out
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
        future = self.mq_client.submit(RequestType.STORE, [keys, self.instance_id, block_ids, event_handle])
        self._stores.sent(future, parts, self.registration.target())

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
        elif self.registration.refused:  # serving without the cache from now on: skipped, as new stores are
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
        stored_blocks = 0
        for part in batch.parts:
            count = self._keys.num_chunks(part.op)
            mine, outcomes = outcomes[:count], outcomes[count:]
            stored_blocks += sum(blocks for blocks, outcome in zip(self._keys.chunk_blocks(part.op), mine,
                                                                   strict=False)
                                 if outcome == ChunkOutcome.STORED)
            no_space = [i for i, outcome in enumerate(mine) if outcome == ChunkOutcome.NO_SPACE]
            if no_space:
                why = f"no space for {len(no_space)} chunk(s) in the daemon's pool"
                self._hold(part, self._keys.chunks_of(part.op, no_space), now, why)
            else:
                self._finish_store(part)
        if stored_blocks and self._on_stored is not None:
            self._on_stored(stored_blocks, now - batch.sent_at)

    def _hold(self, part: PendingStore, op: LoadStoreOp, now: float, why: str) -> None:
        """Hold what is left of a part for another try, unless its tries are spent."""
        if part.dropped:
            self._finish_store(part)
            return
        part.op = op
        if not part.schedule_retry(now, self._store_retry_s):
            self._give_up(part, why)
            return
        for old in self._stores.held(part):
            self._give_up(old, "too many stores held for another try")

    def _give_up(self, part: PendingStore, why: str) -> None:
        logger.warning("store for request %s gave up after %d attempt(s), %d chunk(s) not stored: %s",
                       part.request_id, part.sends, self._keys.num_chunks(part.op), why)
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

    def retrieve_now(self, request_ids: list[str], ops: list[LoadStoreOp], timeout_s: float,
                     event: torch.cuda.Event | None = None) -> dict[str, list[int]]:
        """A synchronous load: retrieve and wait (`start_retrieve`, then `finish_retrieve`)."""
        return self.finish_retrieve(self.start_retrieve(request_ids, ops, event), timeout_s)

    def start_retrieve(self, request_ids: list[str], ops: list[LoadStoreOp],
                       event: torch.cuda.Event | None = None) -> SyncLoad:
        """Send a synchronous load; `finish_retrieve` waits for it. Not reported by
        `get_finished`."""
        load = SyncLoad(request_ids, LoadTracker())
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

    def _fence_load(self, request_id: str, blocks: list[int], sent: SentLoad) -> None:
        self._fences.hold("load", request_id, sent.target,
                          lambda: self._unfenced.__setitem__(request_id, blocks), keepalive=sent.events)

    def _note_error(self, failure: str) -> None:
        if ErrorCode.UNKNOWN_INSTANCE.name in failure:
            self.registration.lost()  # the daemon restarted: register again

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

    def give_up_stores(self, why: str) -> None:
        """None of the stores held for another try or on the wire is sent (again): the model's KV
        was reset, and theirs was computed before. Those on the wire are done at their reply."""
        for part in self._stores.drop_all():
            self._give_up(part, why)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

    def shutdown(self) -> None:
        try:
            self.registration.close()
        finally:
            self._fences.close()
            self.mq_client.close()
