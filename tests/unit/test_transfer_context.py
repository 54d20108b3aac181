"""The copy paths of `TransferContext`, in-process (no daemon): the staged path that CUDA caches
take, run on CPU tensors so that every line but the DMA's and the stream's is checked here; and a
RETRIEVE's chunks split over copy threads (`CopyThreads`), with real threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcache_mp.errors import FatalError
from lmcache_mp.transfer.context import (
    Copies,
    Lane,
    TransferContext,
    consecutive_runs,
    kept_runs,
    non_overlapping,
)
from lmcache_mp.transfer.cuda import wait_bounded
from lmcache_mp.transfer.layouts import describe_caches
from lmcache_mp.transfer.threads import CopyThreads
from tests.support.helpers import Recorder

NUM_BLOCKS = 12
CHUNK_TOKENS = 64  # 4 blocks of 16


def _caches(layout: str, shape: tuple[int, ...], seed: int,
            one_allocation: bool = False) -> list[torch.Tensor]:
    """Three layers' caches: separate tensors, or views of one allocation (as vLLM on CPU has them)."""
    gen = torch.Generator().manual_seed(seed)
    if one_allocation:
        return list(torch.randn((3, *shape), generator=gen).to(torch.bfloat16))
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3)]


LAYOUTS = {
    "FLASH_ATTN": (NUM_BLOCKS, 2, 16, 2 * 8),  # [blocks, kv heads, block size, 2*head size]
    "MLA": (NUM_BLOCKS, 16, 24),  # [blocks, block size, latent dim]: vLLM before 0.32
    "TRITON_MLA": (NUM_BLOCKS, 1, 16, 24),  # vLLM 0.32: [blocks, 1 latent head, block size, latent dim]
    "FLASH_ATTN/KV_PLANES": (2, NUM_BLOCKS, 16, 2, 8),  # block dim 1
}


