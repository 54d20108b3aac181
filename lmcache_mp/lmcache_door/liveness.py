"""The registrations made through the lmcache door, their ranks, and when their workers are gone.

LMCache's registration does not say which rank of its world a worker is; its keys do (`worker_id`).
A one-rank worker's caches are registered with the engine at once (`rank_binder`); a worker of a
larger world's when its first transfer names its rank (`transferred`): until every rank of a world
is bound, a LOOKUP of that world finds nothing (a miss, never another rank's KV).

LMCache's worker says it is alive by pinging with its instance id (its heartbeat, from its first
transfer on) and re-registers after a heartbeat it missed; it has no connection of its own to watch,
as our attach socket is for our connector. So a registration is dropped when its worker
- unregisters it;
- pinged, then fell silent REAP_SILENT_S;
- removed the shared-memory segment its caches are in (as its worker does when it exits: the
  daemon's open descriptor alone would keep the memory);
- has no such segment (engine_driven: the segment is the daemon's; CUDA caches) and never pinged for
  REGISTRATION_GRACE_S (it died before its first transfer; LMCache's server waits as long).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_mp.lmcache_door.staging import Staging
from lmcache_mp.protocol import LMCACHE_DOOR, KVCacheRegistration

if TYPE_CHECKING:
    from lmcache_mp.engine.engine import Engine
    from lmcache_mp.transfer.context import TransferContext

logger = logging.getLogger(__name__)

REAP_SILENT_S = 60.0
REGISTRATION_GRACE_S = 3600.0
SEGMENT_CHECK_S = 10.0  # how often registrations' segments are looked for in /dev/shm
MAX_REGISTRATIONS = 256  # through the door at once (each holds its segments open)

SegmentId = tuple[str, tuple[int, int]]  # (name, (st_dev, st_ino))


@dataclass
class Registration:
    owner: bytes  # the connection that registered it (dispatch.PEER)
    segments: list[SegmentId]  # the client's segments its caches are in (lmcache_driven)
    staging: Staging | None  # the daemon's segment it writes into and reads from (engine_driven)
    last_seen: float
    pinged: bool = False
    # Registers the caches with the engine as the given rank's; None once done (at once for one rank).
    bind: Callable[[int], None] | None = None
    world_size: int = 1
    binding: threading.Lock = field(default_factory=threading.Lock)

    @property
    def bound(self) -> bool:
        """Whether its caches are registered with the engine."""
        return self.bind is None

    def release(self) -> None:
        """What the daemon made for it goes with it: its staging segment."""
        if self.staging is not None:
            self.staging.remove()


class Registrations:
    """Registrations through the door by instance id; thread-safe."""

    def __init__(self) -> None:
        self._table: dict[int, Registration] = {}
        self._lock = threading.Lock()
        self._next_segment_check = 0.0

    def refresh(self, instance_id: int, owner: bytes) -> Registration | None:
        """The registration `owner` made under `instance_id`, its liveness refreshed (its worker
        registers again after a heartbeat it missed: as LMCache's server does, that says it is alive);
        None if there is none of that owner's."""
        with self._lock:
            known = self._table.get(instance_id)
            if known is None or known.owner != owner:
                return None
            known.last_seen = time.monotonic()
            return known

    def check_room(self) -> None:
        with self._lock:
            if len(self._table) >= MAX_REGISTRATIONS:
                raise ValueError(f"{len(self._table)} registrations through the lmcache door already")

    def add(self, instance_id: int, owner: bytes, segments: list[SegmentId], staging: Staging | None,
            bind: Callable[[int], None], world_size: int) -> None:
        """A registration, bound to rank 0 at once if it is of a one-rank world (`bind(rank)`
        registers its caches with the engine; ValueError if they are refused)."""
        registration = Registration(owner, segments, staging, last_seen=time.monotonic(), bind=bind,
                                    world_size=world_size)
        if world_size == 1:
            self._bind(registration, 0)
        with self._lock:
            self._table[instance_id] = registration

    def transferred(self, instance_id: int, owner: bytes, rank: int | None) -> None:
        """A transfer of `owner`'s, naming `rank`: the instance's worker is alive, and its rank is
        bound if it is not yet (ValueError for a transfer that names none, or one outside its world)."""
        self.touch(instance_id)
        with self._lock:
            registration = self._table.get(instance_id)
        if registration is None or registration.bound or registration.owner != owner:
            return  # refused further on, as for any instance not registered on this connection
        if rank is None or not 0 <= rank < registration.world_size:
            raise ValueError(f"a transfer of instance {instance_id} (world size {registration.world_size}) "
                             f"naming worker {rank}: its rank must be named, and within its world")
        self._bind(registration, rank)

    @staticmethod
    def _bind(registration: Registration, rank: int) -> None:
        with registration.binding:  # two first transfers at once: one binds
            if registration.bind is not None:
                registration.bind(rank)
                registration.bind = None

    def get(self, instance_id: int) -> Registration | None:
        with self._lock:
            return self._table.get(instance_id)

    def forget(self, instance_id: int) -> None:
        """Its worker unregistered it."""
        with self._lock:
            registration = self._table.pop(instance_id, None)
        if registration is not None:
            registration.release()

    def touch(self, instance_id: int, *, ping: bool = False) -> None:
        with self._lock:
            registration = self._table.get(instance_id)
            if registration is not None:
                registration.last_seen = time.monotonic()
                registration.pinged = registration.pinged or ping

    def gone(self) -> list[tuple[int, Registration]]:
        """Take out the registrations whose worker is gone (module docstring)."""
        now = time.monotonic()
        check_segments = now >= self._next_segment_check
        if check_segments:
            self._next_segment_check = now + SEGMENT_CHECK_S
        with self._lock:
            gone = [(iid, r) for iid, r in self._table.items()
                    if (r.pinged and now - r.last_seen > REAP_SILENT_S)
                    or (not r.pinged and not r.segments and now - r.last_seen > REGISTRATION_GRACE_S)
                    or (check_segments and not all(map(_still_there, r.segments)))]
            for iid, _ in gone:
                del self._table[iid]
        return gone

    def take_all(self) -> list[Registration]:
        with self._lock:
            taken, self._table = list(self._table.values()), {}
        return taken


def _still_there(segment: SegmentId) -> bool:
    name, identity = segment
    try:
        st = os.stat(os.path.join("/dev/shm", name.lstrip("/")), follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


def rank_binder(engine: Engine, instance_id: int, model_name: str, world_size: int, context: TransferContext,
                layout: str, block_size: int) -> Callable[[int], None]:
    """What registers a door registration's caches (`context`) with the engine as a given rank's."""

    def bind(rank: int) -> None:
        registration = KVCacheRegistration(model_name, world_size, rank, layout=layout, block_size=block_size)
        reply = engine.registry.add(instance_id, registration, lambda: (context, None), door=LMCACHE_DOOR)
        logger.info("lmcache door: registered instance %d (%s, rank %d of %d, %d layers, chunks of %d bytes)",
                    instance_id, model_name, rank, world_size, reply.num_layers, reply.chunk_bytes)

    return bind
