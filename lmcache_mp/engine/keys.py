"""From wire keys to chunks: which chunk hashes an operation covers, and the checks on its keys.

A hash-mode key names one chunk (vLLM block hashes strided to chunk boundaries). A token-mode
key names the full chunks of its token range, hashed here with `hashing.chunk_hashes`. A hash-mode
key may name a short chunk (`num_blocks` blocks, fewer than a chunk's: a request's tail); its
identity then includes its length (`short_chunk_hash`). Keys
never mix models or world sizes within one request, and a worker's keys must be its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine.hashing import chunk_hashes
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration


def invalid(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class OpChunks:
    """The chunks one LOOKUP / STORE / RETRIEVE covers, in order."""

    request_ids: list[str | None]  # the request each chunk's key came from
    hashes: list[bytes]
    # Hash of the chunk just before the first one, when the keys tell it (token mode starting
    # past 0): the pool links the stored chain to it, for prefix-aware eviction.
    parent: bytes | None = None
    # Each chunk's `num_blocks` (0: whole), when some key names a short chunk; else None.
    blocks: list[int] | None = None


class ChunkMapper:
    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def op_chunks(self, keys: list[IPCCacheEngineKey], lookup: bool) -> OpChunks:
        """Every chunk the keys cover. A LOOKUP's token keys count from token 0."""
        request_ids: list[str | None] = []
        hashes: list[bytes] = []
        parent: bytes | None = None
        for key in keys:
            if not key.is_token_mode:
                request_ids.append(key.request_id)
                hashes.append(key.chunk_hash)
                continue
            first, chain = self._token_chunks(key, lookup)
            if not hashes and first:
                parent = chain[first - 1]
            request_ids.extend([key.request_id] * (len(chain) - first))
            hashes.extend(chain[first:])
        blocks = None
        if any(key.num_blocks for key in keys):
            if len(hashes) != len(keys):
                raise invalid("a short chunk's key (num_blocks) in a request with token-mode keys")
            blocks = [key.num_blocks for key in keys]
        return OpChunks(request_ids, hashes, parent, blocks)

    def lookup_hashes(self, keys: list[IPCCacheEngineKey]) -> list[bytes]:
        """The chunk hashes a LOOKUP's keys cover (`op_chunks(keys, lookup=True).hashes`), with
        the scheduler's usual request, every key one chunk hash, in one comprehension."""
        hashes = [key.chunk_hash for key in keys]
        return hashes if all(hashes) else self.op_chunks(keys, lookup=True).hashes

    def _token_chunks(self, key: IPCCacheEngineKey, lookup: bool) -> tuple[int, list[bytes]]:
        """(index of the key's first chunk, hashes of every chunk from 0 through its last)."""
        end = min(key.end or len(key.token_ids), len(key.token_ids)) // self.chunk_size
        start = 0 if lookup else key.start
        if start % self.chunk_size:
            raise invalid(f"token range start {start} is not a multiple of the chunk size {self.chunk_size}")
        try:
            chain = chunk_hashes(key.token_ids, self.chunk_size, end)
        except ValueError as err:
            raise invalid(str(err)) from None
        return min(start // self.chunk_size, len(chain)), chain


def short_chunk_hash(chunk_hash: bytes, num_blocks: int) -> bytes:
    """The identity of a short chunk of `num_blocks` blocks under key `chunk_hash`: the key with
    its length, so that no operation of another length reads it (a full chunk's blocks would
    take bytes it never stored)."""
    return hashlib.blake2b(chunk_hash + num_blocks.to_bytes(4, "little"), digest_size=32,
                           person=b"lmcache-mp short").digest()


def short_chunks(chunks: OpChunks, blocks_per_chunk: int) -> tuple[OpChunks, list[int] | None]:
    """`chunks` with each short one known by its identity (`short_chunk_hash`), and every chunk's
    block count (None: all whole). A key of more blocks than a chunk's is refused."""
    if chunks.blocks is None:
        return chunks, None
    if max(chunks.blocks) > blocks_per_chunk:
        raise invalid(f"a short chunk of {max(chunks.blocks)} blocks; a chunk has {blocks_per_chunk}")
    counts = [n or blocks_per_chunk for n in chunks.blocks]
    hashes = [h if n == blocks_per_chunk else short_chunk_hash(h, n)
              for h, n in zip(chunks.hashes, counts, strict=True)]
    return replace(chunks, hashes=hashes), counts


def check_same_model(keys: list[IPCCacheEngineKey]) -> tuple[str, int]:
    """The (model, world size) all keys share; refuses a request that mixes them."""
    model, world_size = keys[0].model_name, keys[0].world_size
    for key in keys:
        if key.model_name != model or key.world_size != world_size:
            raise invalid(f"one request mixes keys of ({model}, {world_size}) and "
                          f"({key.model_name}, {key.world_size})")
    return model, world_size


def check_keys_for(registration: KVCacheRegistration, keys: list[IPCCacheEngineKey]) -> None:
    """Keys sent with an instance id must be that worker's: same model, world size and rank."""
    r = registration
    for key in keys:
        if (key.model_name, key.world_size) != (r.model_name, r.world_size):
            raise invalid(f"keys for ({key.model_name}, world size {key.world_size}) sent to an "
                          f"instance registered for ({r.model_name}, world size {r.world_size})")
        if key.worker_id is not None and key.worker_id != r.worker_id:
            raise invalid(f"keys of worker {key.worker_id} sent to the instance of worker {r.worker_id}")
