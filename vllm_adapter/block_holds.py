"""Sliding-window blocks kept out of vLLM's free list until the daemon has stored them.

vLLM frees a sliding-window group's blocks as soon as they leave the window (when it schedules
the next step), without asking the connector, and may then give them to another request. A
chunk's blocks are computed over one or more steps and stored asynchronously after the step
that completes it. So the scheduler takes a reference on each sliding-window block it will
store (`BlockPool.touch`) in the step that computes it, before the next step can free it, and
drops that reference (`BlockPool.free_blocks`) once every worker reports the store that read
it done. Blocks of a chunk that is never stored (its request ended or was preempted first) are
dropped at once. Full-attention blocks need none of this: vLLM keeps them until the request
finishes, and the connector delays that until its stores are done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool


@dataclass
class _RequestHolds:
    # (block index in the request, block id) touched, not yet part of a store.
    pending: list[tuple[int, int]] = field(default_factory=list)
    # (scheduler step, block ids) read by the stores of that step, not yet reported done.
    stored: list[tuple[int, list[int]]] = field(default_factory=list)
    # worker rank -> the latest step up to which that worker's stores of this request are done.
    done_through: dict[int, int] = field(default_factory=dict)
    finished: bool = False  # vLLM finished the request: forget it once nothing is held


class BlockHolds:
    def __init__(self, pool: BlockPool, num_workers: int):
        self._pool = pool
        self._num_workers = num_workers
        self._requests: dict[str, _RequestHolds] = {}

    def hold(self, request_id: str, blocks: list[tuple[int, int]]) -> None:
        """Reference these (index, block id) pairs: they will be stored once their chunk is full."""
        if blocks:
            self._pool.touch([self._pool.blocks[block_id] for _, block_id in blocks])
            self._requests.setdefault(request_id, _RequestHolds()).pending.extend(blocks)

    def to_store(self, request_id: str, end_index: int, step: int) -> None:
        """The held blocks before `end_index` are read by the stores planned at `step`."""
        holds = self._requests.get(request_id)
        if holds is None:
            return
        stored = [block_id for index, block_id in holds.pending if index < end_index]
        holds.pending = [(index, block_id) for index, block_id in holds.pending if index >= end_index]
        if stored:
            holds.stored.append((step, stored))

    def drop_pending(self, request_id: str) -> None:
        """Release the blocks no store will read (the request ended, or was preempted)."""
        holds = self._requests.get(request_id)
        if holds is not None and holds.pending:
            self._free([block_id for _, block_id in holds.pending])
            holds.pending = []
        self._forget_if_idle(request_id)

    def finish(self, request_id: str) -> None:
        holds = self._requests.get(request_id)
        if holds is not None:
            holds.finished = True
            self.drop_pending(request_id)

    def stores_done(self, request_id: str, rank: int, step: int) -> None:
        """Worker `rank` has no store of this request in flight up to `step`: once every worker
        says so, the blocks those stores read are released."""
        holds = self._requests.get(request_id)
        if holds is None:
            return
        holds.done_through[rank] = max(step, holds.done_through.get(rank, step))
        if len(holds.done_through) < self._num_workers:
            return
        through = min(holds.done_through.values())
        released = [ids for s, ids in holds.stored if s <= through]
        holds.stored = [(s, ids) for s, ids in holds.stored if s > through]
        self._free([block_id for ids in released for block_id in ids])
        self._forget_if_idle(request_id)

    def _forget_if_idle(self, request_id: str) -> None:
        holds = self._requests.get(request_id)
        if holds is not None and holds.finished and not holds.pending and not holds.stored:
            del self._requests[request_id]

    def _free(self, block_ids: list[int]) -> None:
        if block_ids:
            self._pool.free_blocks(self._pool.blocks[block_id] for block_id in block_ids)