def _context(layers: list[torch.Tensor], layout: str, staged: bool) -> TransferContext:
    name = "FLASH_ATTN" if layout.startswith("FLASH_ATTN") else layout
    layers, geometry = describe_caches(layers, name)
    return TransferContext(layers, geometry, CHUNK_TOKENS, staged=staged)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_staged_copies_equal_direct_copies(layout: str) -> None:
    """STORE then RETRIEVE (with skipped blocks) through the staging buffer gives the same bytes as
    the direct path, and only the blocks named are written."""
    source = _caches(layout, LAYOUTS[layout], seed=1)
    results = {}
    for staged in (False, True):
        ctx = _context(source, layout, staged)
        assert ctx.staging_nbytes == (4 * ctx.chunk_nbytes if staged else 0)  # the bound: 2 chunks a lane
        store_ids = [3, 7, 1, 10, 0, 2, 4, 5]  # two chunks
        objects = [torch.empty(ctx.chunk_nbytes, dtype=torch.uint8) for _ in range(2)]
        with ctx.operation(store_ids, b"", Lane.STORE) as copies:
            for i, obj in enumerate(objects):
                copies.gather(i, ctx.chunk_view(obj))
        target = _caches(layout, LAYOUTS[layout], seed=2)
        before = [t.clone() for t in target]
        tctx = _context(target, layout, staged)
        retrieve_ids = [-1, 6, -1, 8, 9, -1, 11, -1]  # two runs in chunk 0, two in chunk 1
        with tctx.operation(retrieve_ids, b"", Lane.LOAD) as copies:
            for i, obj in enumerate(objects):
                copies.scatter(tctx.chunk_view(obj), i)
        results[staged] = (objects, target)
        block_dim = ctx.geometry.layout.block_dim
        for layer, (src, dst, old) in enumerate(zip(source, target, before, strict=True)):
            for pos, (s, d) in enumerate(zip(store_ids, retrieve_ids, strict=True)):
                if d >= 0:
                    assert torch.equal(dst.select(block_dim, d), src.select(block_dim, s)), (layer, pos)
            untouched = [b for b in range(NUM_BLOCKS) if b not in retrieve_ids]
            for b in untouched:
                assert torch.equal(dst.select(block_dim, b), old.select(block_dim, b))
    for a, b in zip(results[False][0], results[True][0], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_short_chunk_between_whole_ones_copies_its_own_blocks(layout: str, staged: bool) -> None:
    """An operation whose chunks take 4, 1 and 4 blocks (`chunk_blocks`; the short one a request's
    tail): each chunk copies exactly its blocks, the short one into its object's first page."""
    source = _caches(layout, LAYOUTS[layout], seed=4)
    ctx = _context(source, layout, staged)
    counts, store_ids = [4, 1, 4], [3, 7, 1, 10, 0, 2, 4, 5, 6]
    objects = [torch.zeros(ctx.chunk_nbytes, dtype=torch.uint8) for _ in counts]
    ctx.check_block_ids(store_ids, counts, len(counts))
    with pytest.raises(ValueError, match="need 9 block ids"):
        ctx.check_block_ids(store_ids[:8], counts, len(counts))
    with ctx.operation(store_ids, b"", Lane.STORE, counts) as copies:
        for i, obj in enumerate(objects):
            copies.gather(i, ctx.chunk_view(obj))
    short = ctx.chunk_view(objects[1])
    assert short[:, 1:].count_nonzero() == 0  # the short chunk's pages past its one: never written
    target = _caches(layout, LAYOUTS[layout], seed=5)
    before = [t.clone() for t in target]
    tctx = _context(target, layout, staged)
    retrieve_ids = [8, 9, -1, 11, 6, 0, 1, 2, 3]
    with tctx.operation(retrieve_ids, b"", Lane.LOAD, counts) as copies:
        for i, obj in enumerate(objects):
            copies.scatter(tctx.chunk_view(obj), i)
    block_dim = ctx.geometry.layout.block_dim
    for src, dst, old in zip(source, target, before, strict=True):
        for s, d in zip(store_ids, retrieve_ids, strict=True):
            if d >= 0:
                assert torch.equal(dst.select(block_dim, d), src.select(block_dim, s))
        for b in (5, 7, 10):  # named by no chunk, or skipped
            assert torch.equal(dst.select(block_dim, b), old.select(block_dim, b))


def test_operations_reuse_the_staging_slots() -> None:
    """Several operations in a row on one staged context: each chunk's bytes are its own (the
    slots are reused, never shared by two chunks at once)."""
    layers = _caches("MLA", LAYOUTS["MLA"], seed=3)
    ctx = _context(layers, "MLA", staged=True)
    slots = list(ctx._lanes[Lane.STORE].slots)
    seen = []
    for ids in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
        obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
        with ctx.operation(ids, b"", Lane.STORE) as copies:
            copies.gather(0, ctx.chunk_view(obj))
        seen.append(obj)
        assert all(a is b for a, b in zip(ctx._lanes[Lane.STORE].slots, slots, strict=True))
    for n, obj in enumerate(seen):
        view = ctx.chunk_view(obj)
        for layer, cache in enumerate(layers):
            assert torch.equal(view[layer], cache[4 * n:4 * n + 4])


def test_an_event_handle_for_a_cpu_cache_is_refused() -> None:
    layers = _caches("MLA", LAYOUTS["MLA"], seed=4)
    ctx = _context(layers, "MLA", staged=False)
    with pytest.raises(ValueError, match="event handle was sent for a CPU cache"), \
            ctx.operation([0, 1, 2, 3], b"\x01" * 64, Lane.STORE):
        pass


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_copy_writes_a_run_of_pages_of_every_layer(layout: str) -> None:
    """Layers that are views of one allocation are written as one strided view, per run of
    consecutive block ids: the same bytes as one copy per layer and page, nothing else touched."""
    stored = _caches(layout, LAYOUTS[layout], seed=8)
    ctx = _context(stored, layout, staged=False)
    obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
    with ctx.operation([9, 2, 5, 7], b"", Lane.STORE) as copies:
        copies.gather(0, ctx.chunk_view(obj))
    results = []
    for one_allocation in (False, True):
        target = _caches(layout, LAYOUTS[layout], seed=9, one_allocation=one_allocation)
        tctx = _context(target, layout, staged=False)
        assert (tctx._all_layers is not None) == one_allocation
        with tctx.operation([4, 5, -1, 6], b"", Lane.LOAD) as copies:  # a run of two pages, a skip, one page
            copies.scatter(tctx.chunk_view(obj), 0)
        results.append(target)
    for one, many in zip(*results, strict=True):
        assert torch.equal(one, many)
    block_dim = ctx.geometry.layout.block_dim
    untouched = _caches(layout, LAYOUTS[layout], seed=9)
    for got, old, src in zip(results[1], untouched, stored, strict=True):
        for block in range(NUM_BLOCKS):
            expected = {4: src.select(block_dim, 9), 5: src.select(block_dim, 2),
                        6: src.select(block_dim, 7)}.get(block, old.select(block_dim, block))
            assert torch.equal(got.select(block_dim, block), expected), block


# vLLM 0.32's physical orders of the logical [L, B, H, N, C] axes (vllm/v1/kv_cache_layout.py): LBNHC is
# the default on GPU; in BLNHC and BHLNC the layers are interleaved within each block.
VLLM_LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4),
                "BHLNC": (1, 2, 0, 3, 4)}


