"""LMCache's keys in the engine's terms, and the door's refusals."""

from __future__ import annotations

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
