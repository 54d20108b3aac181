"""vLLM's KV cache groups as the connector sees them.

With the hybrid KV cache manager (HMA) on, vLLM splits a hybrid model's layers into groups of
one attention type each (e.g. Gemma 3: sliding-window layers and full-attention layers). Each
group has its own block table over memory the groups share, so a block id means something only
for its own group's layers. The connector therefore treats each group as a model of its own:

- the group's chunks live in the daemon under their own name (`KVGroup.namespace`), registered
  by the worker with that group's layers only, stored and loaded with that group's block ids;
- a hit is valid only if every group holds it (the scheduler takes the shortest);
- a sliding-window group holds null blocks (`NULL_BLOCK_ID`) outside the window: a load skips
  them (the window before the hit's end is all vLLM reads), a store never reads them.

A model with one group keeps the plain model name as its namespace, so its chunks are keyed
exactly as before groups existed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_adapter.ops import SKIP_BLOCK

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM's block pool hands out block 0 as the null block: a placeholder in the block table of a
# sliding-window group for blocks outside the window (freed, or never allocated for a hit).
NULL_BLOCK_ID = 0


class UnsupportedKVGroups(ValueError):
    """The model has KV cache state the connector cannot store faithfully (e.g. Mamba state, or
    blocks vLLM zeros unordered against the connector's copies): the connector serves it no hits
    and stores nothing, rather than restore KV without it or wrong."""


@dataclass(frozen=True)
class KVGroup:
    index: int  # its position in vLLM's `kv_cache_groups` (and in every per-group block table)
    layer_names: tuple[str, ...]
    sliding_window: int | None  # in tokens; None for full attention
    namespace: str  # the model name the daemon keys this group's chunks under

    def daemon_request_id(self, request_id: str, num_groups: int) -> str:
        """The request id this group's daemon requests carry. The daemon keeps one lease session
        per request id, so each group of a hybrid model needs its own."""
        return request_id if num_groups == 1 else f"{request_id}#g{self.index}"


def kv_groups(kv_cache_config: KVCacheConfig, model_name: str) -> list[KVGroup]:
    """The groups of this KV cache config, checked. Raises UnsupportedKVGroups for a model the
    connector cannot serve (Mamba state; KV cache blocks that vLLM zeros; states of several
    tokens; a hybrid model's groups whose blocks the block hashes do not match), ValueError for a
    plain model whose block size the block hashes do not match."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        for index, group in enumerate(groups):
            spec = group.kv_cache_spec
            # Exact types: the variants of full attention (sinks, ...) keep extra state.
            if not isinstance(spec, SlidingWindowSpec) and type(spec) not in (FullAttentionSpec,
                                                                              MLAAttentionSpec):
                raise UnsupportedKVGroups(
                    f"KV cache group {index} ({type(spec).__name__}) is neither full nor sliding-window "
                    "attention: LMCacheMPDaemonConnector cannot store its state with the KV")
    if kv_cache_config.needs_kv_cache_zeroing:
        # vLLM then zeros each step's new blocks on its stream, unordered against the daemon's
        # copies: the V1 runner after `handle_preemptions`, where sync loads go out (the zeroing
        # could wipe loaded KV), the V2 runner before it, while a preempted request's store may
        # still read its freed blocks (it could store zeros). Only Mamba state (refused above for
        # hybrid models) and caches of mixed precision need it.
        raise UnsupportedKVGroups("vLLM zeros new KV cache blocks for this model (mixed-precision "
                                  "KV caches or Mamba state), which LMCacheMPDaemonConnector cannot "
                                  "order against its loads and stores")
    for index, group in enumerate(groups):
        # A block id's tokens must be the cache's token dimension (or whole kernel blocks of it)
        # for the daemon to find a block's pages: not so where a state compresses several tokens.
        spec = group.kv_cache_spec
        if isinstance(spec, AttentionSpec) and spec.tokens_per_state != 1:
            raise UnsupportedKVGroups(f"KV cache group {index} stores one state per "
                                      f"{spec.tokens_per_state} tokens: LMCacheMPDaemonConnector "
                                      "reads one per token")
    block_sizes = {group.kv_cache_spec.block_size for group in groups}
    if block_sizes != {kv_cache_config.hash_block_size}:
        # A hybrid model runs without the cache rather than not at all; a plain one is refused,
        # since vLLM's --block-size fixes it.
        error = UnsupportedKVGroups if len(groups) > 1 else ValueError
        raise error(f"block hashes cover {kv_cache_config.hash_block_size} tokens, blocks "
                    f"{sorted(block_sizes)}: LMCacheMPDaemonConnector needs them equal")
    if len(groups) == 1:
        return [KVGroup(0, tuple(groups[0].layer_names), None, model_name)]
    result = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        kind = "full" if window is None else f"sliding{window}"
        names = tuple(group.layer_names)
        # Named by its layers: the same group of the same model gets the same name in every
        # process and after every restart; a different grouping never reads these chunks.
        digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
        result.append(KVGroup(index, names, window, f"{model_name}#{kind}-{digest}"))
    return result


def kv_bytes_per_token(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of KV one token takes on this rank, every layer of every group: what a load copies
    per token."""
    return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) // group.kv_cache_spec.block_size
               for group in kv_cache_config.kv_cache_groups)


def skip_null_blocks(block_ids: list[int]) -> list[int]:
    """A load's block ids with the null blocks marked `SKIP_BLOCK` (the daemon leaves those alone)."""
    return [SKIP_BLOCK if b == NULL_BLOCK_ID else b for b in block_ids]