def _vllm_views(order: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Three layers' bf16 `[blocks, heads, block size, C]` views of one int8 buffer, at a storage
    offset, in `order`: what vLLM 0.32 registers on a GPU (`allocate_kv_cache` makes the buffer,
    `create_kv_cache_views` the per-layer `as_strided` views, then `.view(dtype)`)."""
    shape = (3, NUM_BLOCKS, 2, 16, 2 * 8 * 2)  # C in bytes: 2*head size of bf16
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim], step = step, step * shape[dim]
    raw = torch.zeros(64 + step, dtype=torch.int8)
    gen = torch.Generator().manual_seed(seed)
    raw.view(torch.bfloat16).copy_(torch.randn(raw.numel() // 2, generator=gen))
    every_layer = torch.as_strided(raw, shape, strides, storage_offset=64)
    return [every_layer[layer].view(torch.bfloat16) for layer in range(3)]


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("order", sorted(VLLM_LAYOUTS))
def test_layers_of_one_vllm_buffer_are_copied_in_one_call_per_chunk(order: str, staged: bool) -> None:
    """vLLM 0.32's per-layer views of one buffer, non-contiguous, layers outermost or interleaved
    within each block: one `[layers, blocks, ...]` view serves every layer, and STORE and RETRIEVE
    (with skipped blocks) move exactly the pages a view per layer would."""
    source = _vllm_views(VLLM_LAYOUTS[order], seed=10)
    ctx = _context(source, "FLASH_ATTN", staged)
    assert ctx._all_layers is not None
    store_ids = [3, 7, 1, 10, 0, 2, 4, 5]
    objects = [torch.empty(ctx.chunk_nbytes, dtype=torch.uint8) for _ in range(2)]
    with ctx.operation(store_ids, b"", Lane.STORE) as copies:
        for i, obj in enumerate(objects):
            copies.gather(i, ctx.chunk_view(obj))
    for i, obj in enumerate(objects):
        expected = torch.stack([layer[store_ids[4 * i:4 * i + 4]] for layer in source])
        assert torch.equal(ctx.chunk_view(obj), expected), i
    target = _vllm_views(VLLM_LAYOUTS[order], seed=11)
    before = [layer.clone() for layer in target]
    tctx = _context(target, "FLASH_ATTN", staged)
    retrieve_ids = [-1, 6, -1, 8, 9, 11, -1, 2]
    with tctx.operation(retrieve_ids, b"", Lane.LOAD) as copies:
        for i, obj in enumerate(objects):
            copies.scatter(tctx.chunk_view(obj), i)
    for got, old, src in zip(target, before, source, strict=True):
        for block in range(NUM_BLOCKS):
            want = src[store_ids[retrieve_ids.index(block)]] if block in retrieve_ids else old[block]
            assert torch.equal(got[block], want), block


@pytest.mark.parametrize(("shape", "strides", "expected"), [
    ((3, 4, 5), (20, 5, 1), True),  # contiguous
    ((3, 4, 5), (5, 15, 1), True),  # layers interleaved within each block
    ((3, 4, 5), (4, 5, 1), False),  # each layer starts inside the previous one's first block
    ((3, 1, 5), (5, 0, 1), True),  # a dimension of size 1 names one element whatever its stride
    ((3, 4, 5), (20, 0, 1), False),  # a broadcast dimension
])
def test_non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...], expected: bool) -> None:
    assert non_overlapping(shape, strides) is expected


def test_layers_that_overlap_are_copied_one_by_one() -> None:
    """Views of one buffer at a constant distance shorter than a page (not something vLLM makes)
    are never written as one view: each layer keeps its own copies."""
    blocks, tokens, latent = LAYOUTS["MLA"]  # the layers one token row apart
    raw = torch.randn(2 * latent + blocks * tokens * latent).to(torch.bfloat16)
    layers = [torch.as_strided(raw, (blocks, tokens, latent), (tokens * latent, latent, 1), layer * latent)
              for layer in range(3)]
    ctx = _context(layers, "MLA", staged=False)
    assert ctx._all_layers is None
    obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
    with ctx.operation([5, 0, 9, 2], b"", Lane.STORE) as copies:
        copies.gather(0, ctx.chunk_view(obj))
    assert torch.equal(ctx.chunk_view(obj), torch.stack([layer[[5, 0, 9, 2]] for layer in layers]))


@pytest.mark.parametrize(("ids", "start", "end", "runs"), [
    ([4, 5, 6, 7], 0, 4, [(0, 4)]),
    ([7, 6, 5, 4], 0, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ([-1, 3, 4, 9, 10, 2], 1, 6, [(1, 2), (3, 2), (5, 1)]),
])
def test_consecutive_runs(ids: list[int], start: int, end: int, runs: list[tuple[int, int]]) -> None:
    assert consecutive_runs(ids, start, end) == runs


@pytest.mark.parametrize(("ids", "runs"), [
    ([0, 1, 2, 3], [(0, 4)]),
    ([-1, -1, 2, 3], [(2, 4)]),
    ([-1, 5, -1, 7], [(1, 2), (3, 4)]),
    ([-1, -1, -1, -1], []),
    ([4, -1, -1, 9], [(0, 1), (3, 4)]),
])
def test_kept_runs(ids: list[int], runs: list[tuple[int, int]]) -> None:
    assert kept_runs(ids) == runs


# ---- a RETRIEVE split over copy threads ----------------------------------------------------------


def scatter(ctx: TransferContext, copies: Copies, objects: list[torch.Tensor]) -> Callable[[int], bool]:
    """The engine's chunk copy for a RETRIEVE (without its fence)."""

    def copy(i: int) -> bool:
        copies.scatter(ctx.chunk_view(objects[i]), i)
        return True

    return copy


def test_a_split_retrieve_is_byte_exact_and_skips_minus_one_blocks() -> None:
    """Chunks scattered by two threads at once land where one thread puts them, -1 blocks untouched."""
    layout = "FLASH_ATTN"
    source = _caches(layout, LAYOUTS[layout], seed=5)
    ctx = _context(source, layout, staged=False)
    objects = [torch.empty(ctx.chunk_nbytes, dtype=torch.uint8) for _ in range(3)]
    with ctx.operation(list(range(12)), b"", Lane.STORE) as copies:
        for i, obj in enumerate(objects):
            copies.gather(i, ctx.chunk_view(obj))
    retrieve_ids = [-1, 6, 8, 9, 11, -1, 0, 2, 4, 5, -1, 1]
    results = []
    for split in (False, True):
        target = _caches(layout, LAYOUTS[layout], seed=6, one_allocation=split)
        tctx = _context(target, layout, staged=False)
        threads = CopyThreads(2)
        try:
            with threads.seat(), tctx.operation(retrieve_ids, b"", Lane.LOAD) as copies:
                assert copies.splittable
                record = Recorder(scatter(tctx, copies, objects), meet=2 if split else 1)
                threads.run(len(objects), record, split=split)
        finally:
            threads.close()
        assert record.chunks() == [0, 1, 2]  # each chunk once
        assert len(record.by_thread) == (2 if split else 1)
        helped = [len(done) for tid, done in record.by_thread.items() if tid != threading.get_ident()]
        assert threads.helped_chunks == sum(helped)
        results.append(target)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)
    untouched = _caches(layout, LAYOUTS[layout], seed=6)
    for layer, (got, old, src) in enumerate(zip(results[1], untouched, source, strict=True)):
        for pos, block in enumerate(retrieve_ids):
            if block >= 0:
                assert torch.equal(got[block], src[pos]), (layer, pos)
        for block in (3, 7, 10):  # named by no id: left alone
            assert torch.equal(got[block], old[block])


