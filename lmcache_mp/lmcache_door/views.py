"""LMCache's layer views turned back into vLLM's: which dimension counts a block's tokens.

vLLM 0.32 hands a connector each layer as a logical `[blocks, heads, tokens, C]` view. LMCache's
worker reorders a view's dimensions by stride before sending it, wherever that makes it contiguous
(on CPU and on CUDA alike), so a layer in vLLM's physical order "a block's tokens, then their heads"
(LMCache's `kv_layout` "NHD") arrives as `[blocks, tokens, heads, C]`. Which of dimensions 1 and 2
counts tokens follows from the registration's `kv_layout` and the strides: under NHD the tokens
are the outer of the two (larger stride), under HND the inner. `logical_view` turns the view back
so that tokens are dimension 2, as the daemon's geometry (`transfer/layouts.py`) expects.

Without a `kv_layout` (vLLM always sends one; other clients may not) the sizes decide, and only
where they cannot be wrong: a dimension of vLLM's block size. A page is a block's every element, in
either order, so the guess matters only where blocks are split into kernel blocks, which is then
refused (a wrong guess would group kernel blocks wrongly: wrong KV).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch import here: the door answers before the engine is built
    import torch

# Tokens are the outer of a block's two middle dimensions under these layouts, the inner under the others.
_TOKENS_OUTER = frozenset({"NHD", "BLNHC"})


def token_dim(shape: tuple[int, ...], stride: tuple[int, ...], kv_layout: str | None, block_size: int) -> int:
    """Which of a 4-D block-outermost view's dimensions 1 and 2 counts a block's tokens."""
    if len(shape) != 4:
        raise ValueError(f"a {len(shape)}-D cache of shape {shape}: vLLM's caches are 4-D [blocks, heads, "
                         "tokens, C] views")
    if kv_layout is None:
        for dim in (2, 1):
            if shape[dim] == block_size:
                return dim
        raise ValueError(f"the registration names no kv_layout, and no dimension of shape {shape} is vLLM's "
                         f"block of {block_size} tokens: which one counts tokens is unknown")
    if 1 in (shape[1], shape[2]) and shape[1] != shape[2]:
        return 1 if shape[2] == 1 else 2  # one head (MLA's latent): the other dimension
    outer = 1 if stride[1] > stride[2] else 2
    return outer if kv_layout in _TOKENS_OUTER else 3 - outer


def logical_view(layer: torch.Tensor, kv_layout: str | None, block_size: int) -> torch.Tensor:
    """`layer` as `[blocks, heads, tokens, C]` (a view: no copy)."""
    dim = token_dim(tuple(layer.shape), tuple(layer.stride()), kv_layout, block_size)
    return layer if dim == 2 else layer.transpose(1, 2)


def layout_name(prefix: str, kv_layout: str | None) -> str:
    """A door registration's layout name (part of every chunk's format): its kind of cache and the
    physical order LMCache names, so that chunks of one never load into the other."""
    return prefix + (f"_{kv_layout}" if kv_layout else "")
