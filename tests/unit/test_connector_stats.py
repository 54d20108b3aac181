"""The connector's stats for vLLM's metrics (`vllm_adapter/stats.py`): what a worker records, how the
workers' stats add up, how they cross vLLM's messages, and the Prometheus series they feed. The real
engine's /metrics: tests/vllm/test_vllm_metrics.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import VllmConfig
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_adapter.connector import LMCacheMPDaemonConnector
from vllm_adapter.kv_groups import KVGroup
from vllm_adapter.ops import SKIP_BLOCK, LoadStoreOp
from vllm_adapter.stats import LMCacheMPConnectorStats, LMCacheMPPromMetrics, Transfer, TransferRecorder

BLOCK = 32
ONLY = KVGroup(0, ("layer.0",), None, "m")
# A hybrid model's groups, in vLLM's order: the window's first.
WINDOW = KVGroup(0, ("layer.0",), 64, "m#g0")
FULL = KVGroup(1, ("layer.1",), None, "m#g1")


def recorder(counts_tokens: bool = True, groups: tuple[KVGroup, ...] = (ONLY,),
             block_bytes: tuple[int, ...] = (1000,)) -> TransferRecorder:
    return TransferRecorder(list(groups), list(block_bytes), BLOCK, counts_tokens)


def test_a_load_counts_the_blocks_it_writes_and_fails_once() -> None:
    """Blocks vLLM holds already (SKIP_BLOCK) are not loaded; a failed load counts its tokens as
    failed; a request reported done twice counts once; nothing done, nothing taken."""
    worker = recorder()
    worker.loads_sent({"a": LoadStoreOp([SKIP_BLOCK, 7, 8, 9], block_hashes=[b"h"] * 4),
                       "b": LoadStoreOp([1, 2], block_hashes=[b"h"] * 2)})
    assert worker.take() is None  # sent, not done
    worker.loads_done(["a", "b"], failed={"b": [1, 2]})
    worker.loads_done(["a"], failed={})
    stats = worker.take()
    assert stats is not None
    ((tokens, nbytes, seconds),) = stats.loads
    assert (tokens, nbytes) == (3 * BLOCK, 3000) and seconds >= 0
    assert stats.failed_load_tokens == [2 * BLOCK]
    assert worker.take() is None


def test_tokens_are_counted_by_one_worker_and_one_group() -> None:
    """Rank 0's full-attention group counts the tokens; every worker's and group's bytes count."""
    groups, block_bytes = (WINDOW, FULL), (500, 1000)
    rank0, rank1 = recorder(True, groups, block_bytes), recorder(False, groups, block_bytes)
    for worker in (rank0, rank1):
        worker.loads_sent({"r": (LoadStoreOp([SKIP_BLOCK, 4], block_hashes=[b"h"] * 2),
                                 LoadStoreOp([3, 4], block_hashes=[b"h"] * 2))})
        worker.loads_done(["r"], failed={})
        worker.store_landed(WINDOW.index, 2, 0.5)
        worker.store_landed(FULL.index, 4, 0.25)
    first, second = rank0.take(), rank1.take()
    assert first is not None and second is not None
    assert [t[:2] for t in first.loads] == [(2 * BLOCK, 500 + 2000)]
    assert [t[:2] for t in second.loads] == [(0, 500 + 2000)]
    assert first.stores == [Transfer(0, 1000, 0.5), Transfer(4 * BLOCK, 4000, 0.25)]
    assert second.stores == [Transfer(0, 1000, 0.5), Transfer(0, 4000, 0.25)]
    total = first.aggregate(second)
    assert total.reduce() == {"loads": 2, "load_tokens": 2 * BLOCK, "load_bytes": 5000,
                              "load_avg_ms": pytest.approx(1000 * sum(t.seconds for t in total.loads) / 2,
                                                           abs=1e-3),
                              "stores": 4, "store_tokens": 4 * BLOCK, "store_bytes": 10000,
                              "store_avg_ms": 375.0, "failed_loads": 0, "failed_load_tokens": 0}