def test_a_staged_context_is_never_split() -> None:
    layers = _caches("MLA", LAYOUTS["MLA"], seed=7)
    with _context(layers, "MLA", staged=True).operation([0, 1, 2, 3], b"", Lane.LOAD) as copies:
        assert not copies.splittable  # its one staging buffer serves one chunk at a time


def test_no_helper_joins_while_every_copy_thread_is_busy() -> None:
    threads = CopyThreads(2)
    try:
        with threads.seat(), threads.seat():  # the other seat: an operation on the other worker thread
            record = Recorder()
            threads.run(8, record, split=True)
        assert list(record.by_thread) == [threading.get_ident()]
        assert threads.helped_chunks == 0
        with threads.seat():  # that operation is done: the next RETRIEVE is split again
            record = Recorder(meet=2)
            threads.run(8, record, split=True)
        assert len(record.by_thread) == 2 and record.chunks() == list(range(8))
    finally:
        threads.close()


def test_a_cancelled_split_stops_every_thread_before_run_returns() -> None:
    """A copy that says stop (the fence saw a CANCEL) ends the hand-out on every thread, and `run`
    returns only once the copy still running on the other thread is complete: the CANCEL is
    answered after that, so nothing is written once it is."""
    finished: list[int] = []
    stop_at = 3

    def copy(i: int) -> bool:
        if i >= stop_at:
            return False
        time.sleep(0.05)  # a slow chunk: still copying on one thread when the other stops
        finished.append(i)
        return True

    threads = CopyThreads(2)
    try:
        with threads.seat():
            record = Recorder(copy, meet=2)
            threads.run(64, record, split=True)
        started = record.chunks()
        assert set(finished) == {i for i in started if i < stop_at}  # complete when run returned
        assert max(started) <= stop_at + 1  # at most one more taken by the thread still copying
    finally:
        threads.close()


