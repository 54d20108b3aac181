"""`LMCacheMPDaemonConnector`: vLLM 0.32's KV connector for the lmcache-mp daemon.

Load it with (by name: `plugin.py` registers it with vLLM)

    --kv-transfer-config '{"kv_connector": "LMCacheMPDaemonConnector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lmcache.mp.url": "ipc:///run/user/1000/lmcache-mp/daemon.sock"}}'

Settings: the `lmcache.mp.*` keys of `kv_connector_extra_config` (the daemon's URL, timeouts,
the load mode, CURVE keys, ...), declared once in `connector_common.ConnectorSettings`, from which
docs/configuration.md's table of them is generated; unknown keys are refused.

How it works: vLLM builds the class twice. The scheduler half (`connector_scheduler`, in the
EngineCore process) looks each request up once, plans chunk-aligned loads beyond
vLLM's own prefix-cache hit and stores of each new full chunk, and sends those plans to the
workers in `LMCacheMPConnectorMetadata`. The worker half (`connector_worker`, in each worker)
registers the KV caches with the daemon and runs the plans as batched RETRIEVE and STORE
requests. The daemon is a best-effort cache: when it is down or restarts, vLLM keeps serving
(no hits, stores skipped, failed loads recomputed) and both halves reconnect by themselves.
Hybrid models keep vLLM's hybrid KV cache manager on: each KV cache group is stored and
loaded on its own (`kv_groups`, and docs/vllm.md's "Hybrid models").
`kv_load_failure_policy` should be "recompute": vLLM 0.32 defaults to "fail", which ends a
request with an error when its load fails instead of recomputing it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_mp.transfer.shm_move import AllocateInSharedMemory
from vllm_adapter.connector_common import ConnectorSettings, LMCacheMPConnectorMetadata
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.connector_worker import WorkerSide
from vllm_adapter.kv_groups import UnsupportedKVGroups, kv_bytes_per_token, kv_groups
from vllm_adapter.model_identity import model_identity
from vllm_adapter.stats import LMCacheMPConnectorStats, LMCacheMPPromMetrics, group_block_bytes
from vllm_adapter.step_trace import StepTrace, describe

if TYPE_CHECKING:
    import torch
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _route_logs_to_vllm() -> None:
    """vLLM configures only its own "vllm" logger; print ours (connector, adapters, client)
    through the same handlers and level, so they show in vLLM's log."""
    vllm_logger = logging.getLogger("vllm")
    for name in ("vllm_adapter", "lmcache_mp"):
        ours = logging.getLogger(name)
        if not ours.handlers and vllm_logger.handlers:
            for handler in vllm_logger.handlers:
                ours.addHandler(handler)
            ours.setLevel(vllm_logger.level)
            ours.propagate = False


def check_parallel_config(parallel: ParallelConfig) -> None:
    """Tensor and pipeline parallelism are supported: each of the world's ranks (TP x PP, the
    daemon's world size) stores and loads its own share of every chunk (one chunk for all ranks
    where they hold the same bytes: `replicated_kv`). Context parallelism is
    refused: it splits a block's tokens across ranks while the cache keeps its shape (an MLA
    latent cache looks the same with and without DCP), so a chunk stored under one split would
    be read back under another as wrong KV."""
    dcp, pcp = parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
    if dcp > 1 or pcp > 1:
        raise ValueError(f"LMCacheMPDaemonConnector does not support context parallelism "
                         f"(decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp})")


def replicated_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether every rank of the world holds the same KV bytes, so that one stored chunk serves
    them all, and an engine of the model on one rank: MLA's latent cache, which vLLM computes
    whole on every tensor-parallel rank (`kv_tp_replicas` counts the ranks holding one copy),
    with no other parallelism. Pipeline stages hold other layers; decode context parallelism
    (refused anyway) splits a block's tokens across ranks, and vLLM then counts no replicas.
    vLLM's own offloading connector draws the same line."""
    parallel = vllm_config.parallel_config
    return bool(vllm_config.model_config.use_mla
                and kv_cache_config.kv_tp_replicas == parallel.tensor_parallel_size
                and parallel.world_size == parallel.tensor_parallel_size
                and parallel.decode_context_parallel_size == 1)


class LMCacheMPDaemonConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager: each KV cache group is stored and loaded on its
    own (`vllm_adapter.kv_groups`). A model with state it cannot store (Mamba) gets no hits."""

    # Where vLLM's per-source prompt-token metric (`vllm:prompt_tokens_cached_by_source`) puts our
    # hits: every load reads the daemon's CPU pool. A chunk found in a lower tier was promoted into
    # the pool at LOOKUP, but the LOOKUP's reply does not say which were: all count as "host".
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_logs_to_vllm()
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._trace = StepTrace(settings.step_trace, role.name.lower())
        # The model and every setting that changes its KV (model_identity.py): never the name alone.
        model_name = model_identity(vllm_config.model_config, vllm_config.load_config)
        parallel = vllm_config.parallel_config
        check_parallel_config(parallel)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        try:
            groups = kv_groups(kv_cache_config, model_name)
        except UnsupportedKVGroups as err:
            # Inert: every lookup a miss, nothing stored; vLLM serves the model by itself.
            logger.warning("LMCacheMPDaemonConnector (%s): %s; serving without the cache", role.name, err)
            return
        block_size = kv_cache_config.hash_block_size
        replicated = replicated_kv(vllm_config, kv_cache_config)
        logger.info("LMCacheMPDaemonConnector (%s, %s) from %s: daemon %s, model %s, block size %d, "
                    "rank %d of world size %d%s, %d KV cache group(s)%s", role.name,
                    self._kv_transfer_config.kv_role, __file__, settings.url,
                    model_name, block_size, parallel.rank, parallel.world_size,
                    " (KV the same on every rank: stored once)" if replicated else "", len(groups),
                    "".join(f"; group {g.index}: {len(g.layer_names)} layers, "
                            f"{'full' if g.sliding_window is None else f'window {g.sliding_window}'}"
                            for g in groups if len(groups) > 1))
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(settings, model_name, parallel.world_size, parallel.rank,
                                            block_size, groups, loads=transfer.is_kv_consumer,
                                            stores=transfer.is_kv_producer,
                                            kv_bytes_per_token=kv_bytes_per_token(kv_cache_config),
                                            kv_events=events is not None and events.enable_kv_cache_events)
        else:
            self._worker = WorkerSide(settings, vllm_config, model_name, parallel.world_size,
                                      parallel.rank, block_size, groups, replicated,
                                      group_block_bytes(kv_cache_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: the connector asks vLLM for no particular KV cache layout. Its registration tells
        the daemon the layout vLLM chose (each layer's shape and strides, the attention backend), and
        the daemon copies blocks in that layout: any layout vLLM picks is served, and no other
        connector beside ours (vLLM's MultiConnector) is overruled."""
        del vllm_config
        return None

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a store dropped by a preemption is only a later miss."""
        return False

    # ---- scheduler side ------------------------------------------------------------------
    # `_scheduler` is None in workers, and everywhere when the connector is inert (the model has
    # state it cannot store): then every lookup is a miss and nothing is planned.

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        with self._trace.hook("get_num_new_matched_tokens", computed=num_computed_tokens) as record:
            tokens, load_async = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
            record["tokens"] = tokens
        return tokens, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's block pool: sliding-window blocks are held in it until their stores are done."""
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return LMCacheMPConnectorMetadata()
        with self._trace.hook("build_connector_meta") as record:
            meta = self._scheduler.build_connector_meta(scheduler_output)
            record.update(describe(meta))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            with self._trace.hook("update_connector_output"):
                self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """True keeps the request's blocks (every group's) until its stores are done."""
        return self._scheduler is not None and self._scheduler.request_finished(request, block_ids), None

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`, made after a weight update: the daemon
        drops every chunk of this model (pool and lower tiers; other models' stay). False, with the
        reason logged, where the daemon could not confirm it (away, no reply in time, a tier that
        failed). An inert connector stores nothing: nothing to drop."""
        return self._scheduler is None or self._scheduler.reset_cache()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The daemon's stores and evictions of this engine's chunks, as vLLM's KV events (only
        when vLLM publishes them: `--kv-events-config`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # ---- worker side ---------------------------------------------------------------------
    # `_worker` is None in the scheduler, and everywhere when the connector is inert.

    def _meta(self) -> LMCacheMPConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheMPConnectorMetadata)
        return meta

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """vLLM allocates the KV cache inside this context. On CPU it allocates it in shared memory
        from the start, so that registering it with the daemon moves nothing."""
        cpu = self._vllm_config.device_config.device_type == "cpu"
        return AllocateInSharedMemory() if cpu and self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, LMCacheMPConnectorMetadata)
        if self._worker is not None:
            with self._trace.hook("begin_step", **describe(kv_connector_metadata)):
                self._worker.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            with self._trace.hook("start_load_kv", **describe(self._meta())):
                self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer: loads are whole requests, and vLLM schedules a request only
        after its load has been reported done."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: the daemon copies whole chunks of every layer once the
        forward pass is done (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        if self._worker is not None:
            meta = self._meta()
            with self._trace.hook("wait_for_save", **describe(meta)):
                self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        meta = self._meta() if self.has_connector_metadata() else None
        idle = meta is not None and meta.idle
        with self._trace.hook("transfer_results", step=meta.step if meta else None, idle=idle) as record:
            results = self._worker.transfer_results(finished_req_ids, idle)
            record.update(loads_done=len(results.finished_recving or ()),
                          stores_done=len(results.finished_sending or ()))
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The older form of `get_transfer_results` (vLLM 0.32 calls that one); load failures
        still reach vLLM through `get_block_ids_with_load_errors`."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The transfers this worker completed since vLLM last asked (each step): vLLM's metrics
        (`vllm_adapter.stats`). The scheduler side has none."""
        return None if self._worker is None else self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LMCacheMPConnectorStats(data={} if data is None else data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return LMCacheMPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self._worker is None else self._worker.worker_meta()

    def shutdown(self) -> None:
        self._trace.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
