"""The daemon's semantics: registrations, LOOKUP / STORE / RETRIEVE / END_SESSION.

Keys become pool keys: `(chunk hash, fingerprint)`, where the fingerprint names the
registering worker's model, world size, rank, layout, dtype and geometry (everything an
`ObjectKey` says, and what the bytes mean). Bytes stored by one kind of cache are therefore
never read into another: a doubtful chunk is a miss.

Locking: the engine's own lock guards only the registration tables; the pool and the lease
table have their own. Copies run outside every lock, on the server's worker threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass

import torch

from lmcache_mp.config import ServerConfig
from lmcache_mp.custom_types import (
    CudaIPCWrapper,
    IPCCacheEngineKey,
    KVCache,
    SharedMemoryTensor,
)
from lmcache_mp.distributed.api import rank_of
from lmcache_mp.errors import ServerError
from lmcache_mp.hashing import chunk_hashes
from lmcache_mp.leases import LeaseTable
from lmcache_mp.observability import Metrics
from lmcache_mp.protocol import (
    ChunkOutcome,
    ErrorCode,
    KVCacheRegistration,
    RegisterReply,
    RetrieveResult,
    StoreResult,
)
from lmcache_mp.storage.pool import MemoryPool, PoolObject
from lmcache_mp.transfer import cuda
from lmcache_mp.transfer.context import TransferContext
from lmcache_mp.transfer.layouts import describe_caches
from lmcache_mp.transfer.shm import AttachListener, map_storages

logger = logging.getLogger(__name__)

PoolKey = tuple[bytes, bytes]  # (chunk hash, fingerprint)


@dataclass
class Instance:
    """One registered worker: its caches (mapped here) and who it is."""

    instance_id: int
    registration: KVCacheRegistration
    context: TransferContext
    fingerprint: bytes

    @property
    def rank_key(self) -> tuple[str, int, int]:
        r = self.registration
        return r.model_name, r.world_size, r.worker_id

    def pool_key(self, chunk_hash: bytes) -> PoolKey:
        return chunk_hash, self.fingerprint


def _invalid(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARGUMENT, message)


class Engine:
    def __init__(self, config: ServerConfig, metrics: Metrics):
        self.chunk_size = config.chunk_size
        self.metrics = metrics
        self.pool = MemoryPool(int(config.l1_size_gb * 2**30), pin_memory=torch.cuda.is_available())
        self.leases = LeaseTable(self.pool, config.lease_ttl_s)
        self._instances: dict[int, Instance] = {}
        # (model, world size, worker id) -> fingerprints of the registered instances of that rank
        self._rank_fingerprints: dict[tuple[str, int, int], dict[bytes, int]] = {}
        self._tokens: dict[bytes, int] = {}  # attach token -> instance id
        self._lock = threading.Lock()
        self.attach = AttachListener(config.attach_socket, self._on_attach_closed)
        self.attach.start()

    def close(self) -> None:
        self.attach.stop()

    # ---- registration -----------------------------------------------------------------------

    def register(self, instance_id: int, kv_caches: KVCache, reg: KVCacheRegistration) -> RegisterReply:
        if not 0 <= reg.worker_id < reg.world_size:
            raise _invalid(f"worker_id {reg.worker_id} is outside world_size {reg.world_size}")
        try:
            rank_of(reg.world_size, reg.worker_id)  # refuses ranks that do not fit a kv_rank
            layers = self._open_layers(kv_caches, reg)
            geometry = describe_caches(layers, reg.layout)
            context = TransferContext(layers, geometry, self.chunk_size)
        except ValueError as err:
            raise _invalid(f"cannot register instance {instance_id}: {err}") from None
        if context.chunk_nbytes > self.pool.capacity_bytes:
            raise _invalid(f"one chunk of this cache takes {context.chunk_nbytes} bytes, more than the "
                           f"whole pool ({self.pool.capacity_bytes}); raise --l1-size-gb")
        instance = Instance(instance_id, reg, context,
                            geometry.fingerprint(reg.model_name, reg.world_size, reg.worker_id))
        with self._lock:
            self._drop_locked(instance_id)
            self._instances[instance_id] = instance
            fps = self._rank_fingerprints.setdefault(instance.rank_key, {})
            fps[instance.fingerprint] = fps.get(instance.fingerprint, 0) + 1
            if reg.attach_token:
                self._tokens[reg.attach_token] = instance_id
        logger.info("registered instance %d: %s rank %d/%d, %s %s, %d layers x %d blocks of %d tokens",
                    instance_id, reg.model_name, reg.worker_id, reg.world_size, geometry.layout.name,
                    geometry.dtype, geometry.num_layers, geometry.num_blocks, geometry.block_size)
        return RegisterReply(geometry.layout.name, geometry.num_layers, geometry.num_blocks,
                             geometry.block_size, context.chunk_nbytes)

    def _open_layers(self, handles: KVCache, reg: KVCacheRegistration) -> list[torch.Tensor]:
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
            return [h.view_of(storages) for h in handles]  # type: ignore[attr-defined]
        if handles and all(isinstance(h, CudaIPCWrapper) for h in handles):
            if reg.attach_token:
                self.attach.claim(reg.attach_token)  # liveness only: it carries no descriptors
            return [h.to_tensor() for h in handles]  # type: ignore[attr-defined]
        kinds = sorted({type(h).__name__ for h in handles}) or ["nothing"]
        raise ValueError(f"expected one handle per layer, all of one kind; got {', '.join(kinds)}")

    def unregister(self, instance_id: int) -> bool:
        with self._lock:
            found = self._drop_locked(instance_id)
        if found:
            logger.info("unregistered instance %d", instance_id)
        return found

    def _drop_locked(self, instance_id: int) -> bool:
        # The mapped memory is released when the last in-flight copy drops its reference.
        instance = self._instances.pop(instance_id, None)
        if instance is None:
            return False
        fps = self._rank_fingerprints[instance.rank_key]
        fps[instance.fingerprint] -= 1
        if not fps[instance.fingerprint]:
            del fps[instance.fingerprint]
        if not fps:
            del self._rank_fingerprints[instance.rank_key]
        if instance.registration.attach_token:
            self._tokens.pop(instance.registration.attach_token, None)
        return True

    def _on_attach_closed(self, token: bytes) -> None:
        with self._lock:
            instance_id = self._tokens.get(token)
            if instance_id is not None:
                self._drop_locked(instance_id)
        if instance_id is not None:
            logger.info("worker of instance %d went away: dropped its registration", instance_id)

    def _instance(self, instance_id: int) -> Instance:
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise ServerError(ErrorCode.UNKNOWN_INSTANCE,
                              f"no KV cache is registered under instance id {instance_id}")
        return instance

    # ---- keys --------------------------------------------------------------------------------

    def _op_chunks(self, keys: list[IPCCacheEngineKey], lookup: bool) -> list[tuple[str | None, bytes]]:
        """(request id, chunk hash) of every chunk an operation covers, in order. A hash-mode
        key names one chunk; a token-mode key names the full chunks of its [start, end)."""
        chunks: list[tuple[str | None, bytes]] = []
        for key in keys:
            if not key.is_token_mode:
                chunks.append((key.request_id, key.chunk_hash))
                continue
            end = min(key.end or len(key.token_ids), len(key.token_ids)) // self.chunk_size
            start = 0 if lookup else key.start
            if start % self.chunk_size:
                raise _invalid(f"token range start {start} is not a multiple of the chunk size "
                               f"{self.chunk_size}")
            try:
                hashes = chunk_hashes(key.token_ids, self.chunk_size, end)[start // self.chunk_size:]
            except ValueError as err:
                raise _invalid(str(err)) from None
            chunks.extend((key.request_id, h) for h in hashes)
        return chunks

    @staticmethod
    def _check_same_model(keys: list[IPCCacheEngineKey], model: str, world_size: int) -> None:
        for key in keys:
            if key.model_name != model or key.world_size != world_size:
                raise _invalid(f"one request mixes keys of ({model}, {world_size}) and "
                               f"({key.model_name}, {key.world_size})")

    # ---- LOOKUP / STORE / RETRIEVE / END_SESSION -------------------------------------------------

    def lookup(self, keys: list[IPCCacheEngineKey]) -> int:
        """Leading chunks present on every rank; the hits are leased to the keys' request."""
        if not keys:
            return 0
        model, world_size = keys[0].model_name, keys[0].world_size
        self._check_same_model(keys, model, world_size)
        hashes = [h for _, h in self._op_chunks(keys, lookup=True)]
        with self._lock:
            per_rank = [list(self._rank_fingerprints.get((model, world_size, r), {}))
                        for r in range(world_size)]
        if not all(per_rank):
            return 0  # some rank has no registered cache: nothing could be retrieved
        best: list[list[PoolObject]] = []
        for fps in itertools.product(*per_rank):  # one combination unless layouts were mixed
            chunks = [[(h, fp) for fp in fps] for h in hashes]  # chunk-major, every rank
            pinned = self.pool.pin_prefix(chunks)
            if len(pinned) > len(best):
                best, pinned = pinned, best
            self.pool.unpin([o for chunk in pinned for o in chunk])
        hits = [o for chunk in best for o in chunk]
        self.metrics.looked_up(len(hashes), len(best))
        request_id = keys[0].request_id
        if request_id is None:
            self.pool.unpin(hits)  # nobody to retrieve them: count, but lease nothing
        else:
            self.leases.add(request_id, hits)
        return len(best)

    def store(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
              event_handle: bytes) -> StoreResult:
        instance = self._instance(instance_id)
        self._check_keys_for(instance, keys)
        hashes = [h for _, h in self._op_chunks(keys, lookup=False)]
        context = instance.context
        self._check_block_ids(context, block_ids, len(hashes), allow_skip=False)
        reserved = self.pool.reserve([instance.pool_key(h) for h in hashes], context.chunk_nbytes)
        fresh = [slot for slot in reserved if isinstance(slot, PoolObject)]
        try:
            self._wait_for_producer(event_handle, context.device)
            bpc = context.blocks_per_chunk
            for i, slot in enumerate(reserved):
                if isinstance(slot, PoolObject):
                    context.gather(block_ids[i * bpc:(i + 1) * bpc], context.chunk_view(slot.data))
            self._finish_copies(context.device)
        except BaseException:
            self.pool.abort(fresh)
            raise
        self.pool.commit(fresh)  # visible to LOOKUP only now, with every byte in place
        outcomes = [ChunkOutcome.STORED if isinstance(s, PoolObject) else s for s in reserved]
        self.metrics.stored(outcomes, context.chunk_nbytes)
        return StoreResult(b"", outcomes)

    def retrieve(self, keys: list[IPCCacheEngineKey], instance_id: int, block_ids: list[int],
                 event_handle: bytes) -> RetrieveResult:
        instance = self._instance(instance_id)
        self._check_keys_for(instance, keys)
        chunks = self._op_chunks(keys, lookup=False)
        context = instance.context
        self._check_block_ids(context, block_ids, len(chunks), allow_skip=True)
        pool_keys = [instance.pool_key(h) for _, h in chunks]
        try:
            objects = self.pool.pin(pool_keys)  # all or nothing
            self.metrics.retrieved(len(pool_keys), objects is not None, context.chunk_nbytes)
            if objects is None:
                return RetrieveResult(b"", False, "some chunks are no longer stored (evicted, "
                                                  "cleared, or stored by another kind of cache)")
            try:
                self._wait_for_producer(event_handle, context.device)
                bpc = context.blocks_per_chunk
                for i, obj in enumerate(objects):
                    context.scatter(context.chunk_view(obj.data), block_ids[i * bpc:(i + 1) * bpc])
                self._finish_copies(context.device)
            finally:
                self.pool.unpin(objects)
        finally:
            # Whatever happened, the leases this retrieve was for are spent.
            for (request_id, _), pool_key in zip(chunks, pool_keys, strict=True):
                self.leases.release(request_id, [pool_key])
        return RetrieveResult(b"", True)

    def end_session(self, request_id: str) -> None:
        self.leases.end(request_id)

    def clear(self) -> int:
        return self.pool.clear()

    def tick(self) -> None:
        self.leases.expire()

    # ---- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _check_keys_for(instance: Instance, keys: list[IPCCacheEngineKey]) -> None:
        r = instance.registration
        for key in keys:
            if (key.model_name, key.world_size) != (r.model_name, r.world_size):
                raise _invalid(f"keys for ({key.model_name}, world size {key.world_size}) sent to an "
                               f"instance registered for ({r.model_name}, world size {r.world_size})")
            if key.worker_id is not None and key.worker_id != r.worker_id:
                raise _invalid(f"keys of worker {key.worker_id} sent to the instance of worker {r.worker_id}")

    @staticmethod
    def _check_block_ids(context: TransferContext, block_ids: list[int], num_chunks: int,
                         allow_skip: bool) -> None:
        try:
            context.check_block_ids(block_ids, num_chunks, allow_skip)
        except ValueError as err:
            raise _invalid(str(err)) from None

    @staticmethod
    def _wait_for_producer(event_handle: bytes, device: torch.device) -> None:
        if event_handle and device.type == "cuda":
            cuda.wait_for_ipc_event(event_handle, device)
        elif event_handle:
            raise _invalid("an event handle was sent for a CPU cache; send b'' on CPU")

    @staticmethod
    def _finish_copies(device: torch.device) -> None:
        # The reply is the completion signal, so the copies must be done before it goes out.
        if device.type == "cuda":
            cuda.synchronize(device)

    def gauges(self) -> dict[str, float]:
        stats = self.pool.stats()
        sessions, leases = self.leases.counts()
        return {
            "pool_capacity_bytes": stats.capacity_bytes,
            "pool_used_bytes": stats.used_bytes,
            "pool_objects": stats.num_objects,
            "pool_pinned_objects": stats.num_pinned,
            "pool_writing_objects": stats.num_writing,
            "pool_evictions_total": stats.evictions,
            "lease_sessions": sessions,
            "leases": leases,
            "lease_sessions_expired_total": self.leases.expired_total,
            "registered_instances": len(self._instances),
            "attach_channels": self.attach.num_channels,
        }

    def status(self) -> dict[str, object]:
        gauges = self.gauges()
        with self._lock:
            instances = sorted(self._instances)
        return {
            "pool_bytes": gauges["pool_capacity_bytes"],
            "pool_used_bytes": gauges["pool_used_bytes"],
            "objects": gauges["pool_objects"],
            "registered_instances": instances,
            "sessions": gauges["lease_sessions"],
            "leases": gauges["leases"],
        }

