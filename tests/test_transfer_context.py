"""The copy paths of `TransferContext`, in-process (no daemon): the staged path that CUDA caches
take, run on CPU tensors so that every line but the DMA's and the stream's is checked here; and a
RETRIEVE's chunks split over copy threads (`CopyThreads`), with real threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from lmcache_mp.transfer.context import Copies, TransferContext, consecutive_runs, kept_runs
from lmcache_mp.transfer.layouts import describe_caches
from lmcache_mp.transfer.threads import CopyThreads

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
    "MLA": (NUM_BLOCKS, 16, 24),  # [blocks, block size, latent dim]
    "FLASH_ATTN/KV_PLANES": (2, NUM_BLOCKS, 16, 2, 8),  # block dim 1
}


def _context(layers: list[torch.Tensor], layout: str, staged: bool) -> TransferContext:
    name = "FLASH_ATTN" if layout.startswith("FLASH_ATTN") else layout
    return TransferContext(layers, describe_caches(layers, name), CHUNK_TOKENS, staged=staged)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_staged_copies_equal_direct_copies(layout: str) -> None:
    """STORE then RETRIEVE (with skipped blocks) through the staging buffer gives the same bytes as
    the direct path, and only the blocks named are written."""
    source = _caches(layout, LAYOUTS[layout], seed=1)
    results = {}
    for staged in (False, True):
        ctx = _context(source, layout, staged)
        assert ctx.staging_nbytes == (ctx.chunk_nbytes if staged else 0)  # the bound: one chunk
        store_ids = [3, 7, 1, 10, 0, 2, 4, 5]  # two chunks
        objects = [torch.empty(ctx.chunk_nbytes, dtype=torch.uint8) for _ in range(2)]
        with ctx.operation(store_ids, b"") as copies:
            for i, obj in enumerate(objects):
                copies.gather(i, ctx.chunk_view(obj))
        target = _caches(layout, LAYOUTS[layout], seed=2)
        before = [t.clone() for t in target]
        tctx = _context(target, layout, staged)
        retrieve_ids = [-1, 6, -1, 8, 9, -1, 11, -1]  # two runs in chunk 0, two in chunk 1
        with tctx.operation(retrieve_ids, b"") as copies:
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


def test_operations_reuse_the_one_staging_buffer() -> None:
    """Several operations in a row on one staged context: each chunk's bytes are its own (the
    buffer is reused, never shared by two chunks at once)."""
    layers = _caches("MLA", LAYOUTS["MLA"], seed=3)
    ctx = _context(layers, "MLA", staged=True)
    staging = ctx._staging
    seen = []
    for ids in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
        obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
        with ctx.operation(ids, b"") as copies:
            copies.gather(0, ctx.chunk_view(obj))
        seen.append(obj)
        assert ctx._staging is staging
    for n, obj in enumerate(seen):
        view = ctx.chunk_view(obj)
        for layer, cache in enumerate(layers):
            assert torch.equal(view[layer], cache[4 * n:4 * n + 4])


def test_an_event_handle_for_a_cpu_cache_is_refused() -> None:
    layers = _caches("MLA", LAYOUTS["MLA"], seed=4)
    ctx = _context(layers, "MLA", staged=False)
    with pytest.raises(ValueError, match="event handle was sent for a CPU cache"), \
            ctx.operation([0, 1, 2, 3], b"\x01" * 64):
        pass


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_copy_writes_a_run_of_pages_of_every_layer(layout: str) -> None:
    """Layers that are views of one allocation are written as one strided view, per run of
    consecutive block ids: the same bytes as one copy per layer and page, nothing else touched."""
    stored = _caches(layout, LAYOUTS[layout], seed=8)
    ctx = _context(stored, layout, staged=False)
    obj = torch.empty(ctx.chunk_nbytes, dtype=torch.uint8)
    with ctx.operation([9, 2, 5, 7], b"") as copies:
        copies.gather(0, ctx.chunk_view(obj))
    results = []
    for one_allocation in (False, True):
        target = _caches(layout, LAYOUTS[layout], seed=9, one_allocation=one_allocation)
        tctx = _context(target, layout, staged=False)
        assert (tctx._all_layers is not None) == one_allocation
        with tctx.operation([4, 5, -1, 6], b"") as copies:  # a run of two pages, a skip, one page
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


class Recorder:
    """A chunk copy for `CopyThreads.run` that notes which thread copied each chunk; each thread's
    first copy waits (up to 10 s) until `meet` threads have started one, so that a split is seen
    whichever thread starts first."""

    def __init__(self, copy: Callable[[int], bool] = lambda i: True, meet: int = 1):
        self.by_thread: dict[int, list[int]] = {}
        self._copy = copy
        self._meet = threading.Barrier(meet)
        self._lock = threading.Lock()

    def __call__(self, i: int) -> bool:
        me = threading.get_ident()
        with self._lock:
            first = me not in self.by_thread
            self.by_thread.setdefault(me, []).append(i)
        if first:
            self._meet.wait(10)
        return self._copy(i)

    def chunks(self) -> list[int]:
        return sorted(i for done in self.by_thread.values() for i in done)


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
    with ctx.operation(list(range(12)), b"") as copies:
        for i, obj in enumerate(objects):
            copies.gather(i, ctx.chunk_view(obj))
    retrieve_ids = [-1, 6, 8, 9, 11, -1, 0, 2, 4, 5, -1, 1]
    results = []
    for split in (False, True):
        target = _caches(layout, LAYOUTS[layout], seed=6, one_allocation=split)
        tctx = _context(target, layout, staged=False)
        threads = CopyThreads(2)
        try:
            with threads.seat(), tctx.operation(retrieve_ids, b"") as copies:
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
    with _context(layers, "MLA", staged=True).operation([0, 1, 2, 3], b"") as copies:
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
