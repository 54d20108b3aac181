"""Chunk keys: from wire keys to chunk hashes (`keys.ChunkMapper`), the checks on a request's keys
(`check_same_model`, `check_keys_for`), and the token-mode chunk hash (`hashing.chunk_hashes`).

In process, with real keys and registrations; no daemon.
"""

from __future__ import annotations

import hashlib

import pytest

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine.hashing import chunk_hashes
from lmcache_mp.engine.keys import ChunkMapper, check_keys_for, check_same_model
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration

C = 4  # tokens per chunk
TOKENS = tuple(range(100, 100 + 3 * C + 2))  # three full chunks and a partial tail
CHAIN = chunk_hashes(TOKENS, C, 3)


def hkey(chunk_hash: bytes, request_id: str | None = "r", model: str = "m", world: int = 1,
         worker: int | None = 0) -> IPCCacheEngineKey:
    return IPCCacheEngineKey(model, world, worker, chunk_hash=chunk_hash, request_id=request_id)


def tkey(tokens: tuple[int, ...] = TOKENS, start: int = 0, end: int = 0,
         request_id: str | None = "r") -> IPCCacheEngineKey:
    return IPCCacheEngineKey("m", 1, 0, token_ids=tokens, start=start, end=end, request_id=request_id)


def refused(err: pytest.ExceptionInfo[ServerError], *words: str) -> bool:
    return err.value.code is ErrorCode.INVALID_ARGUMENT and all(w in err.value.message for w in words)


# ---- hashing.chunk_hashes --------------------------------------------------------------------
# Pinned vectors. A token-mode chunk is stored under this hash, in the memory pool and also on
# disk and in Redis, where it outlives the daemon: a change to the hashing (seed, byte order,
# digest) would silently orphan every chunk already stored there and, worse, could make two
# daemons of different versions that share a Redis disagree. Change these values only together
# with a new seed string (a new version), never to make this test pass.
VECTORS = [
    ((tuple(range(8)), 4, 2), [
        "add80bf05383905bf2fcf301b287cedd3498b8b914339a888783940e7f3b14ab",
        "2ca19bdea4f3e02f4cecb91db1417c82121af8dc35ab1bd0a90e9da4d21be335"]),
    (((0, 1, 2**32 - 1, 7, 5, 5), 2, 3), [
        "326635f985586c3d3f106cd2cb93ee00d73f9befff9bf1a8c3afeeed8a40c3f6",
        "96ba2ff084f8f453f93f9c2a91c4e31c487b6d1d47181b16a2c972e13d7c540d",
        "fdfb0f23bc2be5951a63139be4c11025799f47cd81827b2e27bf988e3174f864"]),
    (((151643,) * 16, 16, 1), [
        "ced4dc6271a5430488f87b0c00a229fafdced1a8a5a8ffc6b46db7275f3be725"]),
]


@pytest.mark.parametrize(("args", "expected"), VECTORS)
def test_chunk_hashes_are_the_pinned_vectors(args: tuple, expected: list[str]) -> None:
    tokens, size, count = args
    assert [h.hex() for h in chunk_hashes(tokens, size, count)] == expected
    assert [h.hex() for h in chunk_hashes(list(tokens), size, count)] == expected  # list or tuple


def test_chunk_hashes_follow_their_stated_definition() -> None:
    """h_0 = H(SEED, chunk 0), h_i = H(h_{i-1}, chunk i); BLAKE2b-256, tokens as little-endian uint32."""
    prev = hashlib.blake2b(b"lmcache-mp token chunk hash v1", digest_size=32).digest()
    for i, got in enumerate(CHAIN):
        chunk = b"".join(t.to_bytes(4, "little") for t in TOKENS[i * C:(i + 1) * C])
        prev = hashlib.blake2b(prev + chunk, digest_size=32).digest()
        assert got == prev


def test_a_chunk_hash_names_the_whole_prefix() -> None:
    changed = (TOKENS[0] + 1, *TOKENS[1:])  # only chunk 0's first token differs
    assert all(a != b for a, b in zip(CHAIN, chunk_hashes(changed, C, 3), strict=True))
    later = TOKENS[:2 * C] + (0,) * C  # chunk 2 differs: chunks 0 and 1 keep their hashes
    assert chunk_hashes(later, C, 3)[:2] == CHAIN[:2] and chunk_hashes(later, C, 3)[2] != CHAIN[2]
    assert chunk_hashes(TOKENS, 2 * C, 1)[0] not in CHAIN  # another chunk size, other hashes


def test_chunk_hashes_refuse_too_few_tokens_and_ids_outside_uint32() -> None:
    assert chunk_hashes(TOKENS, C, 0) == []
    with pytest.raises(ValueError, match="need more than"):
        chunk_hashes(TOKENS, C, 4)  # the partial tail has no hash
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="token ids must lie"):
            chunk_hashes((1, 2, bad, 3), C, 1)


# ---- ChunkMapper -------------------------------------------------------------------------------


def test_hash_mode_keys_are_one_chunk_each_in_order() -> None:
    mapper = ChunkMapper(C)
    keys = [hkey(b"a", "r1"), hkey(b"b", None), hkey(b"c", "r2")]
    for lookup in (True, False):
        op = mapper.op_chunks(keys, lookup=lookup)
        assert (op.hashes, op.request_ids, op.parent) == ([b"a", b"b", b"c"], ["r1", None, "r2"], None)
    assert mapper.lookup_hashes(keys) == [b"a", b"b", b"c"]


