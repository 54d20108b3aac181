"""Tails in process: the daemon's index of them, their keys, which one a request keeps, the store a
finished request plans, and how keys name a short chunk. Requests are vLLM's own `Request`, with
vLLM's block hasher; tests/daemon/test_tails.py and tests/vllm/test_vllm_tails.py run the real daemon and a
real engine."""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine.keys import ChunkMapper, short_chunk_hash, short_chunks
from lmcache_mp.engine.tails import TailIndex, tail_identity
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import TailHit
from lmcache_mp.storage.read_through import RankSpec
from lmcache_mp.testing.blocks import BLOCK, CHUNK, block_hashes
from tests.support.helpers import fmt
from vllm_adapter.ops import KeyMaker, LoadStoreOp
from vllm_adapter.tails import finish_store, longest_own_tail, may_have_tail, tail_hash

BPC = CHUNK // BLOCK
HIDDEN = 16  # of the prompt embeddings: any width will do for their digests
init_none_hash(sha256_cbor)  # what vLLM's engine does before hashing any block
_ids = itertools.count()


def vllm_request(tokens: list[int] | None = None, *, embeds: torch.Tensor | None = None,
                 lora: LoRARequest | None = None, cache_salt: str | None = None) -> Request:
    """vLLM's `Request` as its engine builds it: token ids or prompt embeddings, its block hashes
    computed by vLLM's own block hasher."""
    return Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=1), None, prompt_embeds=embeds,
                   lora_request=lora, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def _tail(request: Request, start: int, num_tokens: int) -> TailHit:
    hashes = request.block_hashes
    key = tail_hash(request, start, num_tokens, BLOCK)
    last_block = hashes[(start + num_tokens) // BLOCK - 1] if num_tokens >= BLOCK else b""
    return TailHit(num_tokens, -(-num_tokens // BLOCK), key, last_block)


def test_the_index_keeps_the_newest_tails_per_key_within_its_bound() -> None:
    index = TailIndex(max_tails=3, max_per_key=2)
    tails = [TailHit(i + 1, 1, bytes([i])) for i in range(3)]  # shorter than a block: by anchor

    def after(anchor: bytes, world_size: int = 1) -> list[TailHit]:
        return index.after("m", world_size, anchor, [])

    for tail in tails:
        index.note("m", 1, b"a", tail)
    assert after(b"a") == [tails[2], tails[1]]  # newest first, two kept
    index.note("m", 1, b"a", tails[1])  # noted again: the newest, not twice
    assert after(b"a") == [tails[1], tails[2]] and len(index) == 2
    assert after(b"a", world_size=2) == []  # another world size: another key
    index.note("m", 1, b"b", tails[0])
    after(b"a")  # found: the most recently used key
    index.note("m", 1, b"c", tails[0])  # a fourth tail: the least recently used key ("b") goes
    assert after(b"b") == [] and len(index) == 3
    index.forget("m", 1, b"a", tails[1])
    assert after(b"a") == [tails[2]] and len(index) == 2


def test_many_conversations_after_one_anchor_each_find_their_own_tail() -> None:
    """A shared system prompt: a thousand conversations' tails follow its chunk. Each lookup gets
    the one whose last full block its prompt holds (in its window), and the tails after the
    anchor that are shorter than a block."""
    index = TailIndex()
    anchor = b"system prompt"
    tails = [TailHit(40, 3, i.to_bytes(4, "big"), last_block=b"block %d" % i) for i in range(1000)]
    for tail in tails:
        index.note("m", 1, anchor, tail)
    tiny = TailHit(5, 1, b"tiny")
    index.note("m", 1, anchor, tiny)
    for i in (0, 500, 999):
        assert index.after("m", 1, anchor, [b"block x", b"block %d" % i]) == [tiny, tails[i]]
    assert index.after("m", 1, b"another chunk", [b"block 7"]) == [tails[7]]  # the block decides
    assert len(index) == 1001
    small = TailIndex(max_tails=2)
    for tail in tails[:3]:
        small.note("m", 1, anchor, tail)
    found = small.after("m", 1, anchor, [b"block 0", b"block 1", b"block 2"])
    assert sorted(found, key=lambda t: t.tail_hash) == [tails[1], tails[2]]  # the oldest went
    small.forget("m", 1, anchor, tails[1])
    assert small.after("m", 1, anchor, [b"block 1", b"block 2"]) == [tails[2]] and len(small) == 1


def test_a_request_keeps_only_the_longest_tail_its_own_tokens_reproduce() -> None:
    history = list(range(100, 100 + 2 * CHUNK + 20))  # 2 chunks, then 20 tokens
    returning = vllm_request(history + [7] * 30)
    tails = [_tail(vllm_request(history), 2 * CHUNK, 20), _tail(vllm_request(history), 2 * CHUNK, 5)]
    other = vllm_request(history[:2 * CHUNK] + [1] * 20)  # same chunks, another tail
    foreign = _tail(other, 2 * CHUNK, 20)
    assert longest_own_tail([tails[1], foreign, tails[0]], returning, 2 * CHUNK, BLOCK) == tails[0]
    assert longest_own_tail([foreign], returning, 2 * CHUNK, BLOCK) is None
    # Longer than what the request has: not its own, whatever its key.
    assert longest_own_tail([tails[0]], vllm_request(history[:-1]), 2 * CHUNK, BLOCK) is None
    # Another cache salt: another key, though the tokens are the same (a tail from token 0 has no
    # vLLM block hash before it to tell them apart).
    assert _tail(vllm_request(history[:5]), 0, 5) != _tail(vllm_request(history[:5], cache_salt="s"), 0, 5)


def test_a_lora_adapter_is_known_by_its_name_and_path_as_vllm_knows_it() -> None:
    """Two adapters of one name at different paths (a name re-pointed at another adapter): vLLM's
    block hashes tell them apart, and so do their tails' keys, before the first full block and
    after it; the same adapter gets the same keys."""
    tokens = list(range(100, 100 + BLOCK + 5))
    here, there = LoRARequest("adapter", 1, "/adapters/v1"), LoRARequest("adapter", 2, "/adapters/v2")
    first, second, again = (vllm_request(tokens, lora=lora) for lora in (here, there, here))
    assert first.block_hashes != second.block_hashes  # vLLM's own hash covers the path
    for start, num_tokens in ((0, 5), (0, BLOCK + 5)):  # the tail after token 0, and past a block
        assert _tail(first, start, num_tokens) == _tail(again, start, num_tokens)
        assert _tail(first, start, num_tokens) != _tail(second, start, num_tokens)
    assert longest_own_tail([_tail(first, 0, 5)], vllm_request(tokens[:5], lora=there), 0, BLOCK) is None


def test_a_request_with_prompt_embeddings_has_no_tail() -> None:
    """vLLM gives each embedded position the token id 0: two prompts of embeddings of one length,
    or two that differ only past their last full block, have the same token ids. Such a request
    neither stores nor looks up a tail (`may_have_tail`, which the scheduler asks for both); and
    a tail's key covers what vLLM's block hasher does, the embeddings' digest included."""
    embeds = torch.randn(BLOCK + 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    later = embeds.clone()
    later[BLOCK + 2] += 1.0  # the same first block, another tail
    short, other_short = vllm_request(embeds=embeds[:5]), vllm_request(embeds=embeds[5:10])
    long, other_long = vllm_request(embeds=embeds), vllm_request(embeds=later)
    assert list(short.all_token_ids) == list(other_short.all_token_ids) == [0] * 5
    assert long.block_hashes == other_long.block_hashes
    assert list(long.all_token_ids) == list(other_long.all_token_ids)
    assert not any(may_have_tail(r) for r in (short, other_short, long, other_long))
    assert may_have_tail(vllm_request([0] * 5))  # token ids 0 as such: a tail like any other
    assert _tail(short, 0, 5) != _tail(other_short, 0, 5)
    assert _tail(long, 0, BLOCK + 5) != _tail(other_long, 0, BLOCK + 5)
    assert _tail(short, 0, 5) != _tail(vllm_request([0] * 5), 0, 5)


def test_a_finished_request_stores_its_unstored_chunks_and_its_tail() -> None:
    request = vllm_request(list(range(3 * CHUNK + BLOCK + 3)))
    table = list(range(100, 100 + 3 * BPC + 2))
    store = finish_store(request, table, saved_chunks=2, chunk_blocks=BPC, block_size=BLOCK,
                         end=3 * CHUNK + BLOCK + 2)
    assert store is not None and store.note is not None
    assert store.op.block_ids == table[2 * BPC:3 * BPC + 2]  # chunk 2, then the tail's 2 blocks
    assert store.op.block_hashes == request.block_hashes[2 * BPC:3 * BPC]
    assert store.note.anchor == request.block_hashes[3 * BPC - 1]  # the key of chunk 2
    assert store.note.tail == _tail(request, 3 * CHUNK, BLOCK + 2)
    assert store.op.tail_hash == store.note.tail.tail_hash
    keys = KeyMaker("m", 1, 0, BPC, BLOCK)
    made = keys.keys_for("r", store.op)
    assert [k.num_blocks for k in made] == [0, 2] and keys.num_chunks(store.op) == 2
    assert keys.chunks_of(store.op, [1]) == LoadStoreOp(table[3 * BPC:], block_hashes=[],
                                                        tail_hash=store.op.tail_hash)
    # Ending on a chunk boundary: no tail; nothing left: no store.
    on_boundary = finish_store(request, table, 2, BPC, BLOCK, 3 * CHUNK)
    assert on_boundary is not None and on_boundary.note is None and on_boundary.op.tail_hash is None
    assert finish_store(request, table, 3, BPC, BLOCK, 3 * CHUNK) is None
    # A whole-prompt hit of 4 chunks, ended before its last chunk's end: nothing left to store.
    assert finish_store(request, table, 4, BPC, BLOCK, 3 * CHUNK + 5) is None


def test_a_short_chunk_is_known_by_its_length() -> None:
    """A key naming a short chunk gets an identity of its own per length, which LOOKUP_PREFIX
    recomputes the same way; a whole-chunk length keeps the key's hash; longer is refused."""
    keys = KeyMaker("m", 1, 0, BPC, BLOCK)
    op = LoadStoreOp([0, 1, 2], block_hashes=block_hashes(list(range(CHUNK))), tail_hash=b"t" * 32)
    chunks, counts = short_chunks(ChunkMapper(CHUNK).op_chunks(keys.keys_for("r", op), lookup=False), BPC)
    assert counts == [BPC, 1] and chunks.hashes[1] == short_chunk_hash(b"t" * 32, 1) != b"t" * 32
    spec = RankSpec(fmt(), 1, BPC)
    assert tail_identity(TailHit(5, 1, b"t" * 32), spec) == chunks.hashes[1]
    assert tail_identity(TailHit(CHUNK - 1, BPC, b"t" * 32), spec) == b"t" * 32
    whole = LoadStoreOp([0, 1], block_hashes=[], tail_hash=b"t" * 32)
    _, counts = short_chunks(ChunkMapper(CHUNK).op_chunks(keys.keys_for("r", whole), lookup=False), BPC)
    assert counts == [BPC]
    too_long = [IPCCacheEngineKey("m", 1, 0, chunk_hash=b"t" * 32, num_blocks=BPC + 1)]
    with pytest.raises(ServerError, match="a short chunk of 3 blocks"):
        short_chunks(ChunkMapper(CHUNK).op_chunks(too_long, lookup=False), BPC)
