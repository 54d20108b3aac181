"""The connector's hybrid KV cache manager support, driven step by step.

The real daemon, the real scheduler and worker halves, and vLLM's real `BlockPool` (whose
reference counts decide when vLLM may reuse a block); vLLM's request and scheduler-output
objects are the stand-ins of tests/support/connector_helpers.py. Two KV cache groups, as vLLM makes
them for a model with sliding-window and full-attention layers: group 0 (sliding, a window of
two blocks) and group 1 (full). A real engine runs them in tests/vllm/test_hybrid_models.py; this
pins down what an engine cannot show deterministically: which blocks are held, and for how
long, and what a hit needs from each group.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from lmcache_mp.testing.blocks import BLOCK, CHUNK
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.probes import freeze
from tests.support.connector_helpers import Worker, match, request, step, until
from tests.support.helpers import status
from vllm_adapter.connector_common import ConnectorSettings, LMCacheMPConnectorMetadata
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.kv_groups import NULL_BLOCK_ID, UnsupportedKVGroups, kv_groups

pytestmark = pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
WINDOW = 2 * BLOCK
SLIDING, FULL = 0, 1
LAYER_NAMES = [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]
_rng = random.Random(15)


SPEC_FIELDS = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"}


def _config(*specs: Any) -> KVCacheConfig:
    names = LAYER_NAMES if len(specs) > 1 else [[n for group in LAYER_NAMES for n in group]]
    groups = [KVCacheGroupSpec(layers, spec) for layers, spec in zip(names, specs, strict=True)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=BLOCK)


def hybrid_config() -> KVCacheConfig:
    return _config(SlidingWindowSpec(sliding_window=WINDOW, **SPEC_FIELDS), FullAttentionSpec(**SPEC_FIELDS))


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(64, enable_caching=True, hash_block_size=BLOCK)


@pytest.fixture
def halves(daemon: DaemonProcess, pool: BlockPool) -> Iterator[tuple[SchedulerSide, Worker]]:
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3)
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK, kv_groups(hybrid_config(), "m"))
    scheduler.bind_block_pool(pool)
    worker = Worker(settings, seed=1, groups=kv_groups(hybrid_config(), "m"))
    yield scheduler, worker
    worker.side.shutdown()
    scheduler.shutdown()


def report_stores(scheduler: SchedulerSide, worker: Worker, request_id: str, through: int) -> None:
    """Feed the workers' reports back until they say this request's stores are done through
    scheduler step `through`."""
    def done() -> bool:
        worker.collect()
        meta = worker.side.worker_meta()
        output = SimpleNamespace(failed_recving=set(), kv_connector_worker_meta=meta)
        scheduler.update_connector_output(output)
        return meta is not None and meta.stores_done[0].get(request_id, 0) >= through

    until(done)


def test_groups_get_their_own_names_and_unsupported_state_is_refused() -> None:
    sliding, full = kv_groups(hybrid_config(), "m")
    assert (sliding.sliding_window, full.sliding_window) == (WINDOW, None)
    assert sliding.namespace.startswith("m#sliding32-") and full.namespace.startswith("m#full-")
    assert kv_groups(hybrid_config(), "m") == [sliding, full]  # deterministic names
    assert sliding.daemon_request_id("r", 2) == "r#g0" and full.daemon_request_id("r", 2) == "r#g1"
    # One group keeps the plain model name: its chunks are keyed as before groups existed.
    (only,) = kv_groups(_config(FullAttentionSpec(**SPEC_FIELDS)), "m")
    assert only.namespace == "m" and only.daemon_request_id("r", 1) == "r"
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=("float32",))
    with pytest.raises(UnsupportedKVGroups, match="MambaSpec"):
        kv_groups(_config(mamba, FullAttentionSpec(**SPEC_FIELDS)), "m")


def test_sliding_blocks_are_held_until_their_store_is_reported_done(
        halves: tuple[SchedulerSide, Worker], pool: BlockPool, daemon: DaemonProcess) -> None:
    scheduler, worker = halves
    tokens = [_rng.randrange(3, 1000) for _ in range(4 * CHUNK)]  # 8 blocks
    req = request("r", tokens)
    sliding, full = ([b.block_id for b in pool.get_new_blocks(8)] for _ in range(2))
    free_at_start = pool.get_num_free_blocks()
    assert match(scheduler, req) == (0, False)
    # Step 1 computes 3 blocks: chunk 0 is stored; the sliding group's 3 blocks are held.
    meta = scheduler.build_connector_meta(step({"r": (sliding, full)}, new=((req, 0, 3 * BLOCK),)))
    ops = meta.stores["r"]
    assert ops[FULL].block_ids == full[:2] and ops[SLIDING].block_ids == sliding[:2]
    assert [pool.blocks[b].ref_cnt for b in sliding[:4]] == [2, 2, 2, 1]
    # Before step 2 vLLM frees the blocks that left the window (as remove_skipped_blocks does):
    # ours stay out of the free list, so no other request can overwrite them mid-store.
    pool.free_blocks(pool.blocks[b] for b in sliding[:2])
    assert pool.get_num_free_blocks() == free_at_start
    worker.run(meta)
    report_stores(scheduler, worker, "r", meta.step)
    assert pool.get_num_free_blocks() == free_at_start + 2  # stored: released
    assert pool.blocks[sliding[2]].ref_cnt == 2  # its chunk is not full yet: still held
    # Step 2 computes the rest; the sliding table now has null blocks where vLLM freed them.
    table = [NULL_BLOCK_ID, NULL_BLOCK_ID, *sliding[2:]]
    meta = scheduler.build_connector_meta(step({"r": (table, full)}, cached=((req, 3 * BLOCK, 5 * BLOCK),)))
    assert meta.stores["r"][SLIDING].block_ids == sliding[2:] and meta.stores["r"][FULL].block_ids == full[2:]
    worker.run(meta)
    assert scheduler.request_finished(req) is True
    report_stores(scheduler, worker, "r", meta.step)
    assert [pool.blocks[b].ref_cnt for b in [*sliding[2:], *full]] == [1] * 14  # only the request's own
    # Each group holds all 4 chunks under its own name.
    assert status(daemon.url).objects == 8


def test_a_long_prefill_releases_each_steps_blocks_once_that_steps_store_is_done(
        halves: tuple[SchedulerSide, Worker], pool: BlockPool, daemon: DaemonProcess) -> None:
    """vLLM submits a store every step of a chunked prefill, just before it asks the workers
    what is done: a step's blocks must not wait for the stores of the steps after it."""
    scheduler, worker = halves
    req = request("p", [_rng.randrange(3, 1000) for _ in range(4 * CHUNK)])
    sliding, full = ([b.block_id for b in pool.get_new_blocks(8)] for _ in range(2))
    assert match(scheduler, req) == (0, False)
    first = scheduler.build_connector_meta(step({"p": (sliding, full)}, new=((req, 0, 2 * CHUNK),)))
    worker.run(first)

    def first_stored() -> bool:
        worker.collect()  # settles the replies
        return worker.side._link.get().stores_done_through("p", first.step) == first.step

    until(first_stored)
    tables = {"p": (sliding, full)}
    second = scheduler.build_connector_meta(step(tables, cached=((req, 2 * CHUNK, 2 * CHUNK),)))
    freeze(daemon.proc)  # the second step's store stays in flight
    try:
        worker.side.wait_for_save(second)
        worker.collect()
        output = SimpleNamespace(failed_recving=set(), kv_connector_worker_meta=worker.side.worker_meta())
        scheduler.update_connector_output(output)
        assert output.kv_connector_worker_meta.stores_done == {0: {"p": first.step}}
        assert [pool.blocks[b].ref_cnt for b in sliding] == [1] * 4 + [2] * 4  # the first step's released
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    scheduler.request_finished(req)
    report_stores(scheduler, worker, "p", second.step)
    assert [pool.blocks[b].ref_cnt for b in sliding] == [1] * 8


