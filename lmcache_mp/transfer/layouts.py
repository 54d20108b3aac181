"""KV cache layouts: where a block lives in each registered layer tensor, and chunk formats.

The daemon moves whole blocks ("pages"): for every layer, the slice of the layer tensor
that belongs to one block id. Which dimension indexes blocks, and which one counts the
tokens of a block, depends on the attention backend. The shape alone cannot tell vLLM
0.32's CPU layout (K rows then V rows per head) from its FlashAttention layout (K|V per
token): both are `[num_blocks, heads, block_size, 2*head_size]`. So the worker sends the
backend name, and the name becomes part of every stored chunk's format (and fingerprint): bytes
stored under one layout are never read back into another.

vLLM 0.32 hands every backend's cache over as that logical 4-D view (`create_kv_cache_views`:
one int8 buffer for all layers, each layer a strided view of it), MLA included (`[blocks, 1,
block_size, latent]`). The copies index only the logical view, so any physical order
(`KVCacheLayout`) reads and writes the same page bytes. A backend may split each of vLLM's
blocks into `ratio` kernel blocks: dim 0 then counts `num_blocks * ratio` kernel blocks of
`block_size / ratio` tokens, and `describe_caches` groups them back into vLLM's blocks, which is
what a block id names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_mp.chunks import ChunkFormat
from lmcache_mp.transfer.dtypes import dtype_to_str


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    ndim: int
    block_dim: int  # the dimension that indexes blocks
    token_dim: int  # the dimension that counts the tokens of one block (the block size)


# (vLLM backend name, tensor rank) -> layout, for the caches of vLLM before 0.32, whose shape
# the backend chose. vLLM reused backend names across layout changes.
_BY_NAME: dict[tuple[str, int], LayoutSpec] = {
    # Older FlashAttention: [2, num_blocks, block_size, kv_heads, head_size] (K plane, V plane).
    ("FLASH_ATTN", 5): LayoutSpec("FLASH_ATTN/KV_PLANES", 5, block_dim=1, token_dim=2),
    # Older FlashInfer: [num_blocks, 2, block_size, kv_heads, head_size].
    ("FLASHINFER", 5): LayoutSpec("FLASHINFER/KV_PAIRS", 5, block_dim=0, token_dim=2),
}
# Multi-head latent attention before vLLM 0.32: [num_blocks, block_size, latent_dim], one row per token.
_MLA = LayoutSpec("MLA", 3, block_dim=0, token_dim=1)


def _is_mla(name: str) -> bool:
    """vLLM's MLA backends all say so in their name (TRITON_MLA, FLASHMLA, CUTLASS_MLA, ...)."""
    return "MLA" in name


def _by_shape(shape: torch.Size) -> LayoutSpec:
    """Without a backend name, the shape decides (and the fingerprint says so)."""
    if len(shape) == 3:
        return _MLA
    if len(shape) == 4:
        return LayoutSpec("PAGED_4D", 4, block_dim=0, token_dim=2)
    if len(shape) == 5 and shape[0] == 2:
        return LayoutSpec("KV_PLANES", 5, block_dim=1, token_dim=2)
    if len(shape) == 5 and shape[1] == 2:
        return LayoutSpec("KV_PAIRS", 5, block_dim=0, token_dim=2)
    raise ValueError(f"cannot infer a KV layout from shape {tuple(shape)}; send the backend name")


def resolve_layout(name: str, shape: torch.Size) -> LayoutSpec:
    """The layout of a layer tensor, from vLLM's backend name (or the shape when empty).
    Unknown or contradictory combinations are refused loudly, never guessed."""
    if not name:
        return _by_shape(shape)
    upper = name.upper()
    if len(shape) == 4:
        # vLLM 0.32's logical view, whatever the backend: the name stays in the fingerprint, so
        # chunks never cross backends (whose page bytes may mean different things).
        if _is_mla(upper) and shape[1] != 1:
            raise ValueError(f"layout {name!r} is MLA, whose 4-D caches have one latent head in "
                             f"dimension 1; got shape {tuple(shape)}")
        return LayoutSpec(upper, 4, block_dim=0, token_dim=2)
    spec = _MLA if _is_mla(upper) else _BY_NAME.get((upper, len(shape)))
    if spec is None:
        known = sorted({n for n, _ in _BY_NAME})
        raise ValueError(
            f"unsupported KV layout {name!r} with a {len(shape)}-D cache of shape {tuple(shape)}; "
            f"4-D caches (vLLM 0.32's [blocks, heads, block_size, C] view) are read for any backend, "
            f"3-D ones for MLA backends, 5-D ones for {', '.join(known)}"
        )
    if len(shape) != spec.ndim:
        raise ValueError(f"layout {name!r} expects {spec.ndim}-D or 4-D caches, got shape {tuple(shape)}")
    if spec.name.endswith("KV_PLANES") and shape[0] != 2:
        raise ValueError(f"layout {name!r} expects a leading K/V dimension of 2, got {tuple(shape)}")
    if spec.name.endswith("KV_PAIRS") and shape[1] != 2:
        raise ValueError(f"layout {name!r} expects K/V in dimension 1, got {tuple(shape)}")
    return spec


