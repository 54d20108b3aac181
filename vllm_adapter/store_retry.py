"""The worker's stores, from submission until their chunks have landed or are given up.

A store whose chunks did not land for a reason that may pass (NO_SPACE: the daemon's pool is
full of pinned chunks; an overloaded, restarting or slow daemon) is held and sent again; so is
one made while the worker is not registered (the daemon restarting), sent once it is. vLLM
keeps a request's blocks until the worker reports the request's stores done, which is what
makes sending again safe: the blocks of computed chunks do not change meanwhile, and the
daemon only reads them (a chunk that did land meanwhile comes back ALREADY_PRESENT).
`StoreTracker` holds the books and `PendingStore.schedule_retry` the retry policy; the worker
adapter sends.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from lmcache_mp.mq.client import MessagingFuture
from lmcache_mp.protocol import StoreResult
from vllm_adapter.fences import Target
from vllm_adapter.ops import LoadStoreOp

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")

# Sent again after a delay doubling from the first to the last, at most `MAX_STORE_SENDS` times in
# all, within the worker's `store_retry_s`.
STORE_FIRST_RETRY_S = 0.05
STORE_MAX_RETRY_S = 2.0
MAX_STORE_SENDS = 8
# Stores held for another try (or for the daemon's return), at most: the oldest is given up.
MAX_HELD_STORES = 1024


@dataclass
class PendingStore:
    """One request's part of a store, followed until its chunks have landed or are given up."""

    request_id: str
    op: LoadStoreOp  # the chunks still to store
    event: torch.cuda.Event | None  # kept alive: every send hands the daemon its IPC handle
    step: int = 0  # the caller's tag: the connector's scheduler step that planned it
    sends: int = 0
    give_up_at: float = math.inf  # set when first held: the retry window starts then
    next_try: float = 0.0
    dropped: bool = False  # its blocks were freed (preemption): never sent again
    # Registrations a send of it went to without an answer: the daemon may still run that STORE
    # (reading the blocks), so the part is done only once each has confirmed the cancel.
    unanswered: set[Target] = field(default_factory=set)

    def schedule_retry(self, now: float, window_s: float) -> bool:
        """Schedule another send (`next_try`), within `window_s` of when it was first held;
        False if its tries are spent (out of sends or out of time): the caller gives it up."""
        self.give_up_at = min(self.give_up_at, now + window_s)
        if self.sends >= MAX_STORE_SENDS or now >= self.give_up_at:
            return False
        self.next_try = now + min(STORE_FIRST_RETRY_S * 2 ** max(self.sends - 1, 0), STORE_MAX_RETRY_S)
        return True


@dataclass
class StoreBatch:
    """One STORE on the wire and the request parts it carries, in key order."""

    future: MessagingFuture[StoreResult]
    parts: list[PendingStore]
    target: Target | None
    sent_at: float = field(default_factory=time.monotonic)


class StoreTracker:
    """Stores per request: on the wire, or held for another try. A request's stores are done
    when none of its parts is either. Held parts are bounded in number (the oldest goes first)."""

    def __init__(self, max_held: int):
        self._max_held = max_held
        self._in_flight: list[StoreBatch] = []
        self._held: list[PendingStore] = []  # oldest first
        # request id -> step -> its parts of that step on the wire or held
        self._open: dict[str, Counter[int]] = {}

    def add(self, parts: list[PendingStore]) -> None:
        """Follow these parts until `done`; they are then `sent` or `held`."""
        for part in parts:
            self._open.setdefault(part.request_id, Counter())[part.step] += 1

    def sent(self, future: MessagingFuture[StoreResult], parts: list[PendingStore],
             target: Target | None) -> None:
        self._in_flight.append(StoreBatch(future, parts, target))

    def held(self, part: PendingStore) -> list[PendingStore]:
        """Hold a part; returns those pushed out by the bound (the oldest), for the caller to
        give up."""
        self._held.append(part)
        excess = len(self._held) - self._max_held
        if excess <= 0:
            return []
        pushed_out, self._held = self._held[:excess], self._held[excess:]
        return pushed_out

    def done(self, part: PendingStore) -> None:
        steps = self._open[part.request_id]
        steps[part.step] -= 1
        if steps[part.step] <= 0:
            del steps[part.step]
        if not steps:
            del self._open[part.request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._open

    def oldest_step(self, request_id: str) -> int | None:
        """The oldest step tag of the request's parts not done yet (None: all done)."""
        steps = self._open.get(request_id)
        return min(steps) if steps else None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take_completed(self) -> list[StoreBatch]:
        completed, self._in_flight = _partition(self._in_flight, lambda b: b.future.query())
        return completed

    def take_held(self, chosen: Callable[[PendingStore], bool]) -> list[PendingStore]:
        taken, self._held = _partition(self._held, chosen)
        return taken

    def wait(self, request_ids: Iterable[str], timeout_s: float) -> None:
        """Block until the stores of these requests on the wire are done, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        wanted = set(request_ids)
        for batch in self._in_flight:
            if any(p.request_id in wanted for p in batch.parts):
                batch.future.wait(max(0.0, deadline - time.monotonic()))

    def drop(self, request_ids: Iterable[str]) -> list[PendingStore]:
        """These requests' blocks are about to be freed: none of their chunks is sent again.
        Returns their held parts, for the caller to finish."""
        wanted = set(request_ids)
        return self._drop(lambda part: part.request_id in wanted)

    def drop_all(self) -> list[PendingStore]:
        """No chunk of any store is sent again; returns the held parts, for the caller to finish."""
        return self._drop(lambda part: True)

    def _drop(self, chosen: Callable[[PendingStore], bool]) -> list[PendingStore]:
        for batch in self._in_flight:
            for part in batch.parts:
                part.dropped = part.dropped or chosen(part)
        return self.take_held(chosen)


def _partition(items: list[_T], chosen: Callable[[_T], bool]) -> tuple[list[_T], list[_T]]:
    """(the items chosen, the rest), each in order; `chosen` is asked once per item."""
    picked: list[_T] = []
    rest: list[_T] = []
    for item in items:
        (picked if chosen(item) else rest).append(item)
    return picked, rest