def test_a_token_key_covers_its_full_chunks_only() -> None:
    op = ChunkMapper(C).op_chunks([tkey(request_id="q")], lookup=False)
    assert op.hashes == CHAIN and op.request_ids == ["q"] * 3 and op.parent is None


@pytest.mark.parametrize(("end", "chunks"), [(0, 3), (C, 1), (2 * C + 3, 2), (10**6, 3), (C - 1, 0)])
def test_a_token_keys_end_bounds_its_chunks(end: int, chunks: int) -> None:
    """`end` 0 means every token; an end past the tokens is clipped; a partial chunk has no hash."""
    assert ChunkMapper(C).op_chunks([tkey(end=end)], lookup=False).hashes == CHAIN[:chunks]


def test_an_ops_token_key_starts_at_its_start_and_names_the_parent() -> None:
    op = ChunkMapper(C).op_chunks([tkey(start=C)], lookup=False)
    assert op.hashes == CHAIN[1:] and op.request_ids == ["r", "r"]
    assert op.parent == CHAIN[0]  # the pool links the stored chain to it


def test_a_lookups_token_key_counts_from_token_zero() -> None:
    mapper = ChunkMapper(C)
    op = mapper.op_chunks([tkey(start=2 * C)], lookup=True)
    assert op.hashes == CHAIN and op.parent is None
    assert mapper.lookup_hashes([tkey(start=2 * C)]) == CHAIN
    # A LOOKUP's start need not be a chunk boundary: it is not read.
    assert mapper.lookup_hashes([tkey(start=1)]) == CHAIN


def test_an_ops_start_past_the_tokens_covers_nothing() -> None:
    op = ChunkMapper(C).op_chunks([tkey(start=5 * C)], lookup=False)
    assert op.hashes == [] and op.request_ids == []


def test_only_the_first_key_with_chunks_names_a_parent() -> None:
    mapper = ChunkMapper(C)
    hash_first = mapper.op_chunks([hkey(b"x"), tkey(start=C)], lookup=False)
    assert hash_first.hashes == [b"x", *CHAIN[1:]] and hash_first.parent is None
    two = mapper.op_chunks([tkey(start=C, end=2 * C, request_id="a"), tkey(start=2 * C, request_id="b")],
                           lookup=False)
    assert two.hashes == CHAIN[1:] and two.request_ids == ["a", "b"] and two.parent == CHAIN[0]


def test_lookup_hashes_agrees_with_op_chunks_for_mixed_keys() -> None:
    mapper = ChunkMapper(C)
    keys = [hkey(b"h"), tkey(end=2 * C), hkey(b"i")]
    assert mapper.lookup_hashes(keys) == mapper.op_chunks(keys, lookup=True).hashes
    assert mapper.lookup_hashes(keys) == [b"h", *CHAIN[:2], b"i"]
    assert mapper.lookup_hashes([]) == []


def test_an_ops_start_off_a_chunk_boundary_is_refused() -> None:
    with pytest.raises(ServerError) as err:
        ChunkMapper(C).op_chunks([tkey(start=C + 1)], lookup=False)
    assert refused(err, f"start {C + 1}", f"chunk size {C}")


def test_token_ids_outside_uint32_are_refused_as_invalid() -> None:
    with pytest.raises(ServerError) as err:
        ChunkMapper(C).op_chunks([tkey(tokens=(1, 2, 3, 2**32))], lookup=True)
    assert refused(err, "token ids must lie")


# ---- check_same_model / check_keys_for ---------------------------------------------------------


def test_check_same_model_returns_the_shared_model_and_world() -> None:
    keys = [hkey(b"a", model="llama", world=2, worker=0), hkey(b"b", model="llama", world=2, worker=1),
            hkey(b"c", model="llama", world=2, worker=None)]
    assert check_same_model(keys) == ("llama", 2)  # ranks may differ within one request


@pytest.mark.parametrize("other", [hkey(b"b", model="qwen", world=2), hkey(b"b", model="llama", world=4)])
def test_check_same_model_refuses_a_mix(other: IPCCacheEngineKey) -> None:
    with pytest.raises(ServerError) as err:
        check_same_model([hkey(b"a", model="llama", world=2), other])
    assert refused(err, "mixes keys of (llama, 2)", f"({other.model_name}, {other.world_size})")


REG = KVCacheRegistration(model_name="llama", world_size=2, worker_id=1)


def test_check_keys_for_accepts_the_workers_own_and_rankless_keys() -> None:
    check_keys_for(REG, [hkey(b"a", model="llama", world=2, worker=1),
                         hkey(b"b", model="llama", world=2, worker=None)])
    check_keys_for(REG, [])


@pytest.mark.parametrize(("key", "words"), [
    (hkey(b"a", model="qwen", world=2, worker=1), ("(qwen, world size 2)", "(llama, world size 2)")),
    (hkey(b"a", model="llama", world=1, worker=1), ("(llama, world size 1)", "registered for")),
    (hkey(b"a", model="llama", world=2, worker=0), ("keys of worker 0", "instance of worker 1")),
])
def test_check_keys_for_refuses_another_workers_keys(key: IPCCacheEngineKey, words: tuple[str, ...]) -> None:
    with pytest.raises(ServerError) as err:
        check_keys_for(REG, [hkey(b"ok", model="llama", world=2, worker=1), key])
    assert refused(err, *words)
