"""KV cache layouts: where a block lives in each registered layer tensor, and chunk formats.

The daemon moves whole blocks ("pages"): for every layer, the slice of the layer tensor
that belongs to one block id. Which dimension indexes blocks, and which one counts the
tokens of a block, depends on the attention backend. The shape alone cannot tell vLLM
0.32's CPU layout (K rows then V rows per head) from its FlashAttention layout (K|V per
token): both are `[num_blocks, heads, block_size, 2*head_size]`. So the worker sends the
backend name, and the name becomes part of every stored chunk's format (and fingerprint): bytes
stored under one layout are never read back into another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_mp.storage.base import ChunkFormat
from lmcache_mp.transfer.dtypes import dtype_to_str


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    ndim: int
    block_dim: int  # the dimension that indexes blocks
    token_dim: int  # the dimension that counts the tokens of one block (the block size)


# (vLLM backend name, tensor rank) -> layout. vLLM reused backend names across layout changes.
_BY_NAME: dict[tuple[str, int], LayoutSpec] = {
    # [num_blocks, kv_heads, block_size, 2*head_size]: per (block, head) K rows then V rows.
    ("CPU_ATTN", 4): LayoutSpec("CPU_ATTN", 4, block_dim=0, token_dim=2),
    # vLLM 0.32 GPU backends: the same shape, K and V side by side in the last axis per token.
    ("FLASH_ATTN", 4): LayoutSpec("FLASH_ATTN", 4, block_dim=0, token_dim=2),
    ("FLASHINFER", 4): LayoutSpec("FLASHINFER", 4, block_dim=0, token_dim=2),
    # Older FlashAttention: [2, num_blocks, block_size, kv_heads, head_size] (K plane, V plane).
    ("FLASH_ATTN", 5): LayoutSpec("FLASH_ATTN/KV_PLANES", 5, block_dim=1, token_dim=2),
    # Older FlashInfer: [num_blocks, 2, block_size, kv_heads, head_size].
    ("FLASHINFER", 5): LayoutSpec("FLASHINFER/KV_PAIRS", 5, block_dim=0, token_dim=2),
}
# Multi-head latent attention: [num_blocks, block_size, latent_dim], one row per token.
_MLA = LayoutSpec("MLA", 3, block_dim=0, token_dim=1)


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
    if "MLA" in upper:
        spec = _MLA
    else:
        spec = _BY_NAME.get((upper, len(shape)))  # type: ignore[assignment]
        if spec is None:
            known = sorted({n for n, _ in _BY_NAME} | {"*MLA*"})
            raise ValueError(
                f"unsupported KV layout {name!r} with a {len(shape)}-D cache of shape {tuple(shape)}; "
                f"known backends: {', '.join(known)}"
            )
    if len(shape) != spec.ndim:
        raise ValueError(f"layout {name!r} expects {spec.ndim}-D caches, got shape {tuple(shape)}")
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

    def chunk_format(self, model_name: str, world_size: int, worker_id: int,
                     chunk_tokens: int) -> ChunkFormat:
        """What a chunk stored from these caches is; its fingerprint keys the chunk in every tier."""
        return ChunkFormat(model_name, world_size, worker_id, self.layout.name,
                           dtype_to_str(self.dtype), self.num_layers, self.page_shape, chunk_tokens)


def describe_caches(layers: list[torch.Tensor], layout_name: str) -> KVGeometry:
    """Check that all layers agree and derive the geometry, or raise ValueError."""
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
    page_shape = tuple(s for d, s in enumerate(first.shape) if d != spec.block_dim)
    return KVGeometry(
        layout=spec,
        dtype=first.dtype,
        num_layers=len(layers),
        num_blocks=first.shape[spec.block_dim],
        block_size=first.shape[spec.token_dim],
        page_shape=page_shape,
    )
