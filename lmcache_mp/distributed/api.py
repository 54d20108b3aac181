"""Storage-level identity of a chunk: `ObjectKey`, and the shape of what is stored."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lmcache_mp.custom_types import IPCCacheEngineKey

_INT64_BYTES = 8


# The largest value of one packed field of a kv_rank (world size, rank, ...): one byte.
MAX_FIELD = 0xFF


@dataclass(frozen=True)
class ObjectKey:
    """One stored object: one chunk of one rank's KV for one model."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int

    @staticmethod
    def IntHash2Bytes(chunk_hash: int) -> bytes:
        """Big-endian two's complement; 8 bytes for anything that fits an int64, else
        the shortest multiple of 8 bytes that holds it."""
        length = max(_INT64_BYTES, -(-(chunk_hash.bit_length() + 1) // 8))
        length = -(-length // _INT64_BYTES) * _INT64_BYTES
        return chunk_hash.to_bytes(length, "big", signed=True)

    @staticmethod
    def Bytes2IntHash(chunk_hash: bytes) -> int:
        return int.from_bytes(chunk_hash, "big", signed=True)

    @staticmethod
    def ComputeKVRank(
        world_size: int, global_rank: int, local_world_size: int, local_rank: int
    ) -> int:
        """Pack the parallel configuration into one int, a byte per field:
        `world_size<<24 | global_rank<<16 | local_world_size<<8 | local_rank`."""
        fields = {
            "world_size": world_size,
            "global_rank": global_rank,
            "local_world_size": local_world_size,
            "local_rank": local_rank,
        }
        for name, value in fields.items():
            if not 0 <= value <= MAX_FIELD:
                raise ValueError(f"{name}={value} does not fit in one byte (0..{MAX_FIELD})")
        if global_rank >= world_size:
            raise ValueError(f"global_rank={global_rank} must be below world_size={world_size}")
        if local_rank >= local_world_size:
            raise ValueError(
                f"local_rank={local_rank} must be below local_world_size={local_world_size}"
            )
        return world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank


@dataclass(frozen=True)
class MemoryLayoutDesc:
    """What one stored object holds: a list of tensors by shape and dtype."""

    shapes: list[torch.Size]
    dtypes: list[torch.dtype]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes):
            raise ValueError("MemoryLayoutDesc needs one dtype per shape")

    @property
    def nbytes(self) -> int:
        return sum(
            shape.numel() * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )


def rank_of(world_size: int, worker_id: int) -> int:
    """The kv_rank of one worker of a node-local deployment (the daemon is node-local)."""
    return ObjectKey.ComputeKVRank(world_size, worker_id, world_size, worker_id)


def ipc_keys_to_object_keys(ipc_keys: Iterable[IPCCacheEngineKey]) -> list[ObjectKey]:
    """Hash-mode IPC keys to object keys. A key without a worker id stands for every
    rank and expands to `world_size` object keys, chunk-major (all ranks of chunk 0,
    then all ranks of chunk 1, ...)."""
    out: list[ObjectKey] = []
    for key in ipc_keys:
        if key.is_token_mode:
            raise ValueError("token-mode keys must be hashed into chunk keys first")
        workers = range(key.world_size) if key.worker_id is None else (key.worker_id,)
        out.extend(
            ObjectKey(key.chunk_hash, key.model_name, rank_of(key.world_size, w)) for w in workers
        )
    return out
