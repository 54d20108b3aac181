"""LMCache's keys in the engine's terms, and the door's refusals."""

from __future__ import annotations

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.lmcache_door import wire


class Refusal(Exception):
    """A request the door answers as failed, with why (logged once per kind)."""


def engine_key(key: wire.Key, *, lookup: bool) -> IPCCacheEngineKey:
    """The engine's token-mode key for LMCache's: its tokens through `end`, from `start` (0 for a
    lookup, which counts from the first token). Chunks are keyed by our own token-mode chain of
    them (`engine/hashing.py`). ValueError for a key the door does not serve."""
    if key.cache_salt:
        raise ValueError("keys with a cache_salt (per-user isolation) are not served yet: a miss, "
                         "never stored")
    tokens = key.tokens()
    end = min(key.end, len(tokens))
    if key.start > end:
        raise ValueError(f"a key's range [{key.start}, {key.end}) starts past its {len(tokens)} tokens")
    return IPCCacheEngineKey(key.model_name, key.world_size, None if lookup else key.worker_id,
                             token_ids=tokens[:end], start=0 if lookup else key.start, end=end,
                             request_id=key.request_id)
