"""KV cache layouts (`transfer/layouts.py`): which dimension of a layer tensor indexes blocks and
which counts a block's tokens (`resolve_layout`), the caches' geometry with kernel blocks grouped
into vLLM's blocks (`describe_caches`), and the chunk format whose fingerprint keys stored chunks.

In process, on small CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_mp.transfer.layouts import describe_caches, resolve_layout

S = torch.Size


# ---- resolve_layout ----------------------------------------------------------------------------

# (backend name, shape) -> (layout name, rank, block dim, token dim)
ACCEPTED = [
    # Without a name, the shape decides.
    ("", (10, 16, 64), ("MLA", 3, 0, 1)),
    ("", (10, 2, 16, 64), ("PAGED_4D", 4, 0, 2)),
    ("", (2, 10, 16, 4, 64), ("KV_PLANES", 5, 1, 2)),
    ("", (10, 2, 16, 4, 64), ("KV_PAIRS", 5, 0, 2)),
    ("", (2, 2, 16, 4, 64), ("KV_PLANES", 5, 1, 2)),  # both read as 2: K/V planes first
    # vLLM 0.32's logical 4-D view, for any backend; the name (upper-cased) is the layout.
    ("CPU_ATTN", (10, 2, 16, 128), ("CPU_ATTN", 4, 0, 2)),
    ("cpu_attn", (10, 2, 16, 128), ("CPU_ATTN", 4, 0, 2)),
    ("FLASH_ATTN", (10, 2, 16, 128), ("FLASH_ATTN", 4, 0, 2)),
    ("FLASHINFER", (10, 2, 16, 128), ("FLASHINFER", 4, 0, 2)),
    ("TRITON_ATTN", (10, 8, 16, 128), ("TRITON_ATTN", 4, 0, 2)),
    # 4-D MLA: one latent head in dimension 1.
    ("FLASHMLA", (10, 1, 16, 576), ("FLASHMLA", 4, 0, 2)),
    ("triton_mla", (10, 1, 16, 576), ("TRITON_MLA", 4, 0, 2)),
    # 3-D MLA before vLLM 0.32: every MLA backend is the one "MLA" layout.
    ("TRITON_MLA", (10, 16, 576), ("MLA", 3, 0, 1)),
    ("FLASHMLA", (10, 16, 576), ("MLA", 3, 0, 1)),
    ("CUTLASS_MLA", (10, 16, 576), ("MLA", 3, 0, 1)),
    # 5-D caches of vLLM before 0.32, by name.
    ("FLASH_ATTN", (2, 10, 16, 4, 64), ("FLASH_ATTN/KV_PLANES", 5, 1, 2)),
    ("flash_attn", (2, 10, 16, 4, 64), ("FLASH_ATTN/KV_PLANES", 5, 1, 2)),
    ("FLASHINFER", (10, 2, 16, 4, 64), ("FLASHINFER/KV_PAIRS", 5, 0, 2)),
]


@pytest.mark.parametrize(("name", "shape", "expected"), ACCEPTED)
def test_resolve_layout_accepts(name: str, shape: tuple[int, ...], expected: tuple) -> None:
    spec = resolve_layout(name, S(shape))
    assert (spec.name, spec.ndim, spec.block_dim, spec.token_dim) == expected
    assert spec.ndim == len(shape)


REFUSED = [
    ("", (10, 16), "cannot infer a KV layout from shape (10, 16)"),
    ("", (3, 3, 16, 4, 64), "cannot infer a KV layout"),
    ("", (10, 1, 2, 16, 4, 64), "send the backend name"),
    ("FLASHMLA", (10, 2, 16, 576), "one latent head in dimension 1"),
    ("TRITON_MLA", (2, 10, 16, 4, 576), "expects 3-D or 4-D caches"),
    ("FLASH_ATTN", (10, 16, 128), "unsupported KV layout 'FLASH_ATTN' with a 3-D cache"),
    ("CPU_ATTN", (2, 10, 16, 4, 64), "5-D ones for FLASHINFER, FLASH_ATTN"),
    ("NO_SUCH_BACKEND", (10, 16), "4-D caches (vLLM 0.32's"),
    ("FLASH_ATTN", (3, 10, 16, 4, 64), "leading K/V dimension of 2"),
    ("FLASHINFER", (10, 3, 16, 4, 64), "K/V in dimension 1"),
]


@pytest.mark.parametrize(("name", "shape", "message"), REFUSED)
def test_resolve_layout_refuses_loudly(name: str, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_layout(name, S(shape))
    assert message in str(err.value)


# ---- describe_caches -----------------------------------------------------------------------------


def layers(shape: tuple[int, ...], n: int = 3, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return [torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype) + 1000 * i
            for i in range(n)]


def test_describe_caches_geometry_of_4d_caches() -> None:
    caches = layers((10, 2, 16, 8))
    seen, geo = describe_caches(caches, "CPU_ATTN")
    assert all(a is b for a, b in zip(seen, caches, strict=True))  # no grouping: the tensors themselves
    assert (geo.layout.name, geo.dtype, geo.num_layers, geo.num_blocks, geo.block_size, geo.page_shape) == \
        ("CPU_ATTN", torch.bfloat16, 3, 10, 16, (2, 16, 8))
    assert geo.page_nbytes == 2 * 16 * 8 * 2
    assert geo.cache_nbytes == 3 * 10 * geo.page_nbytes
    assert geo.chunk_nbytes(4) == 3 * 4 * geo.page_nbytes
    assert describe_caches(caches, "CPU_ATTN", block_size=16)[1] == geo  # the caches' own block size


def test_describe_caches_of_kv_planes_removes_the_block_dimension() -> None:
    _, geo = describe_caches(layers((2, 6, 16, 4, 8), n=2), "FLASH_ATTN")
    assert (geo.num_blocks, geo.block_size, geo.page_shape) == (6, 16, (2, 16, 4, 8))


@pytest.mark.parametrize(("other", "words"), [
    (torch.zeros(10, 2, 16, 4, dtype=torch.bfloat16), "layer 1 has shape (10, 2, 16, 4)"),
    (torch.zeros(10, 2, 16, 8, dtype=torch.float16), "torch.float16, layer 0 has"),
])
def test_describe_caches_refuses_layers_that_differ(other: torch.Tensor, words: str) -> None:
    with pytest.raises(ValueError) as err:
        describe_caches([layers((10, 2, 16, 8), n=1)[0], other], "CPU_ATTN")
    assert words in str(err.value) and "all layers must match" in str(err.value)


def test_describe_caches_refuses_no_layers_and_empty_ones() -> None:
    with pytest.raises(ValueError, match="no KV cache layers"):
        describe_caches([], "CPU_ATTN")
    with pytest.raises(ValueError, match="are empty"):
        describe_caches([torch.zeros(0, 2, 16, 8)], "CPU_ATTN")
    with pytest.raises(ValueError, match="one latent head"):  # the layout is checked too
        describe_caches([torch.zeros(4, 2, 16, 8)], "FLASHMLA")


def test_kernel_blocks_are_grouped_into_vllms_blocks() -> None:
    """A backend that splits each 16-token block into two kernel blocks of 8: block id b is kernel
    blocks 2b and 2b+1, seen (as views of the same memory) as one page `[2, *kernel page]`."""
    caches = layers((8, 2, 8, 4), dtype=torch.float32)  # every element distinct
    seen, geo = describe_caches(caches, "FLASH_ATTN", block_size=16)
    assert (geo.num_blocks, geo.block_size, geo.page_shape) == (4, 16, (2, 2, 8, 4))
    assert geo.cache_nbytes == sum(c.numel() * c.element_size() for c in caches)
    for grouped, kernel in zip(seen, caches, strict=True):
        assert grouped.shape == (4, 2, 2, 8, 4) and grouped.data_ptr() == kernel.data_ptr()
        for block in range(4):
            for r in range(2):
                assert torch.equal(grouped[block, r], kernel[2 * block + r])
    grouped[1, 0].fill_(-1)  # a write through the grouped view lands in kernel block 2
    assert bool((caches[-1][2] == -1).all()) and not bool((caches[-1][3] == -1).any())


def test_kernel_blocks_are_grouped_along_the_block_dimension_of_kv_planes() -> None:
    caches = layers((2, 6, 4, 2, 8), n=2, dtype=torch.float32)
    seen, geo = describe_caches(caches, "FLASH_ATTN", block_size=12)
    assert (geo.num_blocks, geo.block_size, geo.page_shape) == (2, 12, (2, 3, 4, 2, 8))
    assert torch.equal(seen[0][:, 1, 2], caches[0][:, 5])  # block 1, kernel block 2 of it: kernel block 5


@pytest.mark.parametrize("block_size", [6, 4, 24, -8])
def test_block_sizes_that_are_not_whole_groups_are_refused(block_size: int) -> None:
    """8 kernel blocks of 8 tokens: 6 and 4 are not multiples of 8, 24 makes groups of 3 (8 % 3),
    a negative size means nothing."""
    with pytest.raises(ValueError) as err:
        describe_caches(layers((8, 2, 8, 4), n=1), "FLASH_ATTN", block_size=block_size)
    assert f"blocks of {block_size} tokens are not whole groups" in str(err.value)
    assert "8 kernel blocks of 8 tokens" in str(err.value)


# ---- chunk_format ------------------------------------------------------------------------------


def fmt(shape: tuple[int, ...], layout: str, dtype: torch.dtype = torch.bfloat16, world: int = 1,
        rank: int = 0, replicated: bool = False, model: str = "m", chunk_tokens: int = 64):
    _, geo = describe_caches(layers(shape, n=2, dtype=dtype), layout)
    return geo.chunk_format(model, world, rank, chunk_tokens, replicated=replicated)


def test_chunk_format_records_the_geometry() -> None:
    f = fmt((10, 2, 16, 8), "cpu_attn", world=2, rank=1)
    assert (f.model_name, f.world_size, f.worker_id, f.layout, f.dtype, f.num_layers, tuple(f.page_shape),
            f.chunk_tokens) == ("m", 2, 1, "CPU_ATTN", "bfloat16", 2, (2, 16, 8), 64)
    assert f.fingerprint == fmt((10, 2, 16, 8), "CPU_ATTN", world=2, rank=1).fingerprint  # deterministic


def test_fingerprints_differ_whenever_the_bytes_mean_something_else() -> None:
    base = dict(shape=(10, 2, 16, 8), layout="CPU_ATTN")
    variants = [
        base,
        {**base, "layout": "FLASH_ATTN"},  # same shape, another backend's page bytes
        {**base, "layout": ""},  # PAGED_4D, inferred
        {**base, "dtype": torch.float16},
        {**base, "shape": (10, 2, 16, 4)},
        {**base, "world": 2},
        {**base, "world": 2, "rank": 1},
        {**base, "model": "other"},
        {**base, "chunk_tokens": 128},
        {"shape": (10, 16, 8), "layout": "TRITON_MLA"},  # 3-D MLA
        {"shape": (10, 1, 16, 8), "layout": "TRITON_MLA"},  # 4-D MLA
    ]
    prints = [fmt(**v).fingerprint for v in variants]
    assert len(set(prints)) == len(prints)


@pytest.mark.parametrize(("shape", "layout"), [((10, 16, 576), "FLASHMLA"), ((10, 1, 16, 576), "FLASHMLA")])
def test_replicated_mla_is_one_format_on_every_rank(shape: tuple[int, ...], layout: str) -> None:
    """Every rank holds the same latent bytes: the chunk is keyed as a one-rank engine's."""
    ranks = [fmt(shape, layout, world=4, rank=r, replicated=True) for r in range(4)]
    single = fmt(shape, layout)
    assert {f.fingerprint for f in ranks} == {single.fingerprint}
    assert (ranks[3].world_size, ranks[3].worker_id) == (1, 0)
    assert fmt(shape, layout, world=4, rank=3).fingerprint != single.fingerprint  # not replicated: its own


@pytest.mark.parametrize(("shape", "layout"), [((10, 2, 16, 8), "FLASH_ATTN"), ((10, 2, 16, 8), "")])
def test_only_mla_may_be_replicated(shape: tuple[int, ...], layout: str) -> None:
    with pytest.raises(ValueError, match="only MLA caches are the same on every rank"):
        fmt(shape, layout, world=2, rank=1, replicated=True)
