"""Copies between a worker's registered KV caches and the daemon's chunk objects.

A chunk object holds `[num_layers, blocks_per_chunk, *page_shape]` elements: for every
layer, the pages of the chunk's blocks in order. Gather (STORE) and scatter (RETRIEVE)
are one indexed torch copy per layer, on whatever device the caches live; the CPU and
CUDA paths share this code, and only the stream/event handling differs (transfer/cuda.py).
"""

from __future__ import annotations

import torch

from lmcache_mp.transfer.layouts import KVGeometry


class TransferContext:
    def __init__(self, layers: list[torch.Tensor], geometry: KVGeometry, chunk_size: int):
        if chunk_size % geometry.block_size:
            raise ValueError(
                f"the daemon's chunk size {chunk_size} is not a multiple of the KV block size "
                f"{geometry.block_size}; restart the daemon with --chunk-size a multiple of it"
            )
        self.geometry = geometry
        self.blocks_per_chunk = chunk_size // geometry.block_size
        self.chunk_nbytes = geometry.chunk_nbytes(self.blocks_per_chunk)
        # Block-major views: view[b] is block b's page of that layer (no copy).
        self._views = [layer.movedim(geometry.layout.block_dim, 0) for layer in layers]
        self.device = layers[0].device

    def check_block_ids(self, block_ids: list[int], num_chunks: int, allow_skip: bool = False) -> None:
        """Each chunk takes `blocks_per_chunk` ids; ids past the last full chunk are ignored.
        With `allow_skip`, an id of -1 means "leave this block alone" (RETRIEVE into a
        block the engine already holds)."""
        needed = num_chunks * self.blocks_per_chunk
        if len(block_ids) < needed:
            raise ValueError(f"{num_chunks} chunks need {needed} block ids, got {len(block_ids)}")
        low = -1 if allow_skip else 0
        bad = [b for b in block_ids[:needed] if not low <= b < self.geometry.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {self.geometry.num_blocks}): {bad[:8]}")

    def chunk_view(self, data: torch.Tensor) -> torch.Tensor:
        """A pool object's raw bytes seen as `[layers, blocks_per_chunk, *page_shape]`."""
        g = self.geometry
        return data.view(g.dtype).view(g.num_layers, self.blocks_per_chunk, *g.page_shape)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: list[int], chunk: torch.Tensor) -> None:
        """Copy the pages of `block_ids` (one chunk) from every layer into `chunk`."""
        ids = self._ids(block_ids)
        same_device = chunk.device == self.device
        for layer, view in enumerate(self._views):
            if same_device:
                torch.index_select(view, 0, ids, out=chunk[layer])
            else:  # device cache -> pinned host object: gather on the device, one DMA down
                chunk[layer].copy_(view.index_select(0, ids), non_blocking=True)

    def scatter(self, chunk: torch.Tensor, block_ids: list[int]) -> None:
        """Copy `chunk` into the pages of `block_ids` of every layer; -1 ids are skipped."""
        keep = [i for i, b in enumerate(block_ids) if b >= 0]
        if len(keep) < len(block_ids):
            chunk = chunk[:, keep]
            block_ids = [block_ids[i] for i in keep]
        if not block_ids:
            return
        if chunk.device == self.device:
            # One copy_ per page: 2.2-2.4x faster than index_copy_ on CPU (measured 15.6-17.4
            # vs 7.0-7.2 GB/s for 128-512 KiB bf16 pages, one thread).
            for layer, view in enumerate(self._views):
                pages = chunk[layer]
                for i, block in enumerate(block_ids):
                    view[block].copy_(pages[i])
            return
        ids = self._ids(block_ids)  # host object -> device cache: one upload, then a device kernel
        for layer, view in enumerate(self._views):
            view.index_copy_(0, ids, chunk[layer].to(self.device, non_blocking=True))
