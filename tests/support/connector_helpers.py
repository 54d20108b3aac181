"""Stand-ins for vLLM around the connector's two halves, driven step by step without an engine.

vLLM's request and scheduler-output objects as the connector reads them (the fields of
docs/dev/vllm-0.32-connector-notes.md), and a worker half run the way vLLM's model runner runs it,
over CPU caches of `helpers.SHAPE`. Used by test_connector_logic and test_hybrid_connector;
importing this needs vLLM (the connector's modules import it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

from lmcache_mp.testing.blocks import BLOCK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from vllm_adapter.connector_common import ConnectorSettings, LMCacheMPConnectorMetadata
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.connector_worker import WorkerSide
from vllm_adapter.kv_groups import KVGroup

T = TypeVar("T")


def request(request_id: str, tokens: list[int], preemptions: int = 0) -> Any:
    return SimpleNamespace(request_id=request_id, block_hashes=block_hashes(tokens),
                           num_prompt_tokens=len(tokens), num_tokens=len(tokens),
                           num_preemptions=preemptions, skip_reading_prefix_cache=False)


def step(tables: dict[str, Any], new: tuple = (), cached: tuple = (), preempted: tuple = ()) -> Any:
    """A SchedulerOutput: `new` and `cached` hold (request, computed before, scheduled now);
    `tables` a request's block table, or a tuple of one per KV cache group."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens={r.request_id: n for r, _, n in (*new, *cached)},
        total_num_scheduled_tokens=sum(n for _, _, n in (*new, *cached)),
        preempted_req_ids=set(preempted),
        kv_connector_block_state=SimpleNamespace(
            get_block_ids=lambda rid: tables[rid] if isinstance(tables[rid], tuple) else (tables[rid],)))


def until(probe: Callable[[], T | None], timeout: float = 10.0) -> T:
    deadline = time.monotonic() + timeout
    while (value := probe()) is None or value is False:
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return value


def match(scheduler: SchedulerSide, req: Any, local: int = 0) -> tuple[int | None, bool]:
    scheduler.on_new_request(req)

    def answer() -> tuple[int | None, bool] | None:
        result = scheduler.get_num_new_matched_tokens(req, local)
        return None if result[0] is None else result

    return until(answer)


class Worker:
    """A WorkerSide over its own caches, run the way vLLM's model runner runs it."""

    def __init__(self, settings: ConnectorSettings, seed: int, groups: list[KVGroup] | None = None,
                 block_bytes: list[int] | None = None):
        """`block_bytes`: per group, a block's bytes, for the worker's stats (default 0)."""
        self.caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=seed)
        backend = SimpleNamespace(get_name=lambda: "CPU_ATTN")
        layers = {name: SimpleNamespace(attn_backend=backend) for name in self.caches}
        vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))
        self.side = WorkerSide(settings, vllm_config, "m", 1, 0, BLOCK, groups,  # type: ignore[arg-type]
                               block_bytes=block_bytes or ())
        self.side.register_kv_caches(self.caches)
        self.reported: dict[str, Counter[str]] = {kind: Counter() for kind in ("sent", "received", "failed")}
        self.load_errors: set[int] = set()

    def run(self, meta: LMCacheMPConnectorMetadata, finished: set[str] = frozenset()) -> None:
        self.side.begin_step(meta)
        self.side.start_load_kv()
        self.side.wait_for_save(meta)
        self.collect(finished, meta.idle)

    def collect(self, finished: set[str] = frozenset(), idle: bool = False) -> None:
        results = self.side.transfer_results(set(finished), idle)
        self.reported["sent"].update(results.finished_sending)
        self.reported["received"].update(results.finished_recving)
        self.reported["failed"].update(results.failed_recving)
        self.load_errors |= self.side.take_load_errors()

    def wait_reported(self, kind: str, request_id: str) -> None:
        def seen() -> bool:
            self.collect()
            return request_id in self.reported[kind]

        until(seen)


class Blocks:
    """What vLLM hands `update_state_after_alloc`: every block the request holds."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def store_prompt(scheduler: SchedulerSide, worker: Worker, req: Any, tables: dict[str, list[int]]) -> None:
    """A request that misses, computes its whole prompt in one step and finishes; returns
    once its chunks are stored."""
    assert match(scheduler, req) == (0, False)
    worker.run(scheduler.build_connector_meta(step(tables, new=((req, 0, req.num_prompt_tokens),))))
    scheduler.request_finished(req)
    worker.collect({req.request_id})
    worker.wait_reported("sent", req.request_id)
