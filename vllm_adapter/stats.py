"""vLLM's own metrics for `LMCacheMPDaemonConnector`: what the connector moved, in the engine's
`/metrics` and in vLLM's periodic "KV Transfer metrics" log line.

Each worker records its transfers as they complete (`TransferRecorder`, on vLLM's model-runner
thread only: no lock, a few additions per transfer). vLLM drains the record every step
(`get_kv_connector_stats`), sums the workers' (`LMCacheMPConnectorStats.aggregate`) and hands it,
as plain data, to the API server, where `LMCacheMPPromMetrics` turns it into Prometheus metrics
and `reduce` into the log line.

The metrics, each with vLLM's per-engine labels (`model_name`, `engine`); Prometheus adds `_total`
to a counter's name. Those vLLM's native offloading (`OffloadingConnector` with its CPU pool)
exports mean the same here and carry its names, so that dashboards built on it work unchanged:

- `vllm:kv_offload_load_bytes` (counter): KV bytes loaded from the daemon into vLLM's KV cache;
- `vllm:kv_offload_load_time` (counter): seconds the loads took, summed;
- `vllm:kv_offload_load_size` (histogram): bytes of each load (one request's, on one worker);
- `vllm:kv_offload_store_bytes`, `_store_time`, `_store_size`: the same for stores (each STORE:
  one step's new chunks, on one worker), counting the bytes the daemon copied out of the KV cache;
- `vllm:kv_offload_total_bytes`, `vllm:kv_offload_total_time`, `vllm:kv_offload_size`: the older
  names of the same figures, which native CPU offloading still exports, with label
  `transfer_type` "CPU_to_GPU" (loads) or "GPU_to_CPU" (stores).

And the connector's own:
- `vllm:lmcache_mp_load_tokens`, `vllm:lmcache_mp_store_tokens` (counters): tokens loaded, stored;
- `vllm:lmcache_mp_failed_loads` (counter): loads (requests) that failed, whose KV vLLM computed
  instead; `vllm:lmcache_mp_failed_load_tokens` (counter): their tokens;
- `vllm:lmcache_mp_load_latency_seconds` (histogram): each load, from its RETRIEVE's sending until
  the worker saw it done; `vllm:lmcache_mp_store_latency_seconds`: each STORE, until its reply.

A store counts only the chunks the daemon copied (not those it held already; a chunk that found no
space counts once a later try lands it). Tokens are whole vLLM blocks (a request's tail, its last
block partly filled, counts that block whole), counted by one worker (rank 0) and one KV cache
group (the first of full attention): every worker loads and stores its share of the same tokens,
and every group its layers of them. Bytes are every worker's and every group's, summed.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from vllm_adapter.group_adapters import RequestOps, group_op
from vllm_adapter.kv_groups import KVGroup
from vllm_adapter.ops import kept_blocks

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The stats' data (plain lists, as vLLM's messages carry them from worker to API server): each
# completed load and store as [tokens, bytes, seconds], each failed load as its tokens.
_LOADS, _STORES, _FAILED_LOADS = "loads", "stores", "failed_loads"
_KEYS = (_LOADS, _STORES, _FAILED_LOADS)

# The native CPU offloading's size buckets (bytes), so that its dashboards' quantiles read alike.
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Transfer(NamedTuple):
    """One completed load or store, on one worker."""

    tokens: int
    nbytes: int
    seconds: float


@dataclass
class LMCacheMPConnectorStats(KVConnectorStats):
    """The transfers of one step (a worker's, or the workers' summed), or of one logging interval
    (vLLM's API server sums the steps')."""

    def __post_init__(self) -> None:
        for key in _KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}

    @property
    def loads(self) -> list[Transfer]:
        return [Transfer(*load) for load in self.data[_LOADS]]

    @property
    def stores(self) -> list[Transfer]:
        return [Transfer(*store) for store in self.data[_STORES]]

    @property
    def failed_load_tokens(self) -> list[int]:
        return list(self.data[_FAILED_LOADS])

    def record_load(self, load: Transfer) -> None:
        self.data[_LOADS].append(list(load))

    def record_store(self, store: Transfer) -> None:
        self.data[_STORES].append(list(store))

    def record_failed_load(self, tokens: int) -> None:
        self.data[_FAILED_LOADS].append(tokens)

    def aggregate(self, other: KVConnectorStats) -> LMCacheMPConnectorStats:
        """Add `other`'s transfers to these (another worker's, or a later step's)."""
        assert isinstance(other, LMCacheMPConnectorStats)
        for key in _KEYS:
            self.data[key].extend(other.data[key])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, for vLLM's "KV Transfer metrics" log line."""
        loads, stores = self.loads, self.stores
        return {**_totals("load", loads), **_totals("store", stores),
                "failed_loads": len(self.data[_FAILED_LOADS]),
                "failed_load_tokens": sum(self.data[_FAILED_LOADS])}

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _KEYS)


