"""The worker half of `LMCacheMPDaemonConnector`, in each vLLM worker process.

It registers the worker's KV caches with the daemon once, then turns each step's metadata
into batched daemon requests: loads (RETRIEVE) when the step starts, stores (STORE) after
the forward pass. Both run asynchronously in the daemon; completions are reported to vLLM
through `get_transfer_results`, failed loads as `failed_recving` plus their block ids, so
that vLLM recomputes instead of attending over KV that never arrived.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from lmcache_mp.errors import LMCacheMPError
from vllm_adapter.connector_common import (
    CONNECT_TIMEOUT_S,
    BackgroundConnect,
    ConnectorSettings,
    LMCacheMPConnectorMetadata,
    LMCacheMPWorkerMeta,
)
from vllm_adapter.group_adapters import RequestOps, WorkerGroups, all_ops, connect_groups
from vllm_adapter.kv_export import record_kv_event
from vllm_adapter.kv_groups import KVGroup
from vllm_adapter.loads import SyncLoad
from vllm_adapter.ops import kept_blocks
from vllm_adapter.stats import LMCacheMPConnectorStats, TransferRecorder
from vllm_adapter.worker_adapter import LMCacheMPWorkerAdapter

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# The pace of vLLM's empty steps while stores are held for another try (see wait_for_save).
IDLE_STEP_PAUSE_S = 0.01
# How long a step that computes nothing waits for the loads in flight (see transfer_results).
IDLE_LOAD_WAIT_S = 0.05


def attention_backend_name(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """vLLM's attention backend for these layers (e.g. "CPU_ATTN"): it names the byte
    layout of the KV cache for the daemon, which the tensor shape alone does not."""
    layers = vllm_config.compilation_config.static_forward_context
    names = {layers[name].attn_backend.get_name() for name in layer_names}
    if len(names) != 1:
        raise ValueError(f"the KV cache layers use attention backends {sorted(names)}; "
                         "LMCacheMPDaemonConnector needs one backend for all layers")
    return names.pop()


class WorkerSide:
    """One worker's caches and transfers; called only from vLLM's model-runner thread."""

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig, model_name: str,
                 world_size: int, rank: int, block_size: int, groups: list[KVGroup] | None = None,
                 replicated: bool = False, block_bytes: Sequence[int] = ()):
        """`replicated`: every rank holds the same KV bytes (`connector.replicated_kv`).
        `block_bytes`: per group, the bytes of one block on this rank (`stats.group_block_bytes`),
        for vLLM's metrics (`take_stats`)."""
        groups = groups or [KVGroup(0, (), None, model_name)]
        self._stats = TransferRecorder(groups, block_bytes or [0] * len(groups), block_size,
                                       counts_tokens=rank == 0)
        self._vllm_config = vllm_config
        self._timeout_s = settings.timeout_s
        self._rank = rank
        # With several groups, block ids overlap across groups: failed loads are reported by
        # request only (vLLM raises on block-level load errors then).
        self._report_failed_blocks = len(groups) == 1
        self._has_sliding = any(group.sliding_window is not None for group in groups)

        def connect(group: KVGroup) -> LMCacheMPWorkerAdapter:
            return LMCacheMPWorkerAdapter(settings.url, None, group.namespace, world_size, rank, block_size,
                                          timeout_s=settings.timeout_s, connect_timeout_s=CONNECT_TIMEOUT_S,
                                          reregister_interval_s=settings.reconnect_interval_s,
                                          curve=settings.curve, replicated=replicated,
                                          on_stored=partial(self._stats.store_landed, group.index))

        self._link = BackgroundConnect(lambda: WorkerGroups(groups, connect_groups(groups, connect)),
                                       settings.reconnect_interval_s, f"worker {rank} at {settings.url}")
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layout = ""
        self._caches_handed_over = False
        self._with_stores: set[str] = set()  # requests that had stores, until reported finished
        self._unsent_loads: dict[str, list[int]] = {}  # loads the daemon never got -> their blocks
        self._load_errors: set[int] = set()
        self._resets_seen = 0  # the scheduler's count of KV resets, as of the last step
        # The sync loads begin_step sent, until start_load_kv has waited for them.
        self._sync_loads: tuple[WorkerGroups, list[str], list[SyncLoad]] | None = None
        # Requests with stores not all reported done -> the latest step that had one, and the step
        # through which they were last reported done (see block_holds).
        self._store_steps: dict[str, int] = {}
        self._reported_through: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self._layout = attention_backend_name(self._vllm_config, list(kv_caches))
        self._link.wait(CONNECT_TIMEOUT_S)
        self._adapter()

    def _adapter(self) -> WorkerGroups | None:
        """The adapter once connected. The caches are handed to it here, on vLLM's model
        thread, never concurrently with a forward pass: on CPU, registering moves them into
        shared memory."""
        adapter = self._link.get()
        if adapter is not None and self._kv_caches and not self._caches_handed_over:
            self._caches_handed_over = True
            try:
                adapter.register_kv_caches(self._kv_caches, self._layout)
            except (LMCacheMPError, OSError) as err:
                # The adapter has logged it: a warning and a retry later, or an ERROR for good.
                logger.debug("registering the KV caches with lmcache-mp failed: %s", err)
        return adapter

    def begin_step(self, meta: LMCacheMPConnectorMetadata) -> None:
        """Runs first in each step's connector work (vLLM's `handle_preemptions`). With the V1
        model runner (vLLM's CPU one) that is before vLLM prepares the step's inputs; with the V2
        runner, the default on GPU, it is in `pre_forward`, after the inputs are prepared and
        right before the forward pass.

        vLLM frees a preempted request's blocks at once and may hand them to another request
        in this very step: its stores must finish reading them first. If the daemon went away,
        this is when the (non-blocking) check for its return goes out, so that by the stores
        after the forward pass the worker is registered again.

        And the step's loads go out now. Under the V1 runner a sync load copies while vLLM
        prepares the step's inputs (~3 ms on a CPU), and the forward pass waits only for what is
        left of it (`start_load_kv`); under V2 the forward pass waits for all of it. In a step
        without sync loads vLLM calls `start_load_kv` only after the forward pass: an async load
        sent there would be reported a step later than one sent here, which copies during the
        forward pass and is reported at its end (the blocks it writes belong to a request that
        this step does not compute)."""
        adapter = self._adapter()
        if adapter is not None:
            if meta.resets != self._resets_seen:
                adapter.give_up_stores("the model's KV was reset since it was computed")
            if meta.preempted:
                adapter.wait_for_stores(meta.preempted, self._timeout_s)
            adapter.ensure_registered()
        self._resets_seen = meta.resets
        self._send_loads(adapter, meta)

    def start_load_kv(self) -> None:
        """The forward pass is next: the sync loads `begin_step` sent must have landed, or their
        blocks be reported bad now so that vLLM recomputes them in this very step."""
        self._finish_sync_loads()

    def _send_loads(self, adapter: WorkerGroups | None, meta: LMCacheMPConnectorMetadata) -> None:
        """Send the step's loads: the sync ones to be waited for by `start_load_kv`, the others
        to be reported by `transfer_results`."""
        # An earlier step's, should vLLM have returned before its start_load_kv (execute_model
        # has such a path, for encoder-cache transfers): their errors must not be lost.
        self._finish_sync_loads()
        self._stats.loads_sent(meta.loads)
        now = {rid: ops for rid, ops in meta.loads.items() if rid in meta.sync_loads}
        later = {rid: ops for rid, ops in meta.loads.items() if rid not in meta.sync_loads}
        if now:  # first: the forward pass waits for these, and nothing queues ahead of them
            if adapter is None:
                self._loads_done(now, {rid: _loaded_blocks(ops) for rid, ops in now.items()})
            else:
                self._sync_loads = (adapter, list(now), adapter.start_retrieve(
                    list(now), list(now.values()), record_kv_event(self._kv_caches)))
        if later:
            self._load_later(adapter, later)

    def _finish_sync_loads(self) -> None:
        if self._sync_loads is not None:
            adapter, request_ids, loads = self._sync_loads
            self._sync_loads = None
            self._loads_done(request_ids, adapter.finish_retrieve(loads, self._timeout_s))

    def _load_later(self, adapter: WorkerGroups | None, loads: dict[str, RequestOps]) -> None:
        """While the engine steps on: reported done (or failed) by `transfer_results`."""
        if adapter is None:
            for req_id, ops in loads.items():
                self._unsent_loads[req_id] = _loaded_blocks(ops)
            return
        # The event orders the daemon's writes after vLLM's work still in flight on these blocks.
        adapter.batched_submit_retrieve_requests(list(loads), list(loads.values()),
                                                 record_kv_event(self._kv_caches))

    def wait_for_save(self, meta: LMCacheMPConnectorMetadata) -> None:
        """Submit this step's stores; the forward pass that computed their KV is done."""
        adapter = self._adapter()
        if meta.idle and adapter is not None and adapter.holds_stores():
            # vLLM steps on, with nothing to compute, for as long as finished requests wait
            # for their held stores (up to timeout_s while the daemon is away): pace those
            # empty steps instead of spinning a core, which a restarting daemon needs.
            time.sleep(IDLE_STEP_PAUSE_S)
        if not meta.stores:
            return
        self._with_stores.update(meta.stores)
        if self._has_sliding:
            self._store_steps.update(dict.fromkeys(meta.stores, meta.step))
        if adapter is not None:
            # The event orders the daemon's reads after the forward pass that wrote the KV.
            adapter.batched_submit_store_requests(list(meta.stores), list(meta.stores.values()),
                                                  record_kv_event(self._kv_caches), meta.step)

    def transfer_results(self, finished_req_ids: set[str], idle: bool = False) -> KVConnectorTransferResults:
        """Loads done (failed ones also in failed_recving), and finished requests whose
        stores are done. Only requests that had stores are reported as sent: the scheduler
        keeps exactly those (request_finished returned True for them). `idle`: this step
        computed nothing."""
        adapter = self._adapter()
        if adapter is not None and idle:
            # Nothing else waits for this step: wait here (briefly) for the loads in flight, so
            # that the step that started a load reports it and the next one computes its
            # request, instead of empty steps spinning (and taking a core from the copy).
            adapter.wait_for_retrieves(IDLE_LOAD_WAIT_S)
        if adapter is None:
            sent, received, failed = set(finished_req_ids), set(), {}
        else:
            sent, received = adapter.get_finished(finished_req_ids)
            failed = adapter.take_failed_retrieves()
        failed.update(self._unsent_loads)
        received.update(self._unsent_loads)
        self._unsent_loads = {}
        sent &= self._with_stores
        self._with_stores -= sent
        self._loads_done(received | failed.keys(), failed)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received,
                                          failed_recving=set(failed))

    def _loads_done(self, request_ids: Iterable[str], failed: dict[str, list[int]]) -> None:
        """These loads are done, those in `failed` (-> the blocks they would have written) failed."""
        self._stats.loads_done(request_ids, failed)
        if self._report_failed_blocks:
            for block_ids in failed.values():
                self._load_errors.update(block_ids)

    def worker_meta(self) -> LMCacheMPWorkerMeta | None:
        """For each request with stores, the step through which they are all done, when it moved
        on (as of `transfer_results`). Per step, not per request: a long prefill submits a store
        every step, and the blocks of its early steps must not wait for the last one."""
        adapter = self._link.get()
        done: dict[str, int] = {}
        for req_id, latest in list(self._store_steps.items()):
            through = latest if adapter is None else adapter.stores_done_through(req_id, latest)
            if through > self._reported_through.get(req_id, 0):
                done[req_id] = self._reported_through[req_id] = through
            if through == latest:
                del self._store_steps[req_id]
                self._reported_through.pop(req_id, None)
        return LMCacheMPWorkerMeta({self._rank: done}) if done else None

    def take_stats(self) -> LMCacheMPConnectorStats | None:
        """The transfers completed since the last call, for vLLM's metrics (None: none)."""
        return self._stats.take()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._link.close()


def _loaded_blocks(ops: RequestOps) -> list[int]:
    """The blocks a load would have written, in every group."""
    return [b for op in all_ops(ops) for b in kept_blocks(op)]
