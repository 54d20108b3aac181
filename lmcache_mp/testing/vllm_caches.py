"""KV caches allocated the way vLLM 0.32 allocates them on a GPU, on any device (pure torch).

vLLM 0.32 (`vllm.v1.worker.utils.allocate_kv_cache`, `vllm.v1.kv_cache_interface.
create_kv_cache_views`) makes one int8 buffer for every layer and hands the connector, per
layer, a 4-D logical `[blocks, heads, block_size, C]` view of it: `torch.as_strided` of the
buffer at the layer's byte offset, then `.view(dtype)`. The physical order of the logical axes
`[L, B, H, N, C]` is the resolved `KVCacheLayout`:

- "LBNHC", vLLM's default on an H100 (FlashAttention states no preference): the per-layer views
  are not contiguous (a block's tokens, then its heads);
- "LBHNC": contiguous per-layer views.

C is `2 * head_size` (K and V side by side) for attention, `head_size` for MLA, whose cache has
one latent head (`[blocks, 1, block_size, latent]`). Where the backend's kernel block size is
smaller than vLLM's block size, dim 0 counts `num_blocks * ratio` kernel blocks and dim 2 the
kernel block's tokens. `tests/vllm/test_vllm_gpu_layouts.py` checks every shape, stride, offset and
dtype made here against vLLM's own functions; `scripts/gpu/selftest.py` can use this without vLLM.
"""

from __future__ import annotations

import torch

# The physical (memory) order of the logical axes L, B, H, N, C (vLLM's `KVCacheLayout` values).
LAYOUTS: dict[str, tuple[int, ...]] = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def allocate_like_vllm(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                       dtype: torch.dtype, layout: str = "LBNHC", mla: bool = False,
                       kernel_block_size: int | None = None,
                       device: str | torch.device = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The zeroed int8 buffer and, by layer name in layer order, each layer's `dtype` view.

    `num_blocks` and `block_size` are vLLM's (what a block id names); `kernel_block_size` (a
    divisor of `block_size`) splits each block into that many tokens' kernel blocks. With `mla`,
    `num_kv_heads` is ignored (one latent head) and `head_size` is the latent size (576 for
    DeepSeek)."""
    kernel = kernel_block_size or block_size
    if block_size % kernel:
        raise ValueError(f"kernel block size {kernel} does not divide block size {block_size}")
    heads, content = (1, head_size) if mla else (num_kv_heads, 2 * head_size)
    # The logical [L, B, H, N, C] shape, C in bytes, as vLLM plans it.
    shape = (num_layers, num_blocks * (block_size // kernel), heads, kernel, content * dtype.itemsize)
    strides = [0] * 5
    step = 1
    for axis in reversed(LAYOUTS[layout]):  # innermost physical axis first
        strides[axis] = step
        step *= shape[axis]
    buffer = torch.zeros(step, dtype=torch.int8, device=device)
    layers = torch.as_strided(buffer, shape, strides, buffer.storage_offset())
    return buffer, {layer_name(i): layers[i].view(dtype) for i in range(num_layers)}


def block_pages(layer: torch.Tensor, block_ids: list[int], ratio: int = 1) -> torch.Tensor:
    """The pages of vLLM's blocks `block_ids` in one layer's view (dim 0 counts kernel blocks,
    `ratio` per block), stacked: `[len(block_ids), ratio, *kernel page]`."""
    return torch.stack([layer[b * ratio:(b + 1) * ratio] for b in block_ids])