def test_a_hit_needs_every_group_and_loads_skip_null_blocks(
        halves: tuple[SchedulerSide, Worker], pool: BlockPool, daemon: DaemonProcess) -> None:
    scheduler, worker = halves
    tokens = [_rng.randrange(3, 1000) for _ in range(4 * CHUNK)]
    # Stored by a request whose first chunk came from vLLM's own prefix cache: its sliding
    # table has null blocks there, so that group stores chunks 1-3 only.
    first = request("a", tokens)
    sliding = [NULL_BLOCK_ID, NULL_BLOCK_ID, *range(10, 16)]
    full = list(range(20, 28))
    assert match(scheduler, first, local=CHUNK) == (0, False)
    meta = scheduler.build_connector_meta(step({"a": (sliding, full)}, new=((first, 0, 4 * CHUNK),)))
    assert len(meta.stores["a"][SLIDING].block_hashes) == 6 and len(meta.stores["a"][FULL].block_hashes) == 8
    worker.run(meta)
    scheduler.request_finished(first)
    report_stores(scheduler, worker, "a", meta.step)
    assert status(daemon.url).objects == 7
    # The full group holds 4 chunks, the sliding group none from the start: no hit.
    assert match(scheduler, request("b", tokens)) == (0, False)
    scheduler.request_finished(request("b", tokens))
    # Once another request stored chunk 0 of both groups, the whole prompt hits.
    third = request("c", tokens[:CHUNK])
    assert match(scheduler, third) == (0, False)
    meta = scheduler.build_connector_meta(step({"c": ([30, 31], [32, 33])}, new=((third, 0, CHUNK),)))
    worker.run(meta)
    scheduler.request_finished(third)
    report_stores(scheduler, worker, "c", meta.step)
    hit = request("d", tokens)
    assert match(scheduler, hit) == (4 * CHUNK, True)
    # vLLM allocates the hit's sliding blocks for the window before its end only.
    window_start = (4 * CHUNK - WINDOW + 1) // BLOCK
    in_window = list(range(40, 40 + 8 - window_start))
    tables = SimpleNamespace(get_block_ids=lambda: ([NULL_BLOCK_ID] * window_start + in_window,
                                                    list(range(50, 58))))
    scheduler.update_state_after_alloc(hit, tables, 4 * CHUNK)
    load = scheduler.build_connector_meta(step({})).loads["d"]
    assert load[SLIDING].block_ids == [-1] * window_start + in_window
    assert load[FULL].block_ids == list(range(50, 58))
    worker.run(load_meta := LMCacheMPConnectorMetadata(loads={"d": load}))
    assert load_meta.loads  # one load per group, reported as one
    worker.wait_reported("received", "d")
    assert worker.reported["failed"]["d"] == 0 and worker.load_errors == set()
