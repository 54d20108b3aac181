"""A request's tail: the tokens past its last full chunk, stored as one short chunk when it ends.

A returning turn of a conversation resends its history, which seldom ends on a chunk boundary:
without its tail, it would recompute up to a chunk of tokens it had sent before. So when a
request finishes, the scheduler stores the part of its KV past its last full chunk (up to a
chunk's blocks, the last maybe partly filled) as one short chunk, and notes it to the daemon
under its *anchor*, the key of the chunk before it (`lmcache_mp.engine.tails`).

Its key names the tail's tokens and all before them, as vLLM's block hash would name a block of
them: vLLM's hash of the tail's last full block (which chains through every earlier token, with
the request's LoRA, cache salt and multimodal inputs), or of the anchor's last block, the tokens
past it, and the extra keys vLLM's own block hasher adds for those tokens (the LoRA adapter's
name and path, and the cache salt where no block hash precedes them). A returning turn gets the
tails noted after its last chunk hit (those whose last full block its prompt's last chunk or
later blocks hold: the daemon's window, `lmcache_mp.engine.tails`), and keeps the longest whose key its
own tokens reproduce, so a tail that is not the request's own history is never loaded.

A request whose token ids do not name its input gets no tail, neither stored nor looked up:
a multimodal one (the tokens past the last full block would name an image by its placeholder
alone) and one with prompt embeddings (vLLM gives each embedded position the token id 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from lmcache_mp.protocol import TailHit, TailNote
from vllm_adapter.ops import LoadStoreOp

if TYPE_CHECKING:
    from vllm.v1.request import Request


def tail_hash(request: Request, start: int, num_tokens: int, block_size: int) -> bytes:
    """The key of the request's tail of `num_tokens` tokens from token `start` (a chunk boundary):
    vLLM's hash of its last full block (or of the block before it), the tokens past that block
    and what vLLM's block hasher would add to a block of them (`generate_block_hash_extra_keys`:
    LoRA name and path, and the cache salt from token 0, where no block hash tells requests
    apart). Encoded as one msgpack array: no two different inputs give the same bytes."""
    end = start + num_tokens
    full_end = end // block_size * block_size  # the tail's full blocks end here
    parent = request.block_hashes[full_end // block_size - 1] if full_end else b""
    extra_keys, _ = generate_block_hash_extra_keys(request, full_end, end, 0)
    named = msgspec.msgpack.encode((parent, extra_keys, request.all_token_ids[full_end:end]))
    return hashlib.blake2b(named, digest_size=32, person=b"lmcache-mp tail").digest()


def may_have_tail(request: Request) -> bool:
    """No tail for a request whose token ids do not name its input: multimodal, or with prompt
    embeddings (see the module docstring)."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


def longest_own_tail(tails: Sequence[TailHit], request: Request, start: int,
                     block_size: int) -> TailHit | None:
    """The longest of `tails` (noted after the chunk that ends at token `start`) that is this
    request's own history: its key recomputed from the request's tokens. None if none is."""
    if not tails:
        return None
    room, full_blocks = request.num_tokens - start, len(request.block_hashes)
    for tail in sorted(tails, key=lambda t: t.num_tokens, reverse=True):
        fits = tail.num_tokens <= room and (start + tail.num_tokens) // block_size <= full_blocks
        if fits and tail_hash(request, start, tail.num_tokens, block_size) == tail.tail_hash:
            return tail
    return None


@dataclass(frozen=True)
class FinishStore:
    """What a finished request leaves to store: its whole chunks not stored yet, and its tail
    (`note`: where the tail goes in the daemon's index; None if none)."""

    op: LoadStoreOp
    note: TailNote | None


def finish_store(request: Request, block_ids: list[int], saved_chunks: int, chunk_blocks: int,
                 block_size: int, end: int) -> FinishStore | None:
    """The store of a finished request's KV through token `end` past its `saved_chunks` stored
    chunks (`block_ids`: its block table), or None if nothing is left."""
    chunk_tokens = chunk_blocks * block_size
    chunks = end // chunk_tokens
    num_tokens = end - chunks * chunk_tokens
    if saved_chunks > chunks or (saved_chunks == chunks and not num_tokens):
        return None  # all of it is in chunks stored already
    start, full_end = saved_chunks * chunk_blocks, chunks * chunk_blocks
    tail_blocks = -(-num_tokens // block_size)
    hashes = request.block_hashes
    note = None
    if num_tokens:
        key = tail_hash(request, chunks * chunk_tokens, num_tokens, block_size)
        last_block = hashes[end // block_size - 1] if num_tokens >= block_size else b""
        anchor = hashes[full_end - 1] if chunks else b""
        note = TailNote(anchor, TailHit(num_tokens, tail_blocks, key, last_block))
    op = LoadStoreOp(block_ids[start:full_end + tail_blocks], block_hashes=list(hashes[start:full_end]),
                     tail_hash=note.tail.tail_hash if note is not None else None)
    return FinishStore(op, note)
