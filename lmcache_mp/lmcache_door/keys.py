"""LMCache's keys in the engine's terms, and the door's refusals."""

from __future__ import annotations

import struct

import blake3

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine.hashing import chunk_hashes
from lmcache_mp.lmcache_door import wire


class Refusal(Exception):
    """A request the door answers as failed, with why (logged once per kind)."""


def engine_keys(key: wire.Key, chunk_size: int, *, lookup: bool) -> list[IPCCacheEngineKey]:
    """The engine's keys for LMCache's: its tokens through `end`, from `start` (0 for a lookup, which
    counts from the first token). Without a `cache_salt`: one token-mode key, whose chunks the engine
    hashes with its own token-mode chain (`engine/hashing.py`). With one (vLLM's per-user isolation):
    a hash-mode key per full chunk, hashed here in the chain of that salt, so that no other salt, and
    no unsalted key, names the same chunks. ValueError for a key the door does not serve."""
    tokens = key.tokens()
    end = min(key.end, len(tokens))
    start = 0 if lookup else key.start
    if start > end:
        raise ValueError(f"a key's range [{key.start}, {key.end}) starts past its {len(tokens)} tokens")
    worker = None if lookup else key.worker_id
    if not key.cache_salt:
        return [IPCCacheEngineKey(key.model_name, key.world_size, worker, token_ids=tokens[:end], start=start,
                                  end=end, request_id=key.request_id)]
    if start % chunk_size:
        raise ValueError(f"token range start {start} is not a multiple of the chunk size {chunk_size}")
    chain = chunk_hashes(tokens, chunk_size, end // chunk_size, salt=key.cache_salt.encode())
    return [IPCCacheEngineKey(key.model_name, key.world_size, worker, chunk_hash=chunk_hash,
                              request_id=key.request_id) for chunk_hash in chain[start // chunk_size:]]


# LMCache's chunk hash (its server's and its connector's default, `blake3`): a chain from the hash
# of one zero token behind an 8-byte zero prefix, each link BLAKE3(previous digest, the chunk's
# tokens as big-endian uint32). The KV events of the door name chunks by it, as `lmcache server`'s do.
_LMCACHE_ROOT = blake3.blake3(bytes(12)).digest()


def lmcache_chunk_hashes(tokens: tuple[int, ...], chunk_size: int, num_chunks: int) -> list[bytes]:
    """LMCache's hashes of the first `num_chunks` full chunks of `tokens`."""
    out: list[bytes] = []
    prev = _LMCACHE_ROOT
    for i in range(num_chunks):
        chunk = tokens[i * chunk_size:(i + 1) * chunk_size]
        prev = blake3.blake3(prev + struct.pack(f">{len(chunk)}I", *chunk)).digest()
        out.append(prev)
    return out