def test_a_helpers_error_reaches_the_request() -> None:
    def copy(i: int) -> bool:
        if threading.get_ident() != caller:
            raise RuntimeError(f"chunk {i} failed")
        return True

    caller = threading.get_ident()
    threads = CopyThreads(2)
    try:
        with threads.seat(), pytest.raises(RuntimeError, match="failed"):
            threads.run(64, Recorder(copy, meet=2), split=True)
        with threads.seat():  # the seat the helper held is free again
            record = Recorder(meet=2)
            threads.run(4, record, split=True)
        assert len(record.by_thread) == 2
    finally:
        threads.close()


# ---- lanes: a load never waits for a store -------------------------------------------------------


def test_a_load_runs_while_a_store_holds_the_same_context() -> None:
    """On a staged context (a GPU's caches), a RETRIEVE's copies run while a STORE's operation is
    open on another thread: each has its own staging buffer, stream and lock."""
    layers = _caches("MLA", LAYOUTS["MLA"], seed=12)
    ctx = _context(layers, "MLA", staged=True)
    obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
    with ctx.operation([0, 1, 2, 3], b"", Lane.STORE) as copies:
        copies.gather(0, ctx.chunk_view(obj))
    storing, release, loaded = threading.Event(), threading.Event(), threading.Event()

    def store() -> None:
        with ctx.operation([4, 5, 6, 7], b"", Lane.STORE) as copies:
            copies.gather(0, ctx.chunk_view(torch.empty_like(obj)))
            storing.set()
            release.wait(60)

    def load() -> None:
        with ctx.operation([8, 9, -1, 11], b"", Lane.LOAD) as copies:
            copies.scatter(ctx.chunk_view(obj), 0)
        loaded.set()

    storer = threading.Thread(target=store)
    storer.start()
    loader = threading.Thread(target=load)
    try:
        assert storing.wait(30)
        loader.start()
        assert loaded.wait(30), "the load waited for the store"
        assert storer.is_alive()  # the store's operation was open all along
    finally:
        release.set()
        storer.join(30)
        if loader.ident is not None:
            loader.join(30)
    for layer in layers:
        assert torch.equal(layer[8:10], layer[0:2]) and torch.equal(layer[11], layer[3])


# ---- the bounded completion wait of a GPU's copies --------------------------------------------------


def test_a_completion_wait_returns_what_the_wait_did() -> None:
    def failing() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with ThreadPoolExecutor(1) as waiter:
        wait_bounded(waiter, lambda: None, 30, "the copies")
        with pytest.raises(RuntimeError, match="illegal memory access"):
            wait_bounded(waiter, failing, 30, "the copies")


def test_a_completion_wait_past_its_deadline_is_fatal() -> None:
    """A wait that never returns (copies behind a dead worker's event) ends in a FatalError once
    its deadline has passed, the waiting thread left behind (the daemon exits)."""
    release = threading.Event()
    with ThreadPoolExecutor(1) as waiter:
        try:
            started = time.monotonic()
            with pytest.raises(FatalError, match="the copies on cuda:0 did not complete within"):
                wait_bounded(waiter, release.wait, 0.2, "the copies on cuda:0")
            assert time.monotonic() - started >= 0.2
        finally:
            release.set()
