"""vLLM's own metrics for the connector (`vllm_adapter/stats.py`), read from a real engine's `/metrics`.

One OpenAI API server with the connector on a real daemon, vLLM's prefix caching off so that the
same prompt sent twice is an external hit: the first time its three whole chunks are stored, the
second time they are loaded. A tiny random float32 Llama, vLLM blocks of 32 tokens, daemon chunks
of 64: every figure but the times is exact.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.bench.harness.api_server import ApiServer, stop_servers, wait_healthy
from scripts.bench.step_trace_report import summarize
from tests.support.helpers import wait_for_status

# The prompts and engine helpers, and the module-scoped fixtures `daemon` and `work_dir`.
from tests.support.vllm_engines import (
    BLOCK,
    CHUNK,
    ENGINE_TIMEOUT_S,
    MAX_TOKENS,
    PROMPTS,
    DaemonUnderTest,
    daemon_fixture,  # noqa: F401
    make_tiny_llama,
    start_api_server,
    work_dir_fixture,  # noqa: F401
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = PROMPTS[0]  # three whole chunks and one token
TOKENS = 3 * CHUNK  # stored by the first request, loaded by the second
METRICS_DEADLINE_S = 60.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def kv_bytes_per_block(model: Path) -> int:
    """A block's KV in every layer: keys and values of each KV head, float32."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4 * BLOCK


class Metrics:
    """One reading of /metrics: each sample by name and labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
                self.samples.append((match.group(1), labels, float(match.group(3))))

    def __call__(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels`."""
        return sum(value for sample, have, value in self.samples
                   if sample == name and labels.items() <= have.items())

    def lines(self, *prefixes: str) -> list[str]:
        return [line for line in self.text.splitlines() if line.startswith(prefixes)]


def read_metrics(server: ApiServer) -> Metrics:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as reply:
        return Metrics(reply.read().decode())


def wait_for_metrics(server: ApiServer, ready: Callable[[Metrics], bool], what: str) -> Metrics:
    """The first reading where `ready` holds: the engine hands its stats to the server with the step
    that saw the transfer done, which may come after the request's reply."""
    deadline = time.monotonic() + METRICS_DEADLINE_S
    while True:
        metrics = read_metrics(server)
        if ready(metrics):
            return metrics
        assert time.monotonic() < deadline, f"{what}: not in /metrics in time:\n" + "\n".join(
            metrics.lines("vllm:kv_offload", "vllm:lmcache_mp"))
        time.sleep(0.2)