def _totals(direction: str, transfers: list[Transfer]) -> dict[str, int | float]:
    seconds = sum(t.seconds for t in transfers)
    return {f"{direction}s": len(transfers), f"{direction}_tokens": sum(t.tokens for t in transfers),
            f"{direction}_bytes": sum(t.nbytes for t in transfers),
            f"{direction}_avg_ms": round(1000 * seconds / len(transfers), 3) if transfers else 0.0}


def group_block_bytes(kv_cache_config: KVCacheConfig) -> list[int]:
    """Per KV cache group, the bytes one vLLM block takes on this rank, every layer of the group:
    what a load or store copies per block."""
    return [group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            for group in kv_cache_config.kv_cache_groups]


class _SentLoad(NamedTuple):
    sent_at: float
    tokens: int
    nbytes: int


class TransferRecorder:
    """One worker's record of its transfers as they complete, taken by vLLM every step. Called only
    from vLLM's model-runner thread."""

    def __init__(self, groups: Sequence[KVGroup], block_bytes: Sequence[int], block_size: int,
                 counts_tokens: bool):
        """`block_bytes`: per group, as `group_block_bytes`; `counts_tokens`: this worker counts
        tokens (one worker does)."""
        self._groups = list(groups)
        self._block_bytes = list(block_bytes)
        self._block_size = block_size
        # The group whose blocks count the tokens: the first of full attention (a sliding window's
        # group skips the blocks it never reads), none on workers that leave the tokens to another.
        full = [g for g in self._groups if g.sliding_window is None] or self._groups
        self._token_group = full[0].index if counts_tokens else None
        self._loads: dict[str, _SentLoad] = {}  # sent, not seen done yet
        self._stats = LMCacheMPConnectorStats()

    def loads_sent(self, loads: Mapping[str, RequestOps]) -> None:
        now = time.monotonic()
        for request_id, ops in loads.items():
            blocks = {g.index: len(kept_blocks(op)) for g in self._groups
                      if (op := group_op(ops, g)) is not None}
            nbytes = sum(n * self._block_bytes[index] for index, n in blocks.items())
            self._loads[request_id] = _SentLoad(now, self._tokens(blocks.get(self._token_group, 0)), nbytes)

    def loads_done(self, request_ids: Iterable[str], failed: Container[str]) -> None:
        """These loads are done, those in `failed` failed (a request reported twice counts once)."""
        now = time.monotonic()
        for request_id in request_ids:
            sent = self._loads.pop(request_id, None)
            if sent is None:
                continue
            if request_id in failed:
                self._stats.record_failed_load(sent.tokens)
            else:
                self._stats.record_load(Transfer(sent.tokens, sent.nbytes, now - sent.sent_at))

    def store_landed(self, group: int, blocks: int, seconds: float) -> None:
        """A STORE of this group's layers copied `blocks` blocks, `seconds` after it was sent."""
        tokens = self._tokens(blocks) if group == self._token_group else 0
        self._stats.record_store(Transfer(tokens, blocks * self._block_bytes[group], seconds))

    def _tokens(self, blocks: int) -> int:
        return blocks * self._block_size if self._token_group is not None else 0

    def take(self) -> LMCacheMPConnectorStats | None:
        """The transfers completed since the last call; None if none."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LMCacheMPConnectorStats()
        return stats


class _Direction(NamedTuple):
    """One engine's metrics of one direction (loads or stores), labels bound."""

    tokens: Any
    nbytes: Any
    time: Any
    size: Any
    latency: Any
    legacy_bytes: Any
    legacy_time: Any
    legacy_size: Any

    def observe(self, transfer: Transfer) -> None:
        self.tokens.inc(transfer.tokens)
        for counter in (self.nbytes, self.legacy_bytes):
            counter.inc(transfer.nbytes)
        for counter in (self.time, self.legacy_time):
            counter.inc(transfer.seconds)
        for histogram in (self.size, self.legacy_size):
            histogram.observe(transfer.nbytes)
        self.latency.observe(transfer.seconds)


class LMCacheMPPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (the module docstring's table), in vLLM's API server."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        legacy = {name: self._counter("vllm:kv_offload_total_" + name, doc, "transfer_type")
                  for name, doc in (("bytes", "KV bytes moved by the connector (older name)"),
                                    ("time", "seconds the connector's transfers took (older name)"))}
        legacy_size = self._histogram("vllm:kv_offload_size", "bytes of each transfer (older name)",
                                      SIZE_BUCKETS, "transfer_type")
        families = {direction: (
            self._counter(f"vllm:lmcache_mp_{direction}_tokens", f"tokens {past} (lmcache-mp)"),
            self._counter(f"vllm:kv_offload_{direction}_bytes", f"KV bytes {past} (lmcache-mp)"),
            self._counter(f"vllm:kv_offload_{direction}_time", f"seconds the {direction}s took (lmcache-mp)"),
            self._histogram(f"vllm:kv_offload_{direction}_size", f"bytes of each {direction} (lmcache-mp)",
                            SIZE_BUCKETS),
            self._histogram(f"vllm:lmcache_mp_{direction}_latency_seconds",
                            f"seconds from sending each {direction} to seeing it done (lmcache-mp)",
                            LATENCY_BUCKETS),
        ) for direction, past in (("load", "loaded from the daemon"), ("store", "stored in the daemon"))}
        failed = self._counter("vllm:lmcache_mp_failed_loads",
                               "loads that failed, computed instead (lmcache-mp)")
        failed_tokens = self._counter("vllm:lmcache_mp_failed_load_tokens",
                                      "tokens of the loads that failed (lmcache-mp)")
        self._engines: dict[int, tuple[_Direction, _Direction, Any, Any]] = {}
        for engine, values in per_engine_labelvalues.items():
            load, store = (
                _Direction(*(metric.labels(*values) for metric in families[direction]),
                           legacy["bytes"].labels(*values, transfer_type),
                           legacy["time"].labels(*values, transfer_type),
                           legacy_size.labels(*values, transfer_type))
                for direction, transfer_type in (("load", "CPU_to_GPU"), ("store", "GPU_to_CPU")))
            self._engines[engine] = (load, store, failed.labels(*values), failed_tokens.labels(*values))

    def _counter(self, name: str, documentation: str, *extra_labels: str) -> Counter:
        return self._counter_cls(name=name, documentation=documentation,
                                 labelnames=[*self._labelnames, *extra_labels])

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...],
                   *extra_labels: str) -> Histogram:
        return self._histogram_cls(name=name, documentation=documentation, buckets=buckets,
                                   labelnames=[*self._labelnames, *extra_labels])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        load, store, failed, failed_tokens = self._engines[engine_idx]
        stats = LMCacheMPConnectorStats(data=transfer_stats_data)
        for transfer in stats.loads:
            load.observe(transfer)
        for transfer in stats.stores:
            store.observe(transfer)
        for tokens in stats.failed_load_tokens:
            failed.inc()
            failed_tokens.inc(tokens)
