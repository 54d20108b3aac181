"""What an adapter sends for a request: its op, the chunk keys the op covers, and their geometry.

A `LoadStoreOp` names a request's blocks in vLLM's cache and how its chunks are keyed: by
vLLM's block hashes (hash mode, the connector's) or by a token range (token mode). Hash-mode
keys stride from the op's first block, one per full chunk (`striding_block_hashes`): an op
starts on a chunk boundary. The blocks past its last full chunk have no key (neither stored nor
loaded) unless the op names their `tail_hash`: then they are one short chunk, a request's tail
(`vllm_adapter.tails`), its key saying how many blocks it takes.

A block id of `SKIP_BLOCK` in a load means "leave this block alone" (vLLM holds it already, or
never reads it: a sliding window's null blocks); the daemon copies around it. `kept_blocks` is
this side's one filter of it.

`KeyMaker` holds an adapter's identity (model, world size, rank) and chunk geometry, once: the
adapters read theirs from it. Its `num_chunks` restates the daemon's count of an op's chunks
(`lmcache_mp/engine/keys.py`, token mode): a STORE reply has one outcome per chunk in key order, which
the worker slices per request with that count, so the two must agree. `connect` says HELLO and
checks the daemon's chunk size against vLLM's block size, which every key depends on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.mq.client import MessageQueueClient

DEFAULT_TIMEOUT_S = 30.0
# A load's block id for "leave this block alone" (any negative id names no block).
SKIP_BLOCK = -1


@dataclass
class LoadStoreOp:
    block_ids: list[int]
    """Block ids for the load/store operation (`SKIP_BLOCK`: skip that block on load)"""
    token_ids: list[int] | None = None
    """Token IDs for the load/store operation (token mode)"""
    block_hashes: list[bytes] | None = None
    """Block hashes for the load/store operation (hash mode)"""
    start: int = 0
    """Start token index (token mode only)"""
    end: int = 0
    """End token index (token mode only)"""
    tail_hash: bytes | None = None
    """Hash mode: the key of the blocks past the last full chunk, one short chunk (a tail)"""

    def __len__(self) -> int:
        return len(self.block_ids)


def kept_blocks(op: LoadStoreOp) -> list[int]:
    """The block ids of `op` a load writes: all but `SKIP_BLOCK`."""
    return [b for b in op.block_ids if b >= 0]


def striding_block_hashes(block_hashes: list[bytes], blocks_in_chunk: int) -> Iterator[bytes]:
    """One key per full chunk: the hash of the chunk's last block. vLLM's block hashes
    chain, so that one hash names the whole prefix through the end of the chunk. A partial
    tail chunk yields nothing."""
    return iter(block_hashes[blocks_in_chunk - 1 :: blocks_in_chunk])


@dataclass(frozen=True)
class KeyMaker:
    """Builds IPC keys for one (model, world size, rank) and counts an op's chunks."""

    model_name: str
    world_size: int
    worker_id: int | None  # None: the scheduler's keys (a lookup names no rank)
    blocks_in_chunk: int
    block_size: int  # vLLM's tokens per block

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (the daemon's, a multiple of vLLM's block size: `connect`)."""
        return self.blocks_in_chunk * self.block_size

    def keys_for(self, request_id: str, op: LoadStoreOp) -> list[IPCCacheEngineKey]:
        if op.block_hashes is not None:
            keys = [
                IPCCacheEngineKey(self.model_name, self.world_size, self.worker_id,
                                  chunk_hash=h, request_id=request_id)
                for h in striding_block_hashes(op.block_hashes, self.blocks_in_chunk)
            ]
            if op.tail_hash is not None:
                keys.append(IPCCacheEngineKey(self.model_name, self.world_size, self.worker_id,
                                              chunk_hash=op.tail_hash, request_id=request_id,
                                              num_blocks=self._tail_blocks(op)))
            return keys
        if op.token_ids is None:
            raise ValueError("a LoadStoreOp needs block_hashes (hash mode) or token_ids (token mode)")
        return [IPCCacheEngineKey(self.model_name, self.world_size, self.worker_id,
                                  token_ids=tuple(op.token_ids), start=op.start, end=op.end,
                                  request_id=request_id)]

    def _tail_blocks(self, op: LoadStoreOp) -> int:
        """The blocks of `op`'s tail: those past its full chunks."""
        return len(op.block_ids) - len(op.block_hashes or ()) // self.blocks_in_chunk * self.blocks_in_chunk

    def num_chunks(self, op: LoadStoreOp) -> int:
        """The chunks a store of `op` covers (its tail one): one outcome each in its reply."""
        if op.block_hashes is not None:
            return len(op.block_hashes) // self.blocks_in_chunk + (op.tail_hash is not None)
        chunk_tokens = self.chunk_size
        end = min(op.end or len(op.token_ids or ()), len(op.token_ids or ()))
        return max(0, end // chunk_tokens - op.start // chunk_tokens)

    def chunk_blocks(self, op: LoadStoreOp) -> list[int]:
        """The vLLM blocks each chunk of `op` covers, in key order (as `num_chunks` counts them)."""
        if op.block_hashes is None:
            return [self.blocks_in_chunk] * self.num_chunks(op)
        whole = [self.blocks_in_chunk] * (len(op.block_hashes) // self.blocks_in_chunk)
        return [*whole, self._tail_blocks(op)] if op.tail_hash is not None else whole

    def chunks_of(self, op: LoadStoreOp, chunks: list[int]) -> LoadStoreOp:
        """An op of just these chunks of `op` (its tail is the one past its full chunks). A
        token-mode op is kept whole: its key names a token range (the chunks that landed come back
        ALREADY_PRESENT)."""
        if op.block_hashes is None:
            return op
        n = self.blocks_in_chunk
        whole = len(op.block_hashes) // n
        spans = [slice(i * n, (i + 1) * n) for i in chunks if i < whole]
        tail = op.tail_hash is not None and whole in chunks
        block_ids = [b for s in spans for b in op.block_ids[s]] + (op.block_ids[whole * n:] if tail else [])
        return LoadStoreOp(block_ids, block_hashes=[h for s in spans for h in op.block_hashes[s]],
                           tail_hash=op.tail_hash if tail else None)


def connect(server_url: str, context: zmq.Context | None, name: str, timeout_s: float,
            vllm_block_size: int, connect_timeout_s: float | None,
            curve: ClientCurve | None) -> tuple[MessageQueueClient, int]:
    """Connect and say HELLO (waiting `connect_timeout_s`, default `timeout_s`); returns the
    client and the daemon's chunk size."""
    client = MessageQueueClient(server_url, context, request_timeout_s=timeout_s, curve=curve)
    try:
        hello = client.handshake(name, timeout_s=connect_timeout_s or timeout_s)
    except BaseException:
        client.close()
        raise
    if hello.chunk_size % vllm_block_size:
        client.close()
        raise ValueError(
            f"the lmcache-mp daemon at {server_url} stores chunks of {hello.chunk_size} tokens, "
            f"not a multiple of vLLM's block size {vllm_block_size}: restart it with "
            f"--chunk-size a multiple of {vllm_block_size}, or change vLLM's --block-size"
        )
    return client, hello.chunk_size
