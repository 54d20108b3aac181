"""The copy paths of `TransferContext`, in-process (no daemon): the staged path that CUDA caches
take, run on CPU tensors so that every line but the DMA's and the stream's is checked here."""

from __future__ import annotations

import pytest
import torch

from lmcache_mp.transfer.context import TransferContext, kept_runs
from lmcache_mp.transfer.layouts import describe_caches

NUM_BLOCKS = 12
CHUNK_TOKENS = 64  # 4 blocks of 16


def _caches(layout: str, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
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


@pytest.mark.parametrize(("ids", "runs"), [
    ([0, 1, 2, 3], [(0, 4)]),
    ([-1, -1, 2, 3], [(2, 4)]),
    ([-1, 5, -1, 7], [(1, 2), (3, 4)]),
    ([-1, -1, -1, -1], []),
    ([4, -1, -1, 9], [(0, 1), (3, 4)]),
])
def test_kept_runs(ids: list[int], runs: list[tuple[int, int]]) -> None:
    assert kept_runs(ids) == runs
