"""Registered workers: their KV caches (mapped into the daemon), chunk formats and attach tokens.

A worker registers once per cache (REGISTER_KV_CACHE), under an instance id of its own choosing
(random); an id that is registered already is refused, never replaced: replacing it would hand
one worker's RETRIEVEs to another's cache. On CPU its caches arrive as file
descriptors over the attach socket, claimed here by the registration's attach token; that
socket then stays open as the registration's liveness signal, so a worker that dies is
dropped at once. Each registration has a `ChunkFormat`: a chunk stored from its caches is
keyed by (chunk hash, format fingerprint) in every tier, so it is only ever read back into a
cache of the very same kind.

One lock guards the tables; mapping memory and copies happen outside it.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcache_mp.chunks import ChunkFormat
from lmcache_mp.custom_types import CudaIPCWrapper, KVCache, SharedMemoryTensor
from lmcache_mp.distributed.api import MAX_FIELD
from lmcache_mp.engine.dispatch import PEER
from lmcache_mp.engine.keys import invalid
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import NATIVE_DOOR, ErrorCode, InstanceInfo, KVCacheRegistration, RegisterReply
from lmcache_mp.sockets import SocketAccess
from lmcache_mp.storage import FormatCombo, RankSpec
from lmcache_mp.transfer.attach import AttachListener
from lmcache_mp.transfer.context import TransferContext
from lmcache_mp.transfer.cuda import import_cuda_tensors
from lmcache_mp.transfer.layouts import describe_caches
from lmcache_mp.transfer.shm import map_storages, prebuild_page_tables, view_shared

logger = logging.getLogger(__name__)

RankKey = tuple[str, int, int]  # (model, world size, worker id)

# What a registration puts into the daemon's tables, STATUS and logs, in UTF-8 bytes: a model name
# (a path or a hub name) and a layout (a vLLM attention backend's name).
MAX_MODEL_NAME_BYTES = 1024
MAX_LAYOUT_BYTES = 128


@dataclass
class Instance:
    """One registered worker: its caches (mapped here), who it is, and its chunk format."""

    instance_id: int
    registration: KVCacheRegistration
    context: TransferContext
    fmt: ChunkFormat  # one for every rank of a replicated registration (`KVCacheRegistration.replicated`)
    owner: bytes  # the connection that registered it (dispatch.PEER)
    door: str = NATIVE_DOOR  # the front door it came through (protocol.DoorInfo)

    @property
    def rank_key(self) -> RankKey:
        r = self.registration
        return r.model_name, r.world_size, r.worker_id

    @functools.cached_property
    def rank_spec(self) -> RankSpec:
        """How this instance's rank stores a chunk, for the storage manager's LOOKUP (made once:
        every LOOKUP asks)."""
        return RankSpec(self.fmt, self.context.chunk_nbytes, self.context.blocks_per_chunk)


def _cache_kind(fmt: ChunkFormat) -> tuple:
    """A format without its rank: what every rank of one engine's caches has in common."""
    return fmt.layout, fmt.dtype, fmt.num_layers, fmt.page_shape, fmt.chunk_tokens


def _check_names(reg: KVCacheRegistration) -> None:
    for what, name, limit in (("model name", reg.model_name, MAX_MODEL_NAME_BYTES),
                              ("layout", reg.layout, MAX_LAYOUT_BYTES)):
        size = len(name.encode())
        if size > limit:
            raise invalid(f"cannot register a {what} of {size} bytes: at most {limit} (UTF-8)")