@dataclass(frozen=True)
class KVGeometry:
    """Everything about a worker's caches that decides what a stored chunk's bytes mean."""

    layout: LayoutSpec
    dtype: torch.dtype
    num_layers: int
    num_blocks: int
    block_size: int
    page_shape: tuple[int, ...]  # one block of one layer, block dimension removed

    @property
    def page_nbytes(self) -> int:
        return torch.Size(self.page_shape).numel() * self.dtype.itemsize

    @property
    def cache_nbytes(self) -> int:
        """The registered caches' size: every block of every layer."""
        return self.num_layers * self.num_blocks * self.page_nbytes

    def chunk_nbytes(self, blocks_per_chunk: int) -> int:
        return self.num_layers * blocks_per_chunk * self.page_nbytes

    def chunk_format(self, model_name: str, world_size: int, worker_id: int, chunk_tokens: int,
                     replicated: bool = False) -> ChunkFormat:
        """What a chunk stored from these caches is; its fingerprint keys the chunk in every tier.
        `replicated`: every rank of the world holds these very bytes (MLA's latent cache under
        tensor parallelism alone), so the chunk is keyed as a one-rank engine's: stored once for
        all ranks, and read by each of them and by an engine of the same model on one rank."""
        if replicated:
            if not _is_mla(self.layout.name):
                # Fail closed: ranks of any other layout hold their own heads, and one rank's
                # chunk would be read into another's cache as wrong KV.
                raise ValueError(f"only MLA caches are the same on every rank; layout "
                                 f"{self.layout.name!r} cannot be registered as replicated")
            world_size, worker_id = 1, 0
        return ChunkFormat(model_name, world_size, worker_id, self.layout.name,
                           dtype_to_str(self.dtype), self.num_layers, self.page_shape, chunk_tokens)


def describe_caches(layers: list[torch.Tensor], layout_name: str,
                    block_size: int = 0) -> tuple[list[torch.Tensor], KVGeometry]:
    """The layers seen in vLLM's blocks, and their geometry; ValueError if they don't agree.
    `block_size`: vLLM's block size in tokens, what one block id covers (0: the caches' own).
    Where the backend splits blocks into kernel blocks, a page is `ratio` consecutive kernel
    blocks (as vLLM's `group_kernel_blocks` sees them): `[ratio, *kernel page]`."""
    if not layers:
        raise ValueError("no KV cache layers to register")
    first = layers[0]
    spec = resolve_layout(layout_name, first.shape)
    for i, layer in enumerate(layers):
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ValueError(
                f"layer {i} has shape {tuple(layer.shape)} {layer.dtype}, layer 0 has "
                f"{tuple(first.shape)} {first.dtype}: all layers must match"
            )
    if not first.numel():
        raise ValueError(f"the KV cache layers are empty: shape {tuple(first.shape)}")
    kernel_blocks, kernel_tokens = first.shape[spec.block_dim], first.shape[spec.token_dim]
    ratio = 1
    if block_size:
        if block_size < 0 or block_size % kernel_tokens or kernel_blocks % (block_size // kernel_tokens):
            raise ValueError(
                f"vLLM's blocks of {block_size} tokens are not whole groups of this cache's "
                f"{kernel_blocks} kernel blocks of {kernel_tokens} tokens (shape {tuple(first.shape)}, "
                f"layout {spec.name})")
        ratio = block_size // kernel_tokens
    if ratio > 1:
        layers = [layer.unflatten(spec.block_dim, (kernel_blocks // ratio, ratio)) for layer in layers]
    page_shape = tuple(s for d, s in enumerate(layers[0].shape) if d != spec.block_dim)
    return layers, KVGeometry(
        layout=spec,
        dtype=first.dtype,
        num_layers=len(layers),
        num_blocks=kernel_blocks // ratio,
        block_size=kernel_tokens * ratio,
        page_shape=page_shape,
    )
