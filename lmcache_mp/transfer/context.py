"""Copies between a worker's registered KV caches and the daemon's chunk objects.

A chunk object holds `[num_layers, blocks_per_chunk, *page_shape]` elements: for every
layer, the pages of the chunk's blocks in order. Gather (STORE) and scatter (RETRIEVE) are
indexed torch copies, on whatever device the caches live. When every layer is a view of one
allocation at a constant distance (vLLM 0.32 allocates one buffer for all layers, on CPU and GPU)
they are one strided `[layers, blocks, *page]` view, and a chunk is one copy call for all layers,
not one per layer: each call costs microseconds of Python and dispatch under the daemon's one
GIL, which 80 layers of 16 KiB pages turn into the larger part of a chunk's copy. The CPU and
CUDA paths share this code; only the stream and event handling is CUDA's own (`transfer/cuda.py`).

Caches on a device other than the pool's (CUDA caches, pinned host pool) are *staged*: a
preallocated device buffer of one chunk (a staging slot) holds the gathered pages before the one
DMA down, and the chunk after the one DMA up. A context has two lanes, each with its own two
slots, copy streams (the load lane's of high priority) and lock: loads (RETRIEVE: vLLM's forward
pass waits for them) and stores (STORE, which may copy a long prefill's chunks), so that a load
never queues behind a store. A lane's chunks take its slots in turn, so one chunk's DMA overlaps
the next one's gather or scatter (`cuda.CopyStream` orders each slot's uses); a lane's operations
take turns, while the other lane and other ranks' contexts copy at the same time. The daemon's
device memory is taken from vLLM's headroom, so it is bounded by those four chunks (allocated at
registration, where running out is a clear refusal) and a request's block-id tensor; nothing else
is allocated per copy.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from lmcache_mp.transfer.cuda import STAGING_SLOTS, CopyStream
from lmcache_mp.transfer.layouts import KVGeometry


def kept_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """The `[start, end)` runs of positions whose block id is not -1 (-1: leave that block alone)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, block in enumerate([*block_ids, -1]):
        if block >= 0 and start is None:
            start = i
        elif block < 0 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def consecutive_runs(block_ids: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """`[start, end)` cut into `(position, count)` runs of consecutive block ids (b, b+1, ...):
    each run's pages are one slice of every layer, so one copy each."""
    runs: list[tuple[int, int]] = []
    for i in range(start, end):
        if runs and block_ids[i] == block_ids[i - 1] + 1:
            position, count = runs[-1]
            runs[-1] = (position, count + 1)
        else:
            runs.append((i, 1))
    return runs


def non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether no two indices of a strided view name the same element: with its dimensions sorted
    by stride (those of size 1 name one element whatever their stride), each stride steps past all
    that the smaller ones reach. Sufficient, and true of every layout vLLM makes, layers outermost
    (LBNHC, LBHNC: a layer's stride is its whole span) or interleaved within each block (block
    outermost: the layer stride is one page, smaller than a layer's span, yet nothing overlaps)."""
    reach = 0  # the largest offset the dimensions so far reach
    dims = [(size, stride) for size, stride in zip(shape, strides, strict=True) if size > 1]
    for size, stride in sorted(dims, key=lambda dim: dim[1]):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _stacked(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The block-major layer views as one `[layers, blocks, *page]` view, when they are equal
    views of one storage at a constant distance that overlap nowhere (vLLM's caches: one
    allocation for all layers); else None. A chunk's pages of every layer are then one call."""
    first = views[0]
    if len(views) < 2 or any(v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                             or v.shape != first.shape or v.stride() != first.stride()
                             or v.dtype != first.dtype for v in views):
        return None
    offset, step = first.storage_offset(), views[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(v.storage_offset() != offset + n * step for n, v in enumerate(views)):
        return None
    shape, strides = (len(views), *first.shape), (step, *first.stride())
    if not non_overlapping(shape, strides):
        return None
    return first.as_strided(shape, strides, offset)


def as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors' bytes seen as 8-byte words, when every one of them allows it (innermost
    dimension contiguous, sizes, strides and offset whole words); else the tensors as they are.
    An indexed copy costs per element, not per byte: 2-byte bf16 elements ran a GPU gather at
    a fifth of a plain copy's speed (H100, `scripts/gpu/copy_probe.py`)."""
    try:
        return tuple(t if t.dtype.itemsize == 8 else t.view(torch.int64) for t in tensors)
    except RuntimeError:  # torch: "... must be divisible ..." / "... stride 1 ..."
        return tensors


def _with_words(cache: torch.Tensor, cache_words: torch.Tensor,
                chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`as_words(cache, chunk)`, given `cache`'s own `as_words` (made once, at registration)."""
    if cache_words.dtype.itemsize == 8:
        (chunk_words,) = as_words(chunk)
        if chunk_words.dtype.itemsize == 8:
            return cache_words, chunk_words
    return cache, chunk


class Lane(enum.Enum):
    """Which of a staged context's lanes an operation copies in (see the module docstring)."""

    STORE = "store"
    LOAD = "load"


class _Lane:
    """A staged context's lane: its staging slots, its copy streams (CUDA caches only) and the
    lock its operations take turns by."""

    def __init__(self, slots: list[torch.Tensor], stream: CopyStream | None):
        self.slots = slots
        self.stream = stream
        self.turn = threading.Lock()


class TransferContext:
    def __init__(self, layers: list[torch.Tensor], geometry: KVGeometry, chunk_size: int, *,
                 staged: bool | None = None):
        """`staged`: copy through a staging buffer on the caches' device (the default for caches
        off the CPU; the CPU tests set it to run the staged path's every line but the DMA's)."""
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
        self._all_layers = _stacked(self._views)
        # The same, as 8-byte words where they allow it (`as_words`, for the indexed copies).
        self._view_words = [as_words(view)[0] for view in self._views]
        self._all_layer_words = None if self._all_layers is None else as_words(self._all_layers)[0]
        self.device = layers[0].device
        self._lanes: dict[Lane, _Lane] = {}  # none: unstaged
        if self.device.type != "cpu" if staged is None else staged:
            for lane in Lane:
                # Raises torch.OutOfMemoryError when the device has no room: the registration is refused.
                slots = [torch.empty((geometry.num_layers, self.blocks_per_chunk, *geometry.page_shape),
                                     dtype=geometry.dtype, device=self.device) for _ in range(STAGING_SLOTS)]
                stream = (CopyStream(self.device, urgent=lane is Lane.LOAD) if self.device.type == "cuda"
                          else None)
                self._lanes[lane] = _Lane(slots, stream)

    @property
    def staging_nbytes(self) -> int:
        return sum(slot.nbytes for lane in self._lanes.values() for slot in lane.slots)

    def check_block_ids(self, block_ids: list[int], chunk_blocks: list[int] | None, num_chunks: int,
                        allow_skip: bool = False) -> None:
        """Each chunk takes `blocks_per_chunk` ids, or its count in `chunk_blocks` (None: all
        whole; a short chunk is a request's tail, `tails.py`); ids past the last chunk are ignored.
        With `allow_skip`, an id of -1 means "leave this block alone" (RETRIEVE into a block the
        engine already holds)."""
        needed = num_chunks * self.blocks_per_chunk if chunk_blocks is None else sum(chunk_blocks)
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

    @contextmanager
    def operation(self, block_ids: list[int], event_handle: bytes, lane: Lane,
                  chunk_blocks: list[int] | None = None) -> Iterator[Copies]:
        """One STORE's (`Lane.STORE`) or RETRIEVE's (`Lane.LOAD`) copies (`chunk_blocks`: each
        chunk's blocks, None when all are whole), after the work the
        worker's event marks (its IPC handle; b'' for none). Every copy is complete when the block
        exits, also when it exits by an exception, so that the chunk objects can be handed on or
        freed."""
        if event_handle and self.device.type != "cuda":
            raise ValueError("an event handle was sent for a CPU cache; send b'' on CPU")
        own = self._lanes.get(lane)
        if own is None:  # unstaged: nothing shared between operations, they run side by side
            yield Copies(self, block_ids, chunk_blocks, None, None)
            return
        with own.turn:
            if own.stream is None:
                yield Copies(self, block_ids, chunk_blocks, own, None)
                return
            with own.stream.ordered():
                # Uploaded before the wait: an upload from pageable memory waits for the stream.
                device_ids = self._ids(block_ids)
                own.stream.wait_for(event_handle)
                yield Copies(self, block_ids, chunk_blocks, own, device_ids)

    def write_pages(self, chunk: torch.Tensor, position: int, block: int, count: int) -> None:
        """Copy pages `[position, position + count)` of `chunk` (a `chunk_view`) into blocks
        `[block, block + count)` of every layer, in one copy when the layers are one allocation."""
        if self._all_layers is not None:
            # The whole chunk needs no slice of it (one torch call fewer: each costs microseconds).
            pages = chunk if position == 0 and count == chunk.shape[1] else chunk.narrow(1, position, count)
            self._all_layers.narrow(1, block, count).copy_(pages)
            return
        for layer, view in enumerate(self._views):
            view[block:block + count].copy_(chunk[layer, position:position + count])

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        # The op's block ids, uploaded once (the -1s too: runs of real ids are sliced out of it).
        return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)


class Copies:
    """The copies of one operation, chunk by chunk: `gather` for a STORE, `scatter` for a RETRIEVE.
    Chunk `i` of the operation takes block ids `[i * blocks_per_chunk, (i + 1) * blocks_per_chunk)`
    when all are whole; with `chunk_blocks`, the next `chunk_blocks[i]` ids (a short chunk fills the
    first pages of its object)."""

    def __init__(self, context: TransferContext, block_ids: list[int], chunk_blocks: list[int] | None,
                 lane: _Lane | None, device_ids: torch.Tensor | None):
        self._ctx = context
        self._block_ids = block_ids
        self._starts = None if chunk_blocks is None else list(itertools.accumulate(chunk_blocks, initial=0))
        self._lane = lane  # when staged
        self._id_tensor = device_ids  # the block ids on the caches' device (made at first use on CPU)

    @property
    def splittable(self) -> bool:
        """Whether chunks may be copied from several threads at once: yes, unless they go
        through the lane's staging slots (caches on a device, copied in stream order)."""
        return self._lane is None

    def _slot(self, i: int) -> tuple[int, torch.Tensor]:
        """Chunk `i`'s staging slot: the lane's slots in turn."""
        assert self._lane is not None
        slot = i % len(self._lane.slots)
        return slot, self._lane.slots[slot]

    def _use(self, slot: int, *, writes: bool, transfer: bool) -> AbstractContextManager[None]:
        """The block's work writes or reads staging slot `slot`, on the lane's transfer stream (a
        DMA) or its main one, in order with the slot's other uses (`CopyStream.writing`,
        `reading`); without streams (the CPU), in program order."""
        stream = self._lane.stream if self._lane is not None else None
        if stream is None:
            return nullcontext()
        return (stream.writing if writes else stream.reading)(slot, transfer=transfer)

    def _span(self, i: int) -> tuple[int, list[int]]:
        if self._starts is None:
            bpc = self._ctx.blocks_per_chunk
            return i * bpc, self._block_ids[i * bpc:(i + 1) * bpc]
        return self._starts[i], self._block_ids[self._starts[i]:self._starts[i + 1]]

    def _index(self, first: int, start: int, end: int) -> torch.Tensor:
        """Block ids `[first + start, first + end)` of the operation, as an index tensor: a slice
        of the operation's ids, made into one tensor at the first chunk that needs it (each tensor
        made from a list costs several times a slice of one)."""
        if self._id_tensor is None:
            self._id_tensor = self._ctx._ids(self._block_ids)
        return self._id_tensor[first + start:first + end]

    def gather(self, i: int, chunk: torch.Tensor) -> None:
        """Copy the pages of chunk `i`'s blocks, from every layer, into `chunk`."""
        ctx = self._ctx
        first, ids = self._span(i)
        index = self._index(first, 0, len(ids))
        if len(ids) < ctx.blocks_per_chunk:  # a short chunk: its pages only
            chunk = chunk[:, :len(ids)]
        if self._lane is None:
            self._gather_into(index, chunk)
            return
        slot, staging = self._slot(i)
        staging = staging[:, :len(ids)]
        with self._use(slot, writes=True, transfer=False):
            self._gather_into(index, staging)
        with self._use(slot, writes=False, transfer=True):
            chunk.copy_(staging, non_blocking=True)  # one DMA down into the (pinned) object

    def _gather_into(self, index: torch.Tensor, out: torch.Tensor) -> None:
        ctx = self._ctx
        if ctx._all_layers is not None:
            assert ctx._all_layer_words is not None
            source, target = _with_words(ctx._all_layers, ctx._all_layer_words, out)
            torch.index_select(source, 1, index, out=target)  # every layer in one call
        else:
            for view, words, layer_out in zip(ctx._views, ctx._view_words, out, strict=True):
                source, target = _with_words(view, words, layer_out)
                torch.index_select(source, 0, index, out=target)

    def scatter(self, chunk: torch.Tensor, i: int) -> None:
        """Copy `chunk` into the pages of chunk `i`'s blocks of every layer; -1 ids are skipped."""
        ctx = self._ctx
        first, ids = self._span(i)
        runs = kept_runs(ids)
        if self._lane is None:
            # One copy_ per run of consecutive pages (of all layers at once, when they are one
            # allocation): slices copy 2.2-2.4x faster than index_copy_ on CPU (measured 15.6-17.4
            # vs 7.0-7.2 GB/s for 128-512 KiB bf16 pages, one thread), and fewer, larger copies
            # save torch's per-call cost (a few microseconds each).
            for start, end in runs:
                for position, count in consecutive_runs(ids, start, end):
                    ctx.write_pages(chunk, position, ids[position], count)
            return
        if not runs:
            return
        slot, staging = self._slot(i)
        # One DMA up of the whole chunk, pinned to device, skipped pages included (they are only
        # staged, never written): a compacted copy would be a pageable, synchronous one.
        with self._use(slot, writes=True, transfer=True):
            staging.copy_(chunk, non_blocking=True)
        with self._use(slot, writes=False, transfer=False):
            for start, end in runs:
                index = self._index(first, start, end)
                if ctx._all_layers is not None:
                    assert ctx._all_layer_words is not None
                    target, source = _with_words(ctx._all_layers, ctx._all_layer_words, staging[:, start:end])
                    target.index_copy_(1, index, source)  # every layer in one call
                else:
                    for layer, (view, words) in enumerate(zip(ctx._views, ctx._view_words, strict=True)):
                        target, source = _with_words(view, words, staging[layer, start:end])
                        target.index_copy_(0, index, source)
