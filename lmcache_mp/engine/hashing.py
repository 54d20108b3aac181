"""Token-mode chunk hashing: a deterministic rolling prefix hash over full chunks.

`h_0 = H(SEED, tokens[0:C])`, `h_i = H(h_{i-1}, tokens[iC:(i+1)C])` with BLAKE2b-256 over
the previous digest and the chunk's tokens as little-endian uint32. The same tokens give
the same hashes in every process, on every run, on every machine; chunk i's hash names the
whole prefix through the end of chunk i. A partial tail chunk has no hash. A salt (vLLM's
`cache_salt`, per-user isolation) replaces SEED with a hash of SEED and the salt: the chains of
two salts, or of a salt and none, never meet.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from sys import byteorder

_SEED = hashlib.blake2b(b"lmcache-mp token chunk hash v1", digest_size=32).digest()
_MAX_TOKEN = 2**32 - 1


def _token_bytes(tokens: tuple[int, ...] | list[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except OverflowError:
        raise ValueError(f"token ids must lie in [0, {_MAX_TOKEN}]") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte "I"
        return struct.pack(f"<{len(tokens)}I", *tokens)
    if byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def _salted_seed(salt: bytes) -> bytes:
    return hashlib.blake2b(_SEED + salt, digest_size=32, person=b"lmcache-mp salt").digest()


def chunk_hashes(tokens: tuple[int, ...] | list[int], chunk_size: int, num_chunks: int,
                 salt: bytes = b"") -> list[bytes]:
    """Hashes of the first `num_chunks` full chunks of `tokens`, in the chain of `salt`."""
    if num_chunks * chunk_size > len(tokens):
        raise ValueError(f"{num_chunks} chunks of {chunk_size} tokens need more than {len(tokens)} tokens")
    data = _token_bytes(tokens[: num_chunks * chunk_size])
    step = 4 * chunk_size
    out: list[bytes] = []
    prev = _salted_seed(salt) if salt else _SEED
    for i in range(num_chunks):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=32).digest()
        out.append(prev)
    return out