class Registry:
    def __init__(self, attach_socket: Path, access: SocketAccess, chunk_size: int,
                 admit_chunk: Callable[[int], None], on_drop: Callable[[int], None] = lambda _: None):
        """`admit_chunk(nbytes)` raises ValueError when the pool can never hold a chunk of `nbytes`;
        `on_drop(instance_id)` runs once a registration is gone (unregistered, or its worker)."""
        self.chunk_size = chunk_size
        self._admit_chunk = admit_chunk
        self._on_drop = on_drop
        self._instances: dict[int, Instance] = {}
        # rank -> {format fingerprint: the registered instances with that format}
        self._rank_formats: dict[RankKey, dict[bytes, list[Instance]]] = {}
        self._tokens: dict[bytes, int] = {}  # attach token -> instance id
        # (model, world size) -> how many of its ranks have a registered cache: a LOOKUP claiming
        # more ranks than that is answered without a look at any rank (it could claim 2^31).
        self._ranks_registered: dict[tuple[str, int], int] = {}
        # (model, world size) -> `format_combos`' answer, made once per change of the
        # registrations (every LOOKUP asks), only for worlds whose every rank is registered
        # (so never more entries than registrations); emptied, under the lock, by every
        # register and drop.
        self._combos: dict[tuple[str, int], list[FormatCombo]] = {}
        self._lock = threading.Lock()
        self.attach = AttachListener(attach_socket, self._on_attach_closed, access)
        self.attach.start()

    def close(self) -> None:
        self.attach.stop()

    def register(self, instance_id: int, kv_caches: KVCache, reg: KVCacheRegistration) -> RegisterReply:
        def open_caches() -> tuple[TransferContext, Callable[[], None]]:
            layers, mapped = self._open_layers(kv_caches, reg)
            layers, geometry = describe_caches(layers, reg.layout, reg.block_size)
            # Only once accepted: a refused registration touches none of its memory.
            return TransferContext(layers, geometry, self.chunk_size), lambda: prebuild_page_tables(mapped)

        return self.add(instance_id, reg, open_caches)

    def add(self, instance_id: int, reg: KVCacheRegistration,
            open_caches: Callable[[], tuple[TransferContext, Callable[[], None] | None]], *,
            door: str = NATIVE_DOOR) -> RegisterReply:
        """Register the caches `open_caches()` opens: their copy context, and what to run once the
        registration is accepted (None: nothing). It raises ValueError for caches it cannot serve.
        `register` opens our connector's handles; the lmcache door opens LMCache's (`door` says so)."""
        if not 0 <= reg.worker_id < reg.world_size:
            raise invalid(f"worker_id {reg.worker_id} is outside world_size {reg.world_size}")
        _check_names(reg)
        self._check_unused(instance_id)  # before mapping anything; checked again when inserting
        try:
            # A rank is one byte of the seed's packed `kv_rank`, which a chunk stored here must
            # stay expressible in.
            if reg.world_size > MAX_FIELD:
                raise ValueError(f"world_size={reg.world_size} does not fit in one byte (0..{MAX_FIELD})")
            context, accepted = open_caches()
            geometry = context.geometry
            fmt = geometry.chunk_format(reg.model_name, reg.world_size, reg.worker_id, self.chunk_size,
                                        reg.replicated)
        except ValueError as err:
            raise invalid(f"cannot register instance {instance_id}: {err}") from None
        except torch.OutOfMemoryError:
            raise invalid(f"cannot register instance {instance_id}: no room on its device for the "
                          "daemon's four one-chunk staging buffers; lower --chunk-size or leave vLLM more "
                          "headroom (--gpu-memory-utilization)") from None
        try:
            # Refused here rather than at every STORE: a chunk the pool can't allocate in one
            # piece would fail each of them.
            self._admit_chunk(context.chunk_nbytes)
        except ValueError as err:
            raise invalid(f"cannot register instance {instance_id}: a chunk of this cache takes "
                          f"{context.chunk_nbytes} bytes, too large for the pool: {err}; raise "
                          "--l1-size-gb or lower --chunk-size") from None
        instance = Instance(instance_id, reg, context, fmt, PEER.get(), door)
        with self._lock:
            self._check_unused_locked(instance_id)
            self._instances[instance_id] = instance
            formats = self._rank_formats.get(instance.rank_key)
            if formats is None:
                formats = self._rank_formats[instance.rank_key] = {}
                world = instance.rank_key[:2]
                self._ranks_registered[world] = self._ranks_registered.get(world, 0) + 1
            formats.setdefault(fmt.fingerprint, []).append(instance)
            self._combos = {}
            if reg.attach_token:
                self._tokens[reg.attach_token] = instance_id
        if accepted is not None:
            accepted()
        logger.info("registered instance %d: %s rank %d/%d, %s %s, %d layers x %d blocks of %d tokens%s",
                    instance_id, reg.model_name, reg.worker_id, reg.world_size, geometry.layout.name,
                    geometry.dtype, geometry.num_layers, geometry.num_blocks, geometry.block_size,
                    ", the same on every rank (stored once)" if reg.replicated else "")
        return RegisterReply(geometry.layout.name, geometry.num_layers, geometry.num_blocks,
                             geometry.block_size, context.chunk_nbytes)

    def _check_unused(self, instance_id: int) -> None:
        with self._lock:
            self._check_unused_locked(instance_id)

    def _check_unused_locked(self, instance_id: int) -> None:
        if instance_id in self._instances:
            logger.warning("refused a registration under instance id %d: registered already", instance_id)
            raise ServerError(ErrorCode.ALREADY_REGISTERED,
                              f"instance id {instance_id} is registered already (by another worker, or by "
                              "this one before its registration was dropped); register under a new id")

    def _open_layers(self, handles: KVCache, reg: KVCacheRegistration
                     ) -> tuple[list[torch.Tensor], list[torch.UntypedStorage]]:
        """The layers' tensors, and the shared storages mapped for them (none for CUDA)."""
        if handles and all(isinstance(h, SharedMemoryTensor) for h in handles):
            if not reg.attach_token:
                raise ValueError("shared-memory caches need an attach token")
            fds = self.attach.claim(reg.attach_token)
            sizes: dict[int, int] = {}
            for h in handles:
                sizes.setdefault(h.state.storage_index, h.state.storage_nbytes)
            if sorted(sizes) != list(range(len(fds))):
                for fd in fds:
                    os.close(fd)
                raise ValueError(f"handles name storages {sorted(sizes)}, {len(fds)} descriptors arrived")
            storages = map_storages(fds, [sizes[i] for i in range(len(fds))])
            return [view_shared(h, storages) for h in handles], storages  # type: ignore[arg-type]
        if handles and all(isinstance(h, CudaIPCWrapper) for h in handles):
            if reg.attach_token:
                self.attach.claim(reg.attach_token)  # liveness only: it carries no descriptors
            return import_cuda_tensors(handles), []  # type: ignore[arg-type]
        kinds = sorted({type(h).__name__ for h in handles}) or ["nothing"]
        raise ValueError(f"expected one handle per layer, all of one kind; got {', '.join(kinds)}")

    def unregister(self, instance_id: int) -> bool:
        with self._lock:
            found = self._owned_locked(instance_id) and self._drop_locked(instance_id)
        if found:
            self._on_drop(instance_id)
            logger.info("unregistered instance %d", instance_id)
        return found

    def _drop_locked(self, instance_id: int) -> bool:
        # The mapped memory is released when the last in-flight copy drops its reference.
        instance = self._instances.pop(instance_id, None)
        if instance is None:
            return False
        formats = self._rank_formats[instance.rank_key]
        same_format = formats[instance.fmt.fingerprint]
        same_format.remove(instance)
        if not same_format:
            del formats[instance.fmt.fingerprint]
        if not formats:
            del self._rank_formats[instance.rank_key]
            world = instance.rank_key[:2]
            self._ranks_registered[world] -= 1
            if not self._ranks_registered[world]:
                del self._ranks_registered[world]
        self._combos = {}
        if instance.registration.attach_token:
            self._tokens.pop(instance.registration.attach_token, None)
        return True

    def _on_attach_closed(self, token: bytes) -> None:
        with self._lock:
            instance_id = self._tokens.get(token)
            if instance_id is not None:
                self._drop_locked(instance_id)
        if instance_id is not None:
            self._on_drop(instance_id)
            logger.info("worker of instance %d went away: dropped its registration", instance_id)

    def owned(self, instance_id: int) -> bool:
        """Whether the instance is registered: False if not; FORBIDDEN if it is, by another
        connection than the request's (only its own worker may cancel or unregister it)."""
        with self._lock:
            return self._owned_locked(instance_id)

    def _owned_locked(self, instance_id: int) -> bool:
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        if instance.owner != PEER.get():
            logger.warning("refused a request about instance %d from a connection that did not "
                           "register it", instance_id)
            raise ServerError(ErrorCode.FORBIDDEN, f"instance {instance_id} was registered on another "
                                                   "connection: only its own worker may act on it")
        return True

    def current(self, instance: Instance) -> bool:
        """Whether `instance` (looked up earlier) is still registered."""
        with self._lock:
            return self._instances.get(instance.instance_id) is instance

    def instance(self, instance_id: int) -> Instance:
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise ServerError(ErrorCode.UNKNOWN_INSTANCE,
                              f"no KV cache is registered under instance id {instance_id}")
        return instance

    def format_combos(self, model: str, world_size: int) -> list[FormatCombo]:
        """What a LOOKUP can hit: one `RankSpec` per rank, in rank order, for each kind of cache
        (layout, dtype, geometry: `_cache_kind`) registered on every rank of the world; usually
        exactly one. Empty when some rank has no cache: nothing could be retrieved into every
        rank. The ranks of one engine share a kind, so mixing kinds across ranks would find
        chunks no engine can load, and trying every mix grew as formats ** ranks. Ranks that
        share a format (replicated caches: one chunk serves them all) are in a combo once, so a
        LOOKUP pins and promotes each such chunk once.
        Read without the lock when known: a LOOKUP racing a registration change may see the
        registrations just before it, as it would have a moment earlier."""
        combos = self._combos.get((model, world_size))
        if combos is not None:
            return combos
        with self._lock:
            if self._ranks_registered.get((model, world_size), 0) < world_size:
                return []  # not cached: a claimed world costs nothing to remember
            by_kind: dict[tuple, list[RankSpec]] = {}
            for rank in range(world_size):  # no more ranks than registrations
                for same_format in self._rank_formats[model, world_size, rank].values():
                    spec = same_format[0].rank_spec
                    by_kind.setdefault(_cache_kind(spec.fmt), []).append(spec)
            combos = self._combos[model, world_size] = [
                tuple({spec.fmt.fingerprint: spec for spec in specs}.values())
                for specs in by_kind.values() if len(specs) == world_size]
        return combos

    def instance_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._instances)

    def registered_by_door(self) -> dict[str, int]:
        """How many instances are registered through each front door (a door with none: absent)."""
        with self._lock:
            return dict(collections.Counter(inst.door for inst in self._instances.values()))

    def describe(self) -> list[InstanceInfo]:
        """Every registered instance, for STATUS."""
        with self._lock:
            instances = sorted(self._instances.values(), key=lambda inst: inst.instance_id)
        infos = []
        for inst in instances:
            reg, geometry = inst.registration, inst.context.geometry
            infos.append(InstanceInfo(inst.instance_id, reg.model_name, reg.world_size, reg.worker_id,
                                      geometry.layout.name, geometry.num_layers, geometry.num_blocks,
                                      geometry.cache_nbytes, inst.door))
        return infos

    @property
    def num_attach_channels(self) -> int:
        return self.attach.num_channels
