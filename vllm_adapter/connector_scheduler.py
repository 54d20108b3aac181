"""The scheduler half of `LMCacheMPDaemonConnector`, in vLLM's EngineCore process.

It decides, per request, what the daemon holds (one LOOKUP, sent when the request arrives),
what to load (whole chunks beyond vLLM's own prefix-cache hit, and the request's tail after them:
the part of its history past its last full chunk, stored when an earlier turn finished,
`vllm_adapter.tails`; `load_mode` says whether before the request's forward pass or while the
engine steps on) and what to store (each new full chunk once its KV is computed, and the tail when
the request finishes), and hands that to the workers as `LMCacheMPConnectorMetadata`. With
`kv_events`, the chunks it stores are tracked, and the daemon's stores and evictions of them go
into vLLM's KV event stream (`vllm_adapter.kv_events`). It
waits on the daemon only within `lookup_wait_ms` per step: a lookup still pending after that
keeps the request waiting (vLLM asks again next step), and an absent daemon means 0 hits. For a
hybrid model each of these is done per KV cache group (`group_adapters`), and the sliding-window
blocks it will store are held in vLLM's block pool until stored (`block_holds`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_mp.protocol import TailHit, TailNote
from vllm_adapter.block_holds import BlockHolds
from vllm_adapter.connector_common import (
    CONNECT_TIMEOUT_S,
    BackgroundConnect,
    ConnectorSettings,
    LMCacheMPConnectorMetadata,
    LMCacheMPWorkerMeta,
)
from vllm_adapter.group_adapters import RequestOps, SchedulerGroups, connect_groups, group_op, request_ops
from vllm_adapter.heartbeat import Heartbeat
from vllm_adapter.kv_events import EngineEvents
from vllm_adapter.kv_groups import NULL_BLOCK_ID, KVGroup, skip_null_blocks
from vllm_adapter.ops import SKIP_BLOCK, LoadStoreOp
from vllm_adapter.request_params import RequestParams
from vllm_adapter.scheduler_adapter import LMCacheMPSchedulerAdapter, reset_models
from vllm_adapter.tails import finish_store, longest_own_tail, may_have_tail

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# How a request whose tail is stored ended (vLLM's `RequestStatus` names): not aborted, nor failed.
_ENDED_AS_ASKED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})


@dataclass
class _RequestState:
    request: Request  # vLLM's live object: its block hashes grow as tokens complete blocks
    params: RequestParams  # its own settings (kv_transfer_params)
    loads: bool = True  # looked up and loaded: the engine's kv_role and the request's switch
    stores: bool = True  # its chunks stored: likewise
    lookup_sent: bool = False
    hit_tokens: int | None = None  # tokens the daemon holds for this prompt, once known
    local_tokens: int = 0  # vLLM's own (block-aligned) prefix hit offered with that answer
    load_planned: bool = False  # one load per request: after a failure or preemption, recompute
    sync_load: bool = False  # its load, once planned, completes before its forward pass
    leases_released: bool = False
    saved_chunks: int = 0  # leading chunks the daemon holds: its hit, then what we stored
    has_stores: bool = False  # a store went out: the workers report the id in finished_sending
    held_to: int | None = None  # sliding-window blocks before this index are held or stored
    tail: TailNote | None = None  # the tail in its hit (an earlier turn's), with its anchor


class SchedulerSide:
    """Per-request bookkeeping for one engine; called only from EngineCore's thread."""

    def __init__(self, settings: ConnectorSettings, model_name: str, world_size: int, rank: int,
                 block_size: int, groups: list[KVGroup] | None = None, *, loads: bool = True,
                 stores: bool = True, kv_bytes_per_token: int = 0, kv_events: bool = False):
        """`loads` / `stores`: vLLM's `kv_role` (a "kv_consumer" never stores, a "kv_producer"
        never looks up nor loads; "kv_both" does both). `kv_bytes_per_token`: what a load copies
        per token on each rank (0: unknown, every load counts as small). `kv_events`: vLLM
        publishes KV events (`take_events` then reports the daemon's share)."""
        groups = groups or [KVGroup(0, (), None, model_name)]
        self._loads, self._stores = loads, stores
        self._block_size = block_size
        self._groups = groups
        self._sliding = [group for group in groups if group.sliding_window is not None]
        self._world_size = world_size
        self._save_decode_cache = settings.save_decode_cache
        self._load_mode = settings.load_mode
        self._kv_bytes_per_token = kv_bytes_per_token
        self._sync_load_max_bytes = settings.sync_load_max_mb * 2**20
        self._lookup_wait_s = settings.lookup_wait_ms / 1000
        self._lookup_wait_left = self._lookup_wait_s  # this step's, across requests
        self._reconnect_interval_s = settings.reconnect_interval_s
        self._timeout_s = settings.timeout_s

        def connect(group: KVGroup) -> LMCacheMPSchedulerAdapter:
            return LMCacheMPSchedulerAdapter(settings.url, None, group.namespace, world_size, rank,
                                             block_size, timeout_s=settings.timeout_s,
                                             connect_timeout_s=CONNECT_TIMEOUT_S, curve=settings.curve)

        self._link = BackgroundConnect(lambda: SchedulerGroups(groups, connect_groups(groups, connect)),
                                       settings.reconnect_interval_s, f"scheduler at {settings.url}")
        self._holds: BlockHolds | None = None  # sliding-window blocks held for their stores
        self._step = 0  # counts build_connector_meta calls: names the stores of each step
        self._resets = 0  # counts reset_cache calls: the workers drop the stores they hold
        self._heartbeat: Heartbeat | None = None
        self._chunk_blocks = 0  # vLLM blocks per daemon chunk, known once connected
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, RequestOps] = {}
        self._pending_sync_loads: set[str] = set()
        # The requests the latest step computed, but for those finished since: while any is
        # left, a load in "auto" mode is asynchronous (a sync load would stall their step).
        self._computing: set[str] = set()
        self._events = EngineEvents(block_size) if kv_events else None
        # Tails (`vllm_adapter.tails`) need one group of full attention: vLLM takes a hit that ends
        # inside a block only then.
        self._tails = settings.tails and len(groups) == 1 and not self._sliding
        self._finish_stores: dict[str, RequestOps] = {}  # planned at request_finished, sent next step
        # Give the first attempt a moment, so that the first requests already see the daemon.
        self._link.wait(CONNECT_TIMEOUT_S)

    def bind_block_pool(self, pool: BlockPool) -> None:
        if self._sliding:
            self._holds = BlockHolds(pool, self._world_size)

    def _connected(self) -> SchedulerGroups | None:
        """The adapter once connected, whether or not the daemon answers right now."""
        adapter = self._link.get()
        if adapter is not None and self._heartbeat is None:
            self._heartbeat = Heartbeat(adapter.mq_client, self._reconnect_interval_s)
            self._chunk_blocks = adapter.num_blocks_per_chunk()
        return adapter

    def _daemon(self) -> SchedulerGroups | None:
        """The adapter while the daemon answers, else None."""
        adapter = self._connected()
        return adapter if adapter is not None and self._heartbeat.alive() else None

    # ---- matching ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Send the lookup as the request arrives; it is usually answered before the
        scheduler first considers the request."""
        self._hit_tokens(self._state(request))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if request.num_preemptions > 0 or state.load_planned:
            # Back after a preemption or a failed load (its blocks were freed): recompute.
            return 0, False
        hit = self._hit_tokens(state, wait=True)
        if hit is None:
            return None, True  # lookup pending: vLLM skips the request this step, asks again
        state.local_tokens = num_computed_tokens
        hit = self._capped_hit(state, hit)
        sync = self._loads_synchronously(request, hit, hit - num_computed_tokens)
        if sync:
            hit = self._sync_hit(request, hit)
        new = max(0, hit - num_computed_tokens)
        state.sync_load = sync
        return new, new > 0 and not sync

    def _capped_hit(self, state: _RequestState, hit: int) -> int:
        """The hit a load may cover: at most the request's `max_load_tokens` past vLLM's own prefix
        hit, ending on a chunk boundary (a chunk is loaded whole). A cut hit loses its tail."""
        limit = state.params.max_load_tokens
        if limit is None or hit <= state.local_tokens + limit:
            return hit
        chunk_tokens = self._chunk_blocks * self._block_size
        state.tail = None
        return max(state.local_tokens, (state.local_tokens + limit) // chunk_tokens * chunk_tokens)

    def _stored_through(self, state: _RequestState, end: int) -> int:
        """`end`, or the request's `max_offload_tokens` if fewer: no store goes past it."""
        limit = state.params.max_offload_tokens
        return end if limit is None else min(end, limit)

    def _loads_synchronously(self, request: Request, hit: int, tokens: int) -> bool:
        """Whether the request's load (of `tokens`) runs right before its forward pass
        (`load_mode`). "auto" takes the sync load's step sooner where it loses no hit and costs
        little: where no other request computes (a sync load holds up the step's forward pass),
        or where the copy is small (`sync_load_max_mb`): the others wait for a copy of
        milliseconds, where an async load costs its own request a whole step (under load, a step
        of other requests' prefills)."""
        if self._load_mode != "auto":
            return self._load_mode == "sync"
        if self._sync_hit(request, hit) != hit:
            return False
        return not self._computing or tokens * self._kv_bytes_per_token <= self._sync_load_max_bytes

    def _sync_hit(self, request: Request, hit: int) -> int:
        """vLLM must compute at least one token itself: a sync load stops a chunk short of a
        hit that covers the whole request. (No hit before the daemon answers, nor a chunk size.)"""
        if hit < request.num_tokens:
            return hit
        chunk_tokens = self._chunk_blocks * self._block_size
        return (request.num_tokens - 1) // chunk_tokens * chunk_tokens

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            params = RequestParams.of(request)
            state = self._requests[request.request_id] = _RequestState(
                request, params, loads=self._loads and not params.skip_load,
                stores=self._stores and not params.skip_save)
        return state

    def _hit_tokens(self, state: _RequestState, wait: bool = False) -> int | None:
        """`wait`: the lookup may be waited for, within this step's `lookup_wait_ms`."""
        if state.hit_tokens is None:
            state.hit_tokens = self._poll_lookup(state, wait)
            if state.hit_tokens:  # only a connected daemon reports hits
                state.saved_chunks = state.hit_tokens // (self._chunk_blocks * self._block_size)
        return state.hit_tokens

    def _poll_lookup(self, state: _RequestState, wait: bool) -> int | None:
        request = state.request
        if not state.loads or request.skip_reading_prefix_cache:
            return 0  # no lookup either: its hits would only be leased for nothing
        adapter = self._daemon()
        if adapter is None:
            return 0
        tails = self._tails and may_have_tail(request)
        if not state.lookup_sent:
            adapter.maybe_submit_lookup_request(request.request_id, block_hashes=list(request.block_hashes),
                                                tails=tails)
            state.lookup_sent = True
        # Usually answered within a millisecond: then the request is scheduled, its load planned,
        # in this step rather than one step later (a whole decode step of the other running
        # requests, when there are any).
        wait_s = max(0.0, self._lookup_wait_left) if wait else 0.0
        start = time.monotonic()
        hit = adapter.check_lookup_result(request.request_id, wait_s=wait_s)
        if wait_s:
            self._lookup_wait_left -= time.monotonic() - start
        if hit is not None:
            if tails:
                hit += self._own_tail(state, adapter.lookup_tails(request.request_id), hit)
            adapter.cleanup_lookup_result(request.request_id)
        return hit

    def _own_tail(self, state: _RequestState, tails: list[TailHit], hit: int) -> int:
        """The tokens of the request's own tail among `tails` (noted after its chunk hit, which ends
        at token `hit`): the longest whose key its tokens reproduce; 0 if none."""
        request = state.request
        tail = longest_own_tail(tails, request, hit, self._block_size)
        if tail is None:
            return 0
        anchor = request.block_hashes[hit // self._block_size - 1] if hit else b""
        state.tail = TailNote(anchor, tail)
        return tail.num_tokens

    # ---- loads ---------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the `num_external_tokens` granted beyond the local hit. vLLM 0.32
        passes every block of the request here (and calls again after an async load), so
        the block list is read as the whole table, never appended to."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens == 0:
            self._release_leases(state)  # the lookup's hits will not be read
            return
        tables = blocks.get_block_ids()
        size = self._block_size
        local_blocks = state.local_tokens // size
        hit_end = state.local_tokens + num_external_tokens
        chunks_end = self._chunk_hit(state)
        # The hit's tail is loaded whole (its blocks past the hit's end, if any, are skipped) when
        # the hit granted reaches into it; a sync load stops before it (`_sync_hit`).
        tail = state.tail.tail if state.tail is not None and hit_end > chunks_end else None
        end = (chunks_end if tail is not None else hit_end) // size  # the whole chunks' end
        stop, granted = end + (tail.num_blocks if tail is not None else 0), -(-hit_end // size)
        # Chunk keys stride from the op's first block, so the op starts on a chunk boundary;
        # blocks vLLM already holds in that first chunk (maybe shared with other requests)
        # are SKIP_BLOCK: the daemon leaves them alone. So are a sliding-window group's null blocks:
        # outside the window before the hit's end, vLLM never reads them.
        start = local_blocks - local_blocks % self._chunk_blocks
        hashes = list(request.block_hashes[start:end])
        self._pending_loads[request.request_id] = request_ops([
            LoadStoreOp(skip_null_blocks([SKIP_BLOCK if i < local_blocks or i >= granted
                                          else tables[group.index][i] for i in range(start, stop)]),
                        block_hashes=hashes,
                        tail_hash=tail.tail_hash if tail is not None else None)
            for group in self._groups])
        state.load_planned = True
        if state.sync_load:
            self._pending_sync_loads.add(request.request_id)
        self._release_unloaded(state, start, end)

    def _chunk_hit(self, state: _RequestState) -> int:
        """The tokens of the hit's whole chunks: all of it but its tail."""
        return (state.hit_tokens or 0) - (state.tail.tail.num_tokens if state.tail is not None else 0)

    def _release_unloaded(self, state: _RequestState, start: int, end: int) -> None:
        """The lookup leased every hit chunk, but the load reads only blocks [start, end):
        the hit chunks before it (inside vLLM's own prefix hit) and after it (a sync load
        stops a chunk short) are released now, not pinned until the request ends. (A tail left
        unloaded stays leased until then: at most one chunk.)"""
        adapter = self._link.get()
        hit_blocks = self._chunk_hit(state) // self._block_size
        hashes = state.request.block_hashes
        unloaded = [*hashes[:start], *hashes[end:hit_blocks]]  # whole chunks: both bounds are aligned
        if unloaded and adapter is not None:
            adapter.release_leases(state.request.request_id, unloaded)

    def _release_leases(self, state: _RequestState) -> None:
        adapter = self._link.get()
        if state.hit_tokens and not state.load_planned and not state.leases_released and adapter is not None:
            adapter.end_session(state.request.request_id)
            state.leases_released = True

    # ---- per step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheMPConnectorMetadata:
        self._lookup_wait_left = self._lookup_wait_s  # a new step's
        self._step += 1
        self._computing = set(scheduler_output.num_scheduled_tokens)
        preempted = set(scheduler_output.preempted_req_ids or ())
        meta = LMCacheMPConnectorMetadata(loads=self._pending_loads, preempted=preempted,
                                          sync_loads=self._pending_sync_loads, step=self._step,
                                          idle=scheduler_output.total_num_scheduled_tokens == 0,
                                          resets=self._resets)
        self._pending_loads, self._pending_sync_loads = {}, set()
        meta.stores.update(self._finish_stores)  # with the finished ids: their workers wait for them
        self._finish_stores = {}
        for req_id in preempted:  # its blocks are freed, and recomputed in new ones
            self._drop_holds(req_id)
        if not self._stores or self._connected() is None:
            return meta  # a consumer's, or never connected yet: nobody to store to
        # Stores are planned even while the heartbeat says the daemon is away: a store costs
        # vLLM nothing (the worker drops it at once if it is not registered), and right after
        # a restart the heartbeat lags by a step while the worker has registered again.
        block_state = scheduler_output.kv_connector_block_state
        assert block_state is not None, "vLLM offers block tables while building connector metadata"
        cached = scheduler_output.scheduled_cached_reqs
        computed_before = [(new.req_id, new.num_computed_tokens)
                           for new in scheduler_output.scheduled_new_reqs]
        computed_before += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for req_id, before in computed_before:
            state = self._requests.get(req_id)
            if state is None or not state.stores:
                continue
            computed = before + scheduler_output.num_scheduled_tokens[req_id]
            ops = self._plan_store(state, computed, block_state)
            if ops is not None:
                meta.stores[req_id] = ops
        return meta

    def _plan_store(self, state: _RequestState, computed: int,
                    block_state: KVConnectorBlockState) -> RequestOps | None:
        """A store of the full chunks that are computed once this step has run and that the
        daemon does not hold yet (neither its hit nor our earlier stores), one op per group."""
        request = state.request
        limit = self._stored_through(
            state, request.num_tokens if self._save_decode_cache else request.num_prompt_tokens)
        full_blocks = min(min(computed, limit) // self._block_size, len(request.block_hashes))
        chunks = full_blocks // self._chunk_blocks
        tables = block_state.get_block_ids(request.request_id)
        assert tables is not None, f"no block table for scheduled request {request.request_id}"
        # Blocks past the prompt's last full chunk are never stored: not held either.
        prompt_end = limit // self._block_size // self._chunk_blocks * self._chunk_blocks
        self._hold_sliding_blocks(state, tables, full_blocks if self._save_decode_cache
                                  else min(full_blocks, prompt_end))
        if chunks <= state.saved_chunks:
            return None
        start, end = state.saved_chunks * self._chunk_blocks, chunks * self._chunk_blocks
        hashes = list(request.block_hashes[start:end])
        ops = request_ops([self._group_store(group, tables[group.index][start:end], hashes)
                           for group in self._groups])
        if self._events is not None:
            self._track(request, ops, start)
        if self._holds is not None:
            self._holds.to_store(request.request_id, end, self._step)
        state.saved_chunks = chunks
        state.has_stores = True
        return ops

    def _track(self, request: Request, ops: RequestOps, start: int) -> None:
        """Tell the event follower the chunks of this store, with what vLLM's events say of their
        blocks. A chunk's key is the hash of its last block (`ops.striding_block_hashes`)."""
        assert self._events is not None
        n, size = self._chunk_blocks, self._block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        lora = getattr(request, "lora_request", None)
        for group in self._groups:
            op = group_op(ops, group)
            if op is None:
                continue
            stored = op.block_hashes or []
            for i in range(0, len(stored), n):
                blocks = list(stored[i:i + n])
                # A sliding-window group's store skips the chunks it lacks: find where each starts.
                first = start + i if group.sliding_window is None else hashes.index(blocks[0], start)
                self._events.track(group.namespace, group.index, blocks[-1], blocks,
                                   hashes[first - 1] if first else None,
                                   list(tokens[first * size:(first + n) * size]), lora)

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's events for the daemon's share of this engine's blocks (see `kv_events`)."""
        if self._events is None:
            return []
        adapter = self._link.get()
        return self._events.take(adapter.mq_client if adapter is not None else None)

    def _group_store(self, group: KVGroup, block_ids: list[int], hashes: list[bytes]) -> LoadStoreOp | None:
        """One group's share of a store. A sliding-window group stores only the chunks all of
        whose blocks it still has (vLLM's own prefix hit gives it null blocks outside the window)."""
        if group.sliding_window is None:
            return LoadStoreOp(block_ids, block_hashes=hashes)
        n = self._chunk_blocks
        whole = [slice(i, i + n) for i in range(0, len(block_ids), n)
                 if NULL_BLOCK_ID not in block_ids[i:i + n]]
        if not whole:
            return None
        return LoadStoreOp([b for s in whole for b in block_ids[s]],
                           block_hashes=[h for s in whole for h in hashes[s]])

    def _hold_sliding_blocks(self, state: _RequestState, tables: tuple[list[int], ...], end: int) -> None:
        """Hold the sliding-window blocks before `end` that this step completes, of chunks still to
        be stored, before the next step may free them (see `block_holds`)."""
        if self._holds is None:
            return
        if state.held_to is None:
            state.held_to = state.saved_chunks * self._chunk_blocks
        blocks = [(i, tables[group.index][i]) for group in self._sliding
                  for i in range(state.held_to, end) if tables[group.index][i] != NULL_BLOCK_ID]
        self._holds.hold(state.request.request_id, blocks)
        state.held_to = max(state.held_to, end)

    def _drop_holds(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is not None:
            state.held_to = None
        if self._holds is not None:
            self._holds.drop_pending(req_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.failed_recving:
            state = self._requests.get(req_id)
            if state is not None:
                state.saved_chunks = 0  # the daemon may have lost them: store what vLLM recomputes
            self._drop_holds(req_id)  # held again from the start as vLLM recomputes
        if self._holds is None:
            return
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, LMCacheMPWorkerMeta):
            for rank, done in worker_meta.stores_done.items():
                for req_id, step in done.items():
                    self._holds.stores_done(req_id, rank, step)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...] = ()) -> bool:
        """Forget the request, once its tail's store is planned (`block_ids`: its block table per
        group; none, no tail); True if its blocks must stay until the workers report its stores
        done (in finished_sending)."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.stores and block_ids and self._tails and may_have_tail(request):
            self._plan_finish_store(state, block_ids[0])
        self._computing.discard(request.request_id)
        if self._holds is not None:
            self._holds.finish(request.request_id)
        adapter = self._link.get()
        if adapter is not None and state is not None and state.lookup_sent:
            adapter.cleanup_lookup_result(request.request_id)
        if adapter is not None and (state is None or state.lookup_sent or state.has_stores):
            # Releases the request's leases (aborted requests too) and its session; a request
            # that neither looked up nor stored has neither: no message.
            adapter.end_session(request.request_id)
        return state is not None and state.has_stores

    def _plan_finish_store(self, state: _RequestState, block_ids: list[int]) -> None:
        """Store what the request computed past its stored chunks, its tail included, with the next
        step; note the tail to the daemon, and the tail it loaded as superseded. Only a request
        that ended as asked (not aborted), and whose every computed token's KV is written: all
        but the last token's."""
        request = state.request
        adapter = self._connected()
        if adapter is None or request.status.name not in _ENDED_AS_ASKED:
            return
        end = min(request.num_computed_tokens, request.num_tokens - 1)
        if not self._save_decode_cache:
            end = min(end, request.num_prompt_tokens)
        end = self._stored_through(state, end)
        store = finish_store(request, block_ids, state.saved_chunks, self._chunk_blocks, self._block_size,
                             end)
        stored: list[TailNote] = []
        if store is not None:
            ops = request_ops([store.op])
            self._finish_stores[request.request_id] = ops
            if self._events is not None:
                self._track(request, ops, state.saved_chunks * self._chunk_blocks)
            state.has_stores = True
            stored = [store.note] if store.note is not None else []
        # The tail it loaded is superseded either way: its tokens are in what this request stored.
        superseded = [state.tail] if state.tail is not None and state.tail not in stored else []
        if stored or superseded:
            adapter.note_tails(stored, superseded)

    # ---- reset ---------------------------------------------------------------------------

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (the weights changed): the daemon drops
        every chunk of this engine's model, each KV cache group's; the requests waiting with a lookup
        answered before look up again. False (logged) where the daemon could not confirm.

        vLLM's own reset succeeds only with every block free: no request computing, no store of
        ours pending (they hold their requests' blocks). When it fails, stores of the old KV may
        still land after this: the caller resets again (vLLM's result is False either way). The
        stores the workers hold for another try (NO_SPACE, the daemon away) are given up at their
        next step, which carries the count of resets: sent again, they would store the old KV."""
        self._resets += 1
        adapter = self._connected()
        for request_id, state in self._requests.items():
            if state.lookup_sent and not state.load_planned and not state.has_stores:
                if adapter is not None:
                    adapter.cleanup_lookup_result(request_id)
                    adapter.end_session(request_id)  # the old lookup's leases
                state.lookup_sent, state.hit_tokens, state.tail, state.saved_chunks = False, None, None, 0
        if adapter is None:
            logger.error("lmcache-mp: resetting the KV of %s failed: the daemon is not connected; what it "
                         "holds of the model may be served once it is", self._groups[0].namespace)
            return False
        return reset_models(adapter.mq_client, [group.namespace for group in self._groups], self._timeout_s)

    def shutdown(self) -> None:
        self._link.close()