def test_stats_cross_vllms_messages_and_add_up_in_the_api_server() -> None:
    """The worker's stats go to the API server as plain data in vLLM's own message (msgpack), where
    vLLM rebuilds them with `build_kv_connector_stats` and adds up an interval's."""
    step = LMCacheMPConnectorStats()
    step.record_load(Transfer(64, 2000, 0.01))
    step.record_failed_load(32)
    message = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=step.to_dict()))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(message))
    data = received.scheduler_stats.kv_connector_stats
    interval = LMCacheMPDaemonConnector.build_kv_connector_stats(data)
    assert isinstance(interval, LMCacheMPConnectorStats) and not interval.is_empty()
    later = LMCacheMPDaemonConnector.build_kv_connector_stats(
        {"loads": [], "stores": [[128, 4000, 0.02]], "failed_loads": []})
    interval.aggregate(later)
    assert interval.reduce() == {"loads": 1, "load_tokens": 64, "load_bytes": 2000, "load_avg_ms": 10.0,
                                 "stores": 1, "store_tokens": 128, "store_bytes": 4000, "store_avg_ms": 20.0,
                                 "failed_loads": 1, "failed_load_tokens": 32}
    empty = LMCacheMPDaemonConnector.build_kv_connector_stats(None)
    assert empty is not None and empty.is_empty()
    interval.reset()
    assert interval.is_empty()


def _metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """vLLM's metric classes, registered in `registry` instead of the process's default one."""
    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})
    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{{{wanted}}} not in:\n{text}"
    return float(match.group(1))


def test_prometheus_series_per_engine() -> None:
    """Each engine's transfers go to its own labelled series: the native offloading names, their older
    `transfer_type` names, and ours."""
    registry = CollectorRegistry()
    prom = LMCacheMPDaemonConnector.build_prom_metrics(
        VllmConfig(), _metric_types(registry), ["engine", "model_name"], {0: ["0", "m"], 1: ["1", "m"]})
    assert isinstance(prom, LMCacheMPPromMetrics)
    data: dict[str, Any] = {"loads": [[64, 2000, 0.5], [32, 1000, 0.25]], "stores": [[128, 4000, 1.0]],
                            "failed_loads": [96]}
    prom.observe(data, engine_idx=1)
    text = generate_latest(registry).decode()
    one, zero = {"engine": "1", "model_name": "m"}, {"engine": "0", "model_name": "m"}
    assert _sample(text, "vllm:kv_offload_load_bytes_total", **one) == 3000
    assert _sample(text, "vllm:kv_offload_load_time_total", **one) == 0.75
    assert _sample(text, "vllm:kv_offload_load_size_count", **one) == 2
    assert _sample(text, "vllm:kv_offload_load_size_bucket", le="1e+06", **one) == 2
    assert _sample(text, "vllm:lmcache_mp_load_tokens_total", **one) == 96
    assert _sample(text, "vllm:lmcache_mp_load_latency_seconds_bucket", le="0.25", **one) == 1
    assert _sample(text, "vllm:lmcache_mp_load_latency_seconds_bucket", le="0.5", **one) == 2
    assert _sample(text, "vllm:kv_offload_store_bytes_total", **one) == 4000
    assert _sample(text, "vllm:lmcache_mp_store_tokens_total", **one) == 128
    assert _sample(text, "vllm:lmcache_mp_store_latency_seconds_sum", **one) == 1.0
    assert _sample(text, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU", **one) == 3000
    assert _sample(text, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU", **one) == 4000
    assert _sample(text, "vllm:kv_offload_total_time_total", transfer_type="GPU_to_CPU", **one) == 1.0
    assert _sample(text, "vllm:kv_offload_size_count", transfer_type="CPU_to_GPU", **one) == 2
    assert _sample(text, "vllm:lmcache_mp_failed_loads_total", **one) == 1
    assert _sample(text, "vllm:lmcache_mp_failed_load_tokens_total", **one) == 96
    assert _sample(text, "vllm:kv_offload_load_bytes_total", **zero) == 0  # the other engine's
    assert _sample(text, "vllm:lmcache_mp_failed_loads_total", **zero) == 0
