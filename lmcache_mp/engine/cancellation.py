"""CANCEL_TRANSFERS: which STOREs and RETRIEVEs are copying, and which a worker has given up on.

A worker whose STORE or RETRIEVE got no reply in time must not let vLLM reuse its blocks while
that operation may still run here (queued behind other work, or copying while the daemon was
slow or stopped): a late RETRIEVE would write into blocks that belong to another request by
then, and a late STORE would publish that request's KV under this one's keys. So before it
reports the operation failed the worker sends CANCEL_TRANSFERS, and the reply means: no STORE or
RETRIEVE of those requests touches that instance's blocks any more.

`TransferFence` keeps the two facts that answer needs, per (instance id, request id):
- how many STOREs and RETRIEVEs are copying (`begin`/`end` around each, a STORE's commit
  included); a CANCEL that finds some is answered only once they have stopped (they check
  `cancelled` between chunks);
- which pairs were cancelled, and when, so that an operation sent before the CANCEL and still
  queued refuses to start (`begin`). "Before" is the order in which the server read them
  (`dispatch.ARRIVAL`): operations sent after the CANCEL, such as the STORE of what vLLM
  recomputed after a cancelled load, run as usual.
  The server refuses any request that waited in its queue longer than the queue deadline, and
  a worker's requests reach the daemon in order, so every operation sent before a CANCEL was
  queued before it and starts within the deadline, or never: an entry is forgotten after twice
  the deadline plus a second, and never earlier. A confirmed cancel is a promise the worker acts
  on (it hands the blocks back to vLLM), so the record is bounded by refusing new cancels when
  it is full (OVERLOADED: the worker keeps its blocks and asks again), never by forgetting old
  ones: per instance (a worker cancels at most what it had in flight) and in all. Each
  registered instance has a reserve that only it may fill; past its reserve it draws on a
  shared part, so one client, whatever number of instances it registers, can fill the shared
  part but never keeps another instance from cancelling what a worker has in flight.
  Only the registered instance's own connection may cancel its transfers (the engine checks);
  a CANCEL for an instance that is not registered records nothing, as none of its operations can
  start any more (each looks its registration up first, and again once `begin` has let it in),
  and only waits for copies still running. For the same reason an instance's cancels are
  forgotten once it is dropped (`forget_instance`): the record holds registered instances' only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future

from lmcache_mp.engine.dispatch import ARRIVAL
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode

logger = logging.getLogger(__name__)

Pair = tuple[int, str]  # (instance id, request id)

# Beyond the queue deadline: an operation that passed the server's deadline check just in time
# may still be on its way to `begin` (a descheduled thread); another deadline and this margin
# cover it generously.
KEEP_MARGIN_S = 1.0
# The shared part of the record: the pairs kept beyond each instance's reserve, all instances
# together.
DEFAULT_MAX_CANCELLED = 65_536
# Per instance: a worker cancels what it had in flight (vLLM's running requests), re-sending the
# same pairs until answered; far below this.
DEFAULT_MAX_CANCELLED_PER_INSTANCE = 8_192
# Per registered instance, kept for it alone: vLLM's default batch of running requests (256),
# so a worker can always cancel the transfers of a whole batch (~64 KiB per registration).
DEFAULT_RESERVE_PER_INSTANCE = 256
# CANCELs waiting for copies to stop (each a deferred reply); more are refused OVERLOADED.
DEFAULT_MAX_WAITERS = 4_096


class TransferFence:
    def __init__(self, queue_deadline_s: float, max_cancelled: int = DEFAULT_MAX_CANCELLED,
                 max_waiters: int = DEFAULT_MAX_WAITERS,
                 max_per_instance: int = DEFAULT_MAX_CANCELLED_PER_INSTANCE,
                 reserve_per_instance: int = DEFAULT_RESERVE_PER_INSTANCE):
        """`max_cancelled`: the shared part of the record (beyond each instance's reserve)."""
        self._keep_s = 2 * queue_deadline_s + KEEP_MARGIN_S
        self._max_shared = max_cancelled
        self._max_per_instance = max_per_instance
        self._reserve = reserve_per_instance
        self._of_instance: dict[int, set[str]] = {}  # instance id -> its request ids in `_cancelled`
        self._shared = 0  # pairs kept beyond their instance's reserve
        self._max_waiters = max_waiters
        self._copying: dict[Pair, int] = {}
        # pair -> (when it is forgotten, the CANCEL's ARRIVAL), oldest first
        self._cancelled: OrderedDict[Pair, tuple[float, int]] = OrderedDict()
        # (pairs still copying, the CANCEL's reply, its value): completed when `pairs` is empty.
        self._waiters: list[tuple[set[Pair], Future[int], int]] = []
        self._lock = threading.Lock()

    def begin(self, pairs: Iterable[Pair]) -> bool:
        """Count an operation on these pairs as copying; False (nothing counted) if any was cancelled."""
        pairs = set(pairs)
        with self._lock:
            self._forget_expired(time.monotonic())
            if self._cancelled_locked(pairs):
                return False
            for pair in pairs:
                self._copying[pair] = self._copying.get(pair, 0) + 1
        return True

    def cancelled(self, pairs: Iterable[Pair]) -> bool:
        if not self._cancelled:
            # Nothing cancelled: no lock (a copy asks between every two chunks). A CANCEL recorded
            # just after this read is one that arrived after the check, as it would be with the lock.
            return False
        with self._lock:
            return self._cancelled_locked(pairs)

    def _cancelled_locked(self, pairs: Iterable[Pair]) -> bool:
        """Whether a CANCEL of any of these pairs arrived after the operation being handled."""
        arrival = ARRIVAL.get()
        return any(self._cancelled.get(pair, (0.0, 0))[1] > arrival for pair in pairs)

    def end(self, pairs: Iterable[Pair]) -> None:
        """An operation counted by `begin` is done with the blocks; answer the CANCELs it held up."""
        done: list[tuple[Future[int], int]] = []
        with self._lock:
            for pair in set(pairs):
                left = self._copying[pair] - 1
                if left:
                    self._copying[pair] = left
                    continue
                del self._copying[pair]
                for waiting, _, _ in self._waiters:
                    waiting.discard(pair)
            done = [(reply, value) for waiting, reply, value in self._waiters if not waiting]
            self._waiters = [w for w in self._waiters if w[0]]
        for reply, value in done:
            reply.set_result(value)

    def cancel(self, instance_id: int, request_ids: list[str], *, record: bool = True) -> int | Future[int]:
        """Record the cancellation (unless `record` is False: the instance is not registered);
        the number of requests with a copy running, as a Future that completes once those
        copies have stopped (at once, as an int, when none runs). OVERLOADED, with nothing
        recorded, when the record or the waiters are full."""
        pairs = {(instance_id, request_id) for request_id in request_ids}
        now = time.monotonic()
        with self._lock:
            self._forget_expired(now)
            copying = {pair for pair in pairs if pair in self._copying}
            if copying and len(self._waiters) >= self._max_waiters:
                raise ServerError(ErrorCode.OVERLOADED, f"{self._max_waiters} CANCEL_TRANSFERS requests "
                                                        "already wait for copies to stop; retry")
            if record:
                self._record_locked(instance_id, pairs, now)
            if not copying:
                return 0
            reply: Future[int] = Future()
            self._waiters.append((copying, reply, len(copying)))
        return reply

    def _record_locked(self, instance_id: int, pairs: set[Pair], now: float) -> None:
        new = [pair for pair in pairs if pair not in self._cancelled]
        mine = len(self._of_instance.get(instance_id, ()))
        shared = self._beyond_reserve(mine + len(new)) - self._beyond_reserve(mine)
        if mine + len(new) > self._max_per_instance or self._shared + shared > self._max_shared:
            logger.warning("refused a CANCEL_TRANSFERS of %d requests for instance %d: the cancelled-"
                           "transfer record is full (%d of %d for the instance, its first %d its own; "
                           "%d of %d shared beyond those)", len(pairs), instance_id, mine,
                           self._max_per_instance, self._reserve, self._shared, self._max_shared)
            raise ServerError(ErrorCode.OVERLOADED,
                              f"the cancelled-transfer record is full ({mine} cancelled requests of "
                              f"instance {instance_id} kept, its first {self._reserve} in a reserve of its "
                              f"own, {len(self._cancelled)} in all, for {self._keep_s:.0f} s each); "
                              "nothing recorded: retry later")
        entry = (now + self._keep_s, ARRIVAL.get())
        for pair in pairs:
            self._cancelled[pair] = entry
            self._cancelled.move_to_end(pair)
        if new:
            self._of_instance.setdefault(instance_id, set()).update(request_id for _, request_id in new)
            self._shared += shared

    def _beyond_reserve(self, count: int) -> int:
        """Of an instance's `count` pairs, those kept in the shared part."""
        return max(0, count - self._reserve)

    def forget_instance(self, instance_id: int) -> None:
        """The instance was dropped: its cancels are of no more use (none of its operations starts
        once it is gone; the engine checks after `begin`), and it holds no reserve any more."""
        with self._lock:
            request_ids = self._of_instance.pop(instance_id, set())
            for request_id in request_ids:
                del self._cancelled[instance_id, request_id]
            self._shared -= self._beyond_reserve(len(request_ids))

    def counts(self) -> tuple[int, int]:
        """(pairs copying, pairs remembered as cancelled)."""
        with self._lock:
            self._forget_expired(time.monotonic())
            return len(self._copying), len(self._cancelled)

    def _forget_expired(self, now: float) -> None:
        while self._cancelled and next(iter(self._cancelled.values()))[0] <= now:
            (instance_id, request_id), _ = self._cancelled.popitem(last=False)
            mine = self._of_instance[instance_id]
            self._shared -= self._beyond_reserve(len(mine)) - self._beyond_reserve(len(mine) - 1)
            mine.discard(request_id)
            if not mine:
                del self._of_instance[instance_id]
