"""A request's tail: the tokens past its last full chunk, stored as one short chunk when it ends.

A returning turn of a conversation resends its history, which seldom ends on a chunk boundary:
without its tail, it would recompute up to a chunk of tokens it had sent before. So when a
request finishes, the scheduler stores the part of its KV past its last full chunk (up to a
chunk's blocks, the last maybe partly filled) as one short chunk, and notes it to the daemon
under its *anchor*, the key of the chunk before it (`lmcache_mp.tails`).

Its key names the tail's tokens and all before them: vLLM's hash of the tail's last full block
(which chains through every earlier token, with the request's LoRA, cache salt and multimodal
inputs), or of the anchor's last block, and the tokens past it. A returning turn gets the
tails noted after its last chunk hit (those whose last full block its prompt's last chunk or
later blocks hold: the daemon's window, `lmcache_mp.tails`), and keeps the longest whose key its
own tokens reproduce,
so a tail that is not the request's own history is never loaded. Multimodal requests get no
tail: the tokens past the last full block would name an image by its placeholder alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_mp.protocol import TailHit, TailNote
from vllm_adapter.ops import LoadStoreOp

if TYPE_CHECKING:
    from vllm.v1.request import Request


def tail_hash(block_hashes: Sequence[bytes], tokens: Sequence[int], start: int, num_tokens: int,
              block_size: int, salt: bytes) -> bytes:
    """The key of the tail of `num_tokens` tokens from token `start` (a chunk boundary):
    vLLM's hash of its last full block (or of the block before it), the tokens past that
    block and `salt`, which tells requests apart where no block hash exists yet (token 0)."""
    end = start + num_tokens
    full_end = end // block_size * block_size  # the tail's full blocks end here
    digest = hashlib.blake2b(digest_size=32, person=b"lmcache-mp tail")
    digest.update(block_hashes[full_end // block_size - 1] if full_end else b"")
    digest.update(salt)
    digest.update(array("q", tokens[full_end:end]).tobytes())
    return digest.digest()


def request_salt(request: Request) -> bytes:
    """What keeps two requests' tails apart before their first full block: LoRA and cache salt."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None) or ""
    return f"{lora.lora_name if lora is not None else ''}\0{salt}".encode()


def may_have_tail(request: Request) -> bool:
    """No tail for a multimodal request (see the module docstring)."""
    return not getattr(request, "mm_features", None)


def longest_own_tail(tails: Sequence[TailHit], request: Request, start: int,
                     block_size: int) -> TailHit | None:
    """The longest of `tails` (noted after the chunk that ends at token `start`) that is this
    request's own history: its key recomputed from the request's tokens. None if none is."""
    if not tails:
        return None
    tokens, hashes = request.all_token_ids, request.block_hashes
    salt = request_salt(request)
    room = request.num_tokens - start
    for tail in sorted(tails, key=lambda t: t.num_tokens, reverse=True):
        fits = tail.num_tokens <= room and (start + tail.num_tokens) // block_size <= len(hashes)
        if fits and tail_hash(hashes, tokens, start, tail.num_tokens, block_size, salt) == tail.tail_hash:
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
        key = tail_hash(hashes, request.all_token_ids, chunks * chunk_tokens, num_tokens, block_size,
                        request_salt(request))
        last_block = hashes[end // block_size - 1] if num_tokens >= block_size else b""
        anchor = hashes[full_end - 1] if chunks else b""
        note = TailNote(anchor, TailHit(num_tokens, tail_blocks, key, last_block))
    op = LoadStoreOp(block_ids[start:full_end + tail_blocks], block_hashes=list(hashes[start:full_end]),
                     tail_hash=note.tail.tail_hash if note is not None else None)
    return FinishStore(op, note)