def complete(server: ApiServer, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


@dataclass
class Run:
    block_bytes: int
    before: Metrics  # the server up, nothing asked yet
    stored: Metrics  # after the first request's stores
    loaded: Metrics  # after the second request's load
    replies: list[dict[str, Any]]
    trace: str  # the connector's step trace (`lmcache.mp.step_trace`)


@pytest.fixture(scope="module")
def run(work_dir: Path, daemon: DaemonUnderTest) -> Iterator[Run]:
    model = make_tiny_llama(work_dir / "tiny-llama-f32")
    # Tails off: the first request's tail (its last, partly filled block) would be a fourth store.
    trace = str(work_dir / "trace")
    server = start_api_server(model, {"lmcache.mp.url": daemon.url, "lmcache.mp.tails": False,
                                      "lmcache.mp.step_trace": trace},
                              work_dir / "server.log", "--no-enable-prefix-caching")
    try:
        wait_healthy([server], ENGINE_TIMEOUT_S)
        before = read_metrics(server)
        first = complete(server, PROMPT)
        wait_for_status(daemon.url, lambda r: r.objects >= TOKENS // CHUNK, "the first request's chunks")
        stored = wait_for_metrics(server, lambda m: m("vllm:lmcache_mp_store_tokens_total") >= TOKENS,
                                  "the first request's stores")
        second = complete(server, PROMPT)
        loaded = wait_for_metrics(server, lambda m: m("vllm:lmcache_mp_load_tokens_total") >= TOKENS,
                                  "the second request's load")
        print("\n".join(loaded.lines("vllm:kv_offload", "vllm:lmcache_mp",
                                     "vllm:prompt_tokens_cached_by_source", "vllm:external_prefix_cache")))
        yield Run(kv_bytes_per_block(model), before, stored, loaded, [first, second], trace)
    finally:
        stop_servers([server])


def test_metrics_are_exported_before_any_transfer(run: Run) -> None:
    """Every metric is there, at 0, once the server is up: dashboards see the series from the start."""
    for name in ("vllm:kv_offload_load_bytes_total", "vllm:kv_offload_store_bytes_total",
                 "vllm:kv_offload_load_time_total", "vllm:kv_offload_store_size_count",
                 "vllm:lmcache_mp_load_tokens_total", "vllm:lmcache_mp_failed_loads_total",
                 "vllm:lmcache_mp_store_latency_seconds_count"):
        assert any(sample == name for sample, _, _ in run.before.samples), name
        assert run.before(name) == 0, name
    assert run.before("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 0


def test_the_first_request_counts_its_stores(run: Run) -> None:
    """Three whole chunks (six blocks) stored in one STORE; nothing loaded yet."""
    m, stored_bytes = run.stored, TOKENS // BLOCK * run.block_bytes
    assert m("vllm:lmcache_mp_store_tokens_total") == TOKENS
    assert m("vllm:kv_offload_store_bytes_total") == stored_bytes
    assert m("vllm:kv_offload_store_size_count") == 1
    assert m("vllm:kv_offload_store_size_sum") == stored_bytes
    assert m("vllm:lmcache_mp_store_latency_seconds_count") == 1
    assert m("vllm:kv_offload_store_time_total") == m("vllm:lmcache_mp_store_latency_seconds_sum") > 0
    assert m("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == stored_bytes
    assert m("vllm:kv_offload_size_count", transfer_type="GPU_to_CPU") == 1
    assert m("vllm:lmcache_mp_load_tokens_total") == m("vllm:kv_offload_load_bytes_total") == 0
    assert m("vllm:external_prefix_cache_hits_total") == 0


def test_the_second_request_counts_its_load_and_its_hit_source(run: Run) -> None:
    """The same prompt again, with vLLM's prefix cache off: its three chunks loaded from the daemon,
    reported as a hit from host memory; nothing stored again, nothing failed."""
    m, loaded_bytes = run.loaded, TOKENS // BLOCK * run.block_bytes
    assert m("vllm:lmcache_mp_load_tokens_total") == TOKENS
    assert m("vllm:kv_offload_load_bytes_total") == loaded_bytes
    assert m("vllm:kv_offload_load_size_count") == 1
    assert m("vllm:kv_offload_load_size_sum") == loaded_bytes
    assert m("vllm:lmcache_mp_load_latency_seconds_count") == 1
    assert m("vllm:kv_offload_load_time_total") == m("vllm:lmcache_mp_load_latency_seconds_sum") > 0
    assert m("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == loaded_bytes
    assert m("vllm:lmcache_mp_failed_loads_total") == m("vllm:lmcache_mp_failed_load_tokens_total") == 0
    assert m("vllm:lmcache_mp_store_tokens_total") == run.stored("vllm:lmcache_mp_store_tokens_total")
    assert m("vllm:external_prefix_cache_hits_total") == TOKENS
    assert m("vllm:prompt_tokens_cached_by_source_total", source="host") == TOKENS
    assert m("vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
    first, second = run.replies
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == TOKENS
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_the_step_trace_times_each_hook_by_kind_of_step(run: Run) -> None:
    """`lmcache.mp.step_trace`: the scheduler's and the worker's hooks, a line each. The second
    request arrived alone, so its load ran synchronously: one step whose forward pass waited for it
    (start_load_kv), and the first request's stores went out in a step of their own kind."""
    summary = summarize(run.trace)
    worker, scheduler = summary["worker"], summary["scheduler"]
    assert worker["sync load"]["steps"] == 1, worker
    assert worker["sync load"]["start_load_kv_ms"] > 0
    assert worker["store"]["steps"] >= 1, worker
    assert "async load" not in worker, worker
    for kind in worker.values():
        assert kind["span_ms"] >= kind["begin_step_ms"] + kind["start_load_kv_ms"]
    assert scheduler["lookups"] >= 2 and scheduler["steps"] >= worker["sync load"]["steps"], scheduler
