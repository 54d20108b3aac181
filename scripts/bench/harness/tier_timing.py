"""What bench_remote.py's parts share: the chunks (random bytes in the real layout, reads into
touched destination buffers), one batch through a tier with its counters checked, the alternation
of raw and tier batches round by round, and the medians and ratios of the rounds."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable

import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.storage.tiers.base import StorageTier

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# The layout of bench_data_plane.py: 32 layers x 8 KV heads x 128 x (K, V) x bf16 per token.
LAYERS, KV_HEADS, HEAD = 32, 8, 128
TOKEN_BYTES = LAYERS * KV_HEADS * 2 * HEAD * 2  # 128 KiB: a 256-token chunk is 32 MiB
FULL = [(512 * KiB, 16), (2 * MiB, 16), (8 * MiB, 16), (32 * MiB, 8)]  # (chunk bytes, batch)
QUICK = [(512 * KiB, 4), (8 * MiB, 4)]
Step = tuple[int, int, int]  # chunk bytes, batch, rounds
TARGET = 0.70
TIMEOUT_S = 30  # the tiers' per-operation timeout: a slow batch must not take a tier down
DIRECTIONS = ("SET", "GET")
SIDES = ("raw", "tier")


# ---- data ----------------------------------------------------------------------------------------

def chunk_format(size: int) -> ChunkFormat:
    """The real layout with `size // TOKEN_BYTES` tokens per chunk (a page of 16 tokens)."""
    return ChunkFormat("bench-remote", 1, 0, "CPU_ATTN", "bfloat16", LAYERS, (KV_HEADS, 16, 2 * HEAD),
                       size // TOKEN_BYTES)


def make_chunks(size: int, batch: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(batch)]


def make_outs(size: int, batch: int) -> list[torch.Tensor]:
    """Destination buffers, touched once (like the pool's slots, which are touched at start)."""
    return [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]


def chunk_keys(part: str, size: int, batch: int) -> list[ChunkKey]:
    fmt = chunk_format(size)
    return [ChunkKey(hashlib.sha256(f"{part}-{size}-{i}".encode()).digest(), fmt) for i in range(batch)]


def check_exact(outs: list[torch.Tensor], chunks: list[torch.Tensor], what: str) -> None:
    for i, (out, chunk) in enumerate(zip(outs, chunks, strict=True)):
        assert torch.equal(out, chunk), f"{what}: chunk {i} read back differs from what was written"


# ---- the tier's side (the same for both tiers) ------------------------------------------------

def tier_set(tier: StorageTier, keys: list[ChunkKey], chunks: list[torch.Tensor],
             sync: Callable[[], None] | None = None) -> float:
    """Seconds for one `batched_put` (and `sync`, when given); asserts every chunk was written."""
    before = tier.stats().writes_total
    t = time.perf_counter()
    stored = tier.batched_put(list(zip(keys, chunks, strict=True)))
    if sync is not None:
        sync()
    elapsed = time.perf_counter() - t
    grew = tier.stats().writes_total - before
    assert stored == len(keys) and grew == len(keys), f"stored {stored}, writes_total grew by {grew}"
    return elapsed


def tier_get(tier: StorageTier, keys: list[ChunkKey], outs: list[torch.Tensor]) -> float:
    """Seconds for one `batched_get` into `outs`; asserts it was len(keys) hits, in place."""
    before = tier.stats()
    t = time.perf_counter()
    got = tier.batched_get(keys, outs)
    elapsed = time.perf_counter() - t
    after = tier.stats()
    hits, misses = after.hits_total - before.hits_total, after.misses_total - before.misses_total
    assert hits == len(keys) and misses == 0 and after.corrupt_total == before.corrupt_total, \
        f"{hits} hits, {misses} misses, {after.corrupt_total - before.corrupt_total} corrupt"
    assert all(g is not None and g.data_ptr() == o.data_ptr() for g, o in zip(got, outs, strict=True)), \
        "a chunk was not read into its destination buffer"
    return elapsed


def verify_tier(tier: StorageTier, keys: list[ChunkKey], chunks: list[torch.Tensor],
                outs: list[torch.Tensor]) -> None:
    for out in outs:
        out.zero_()
    tier_get(tier, keys, outs)
    check_exact(outs, chunks, tier.name)


# ---- alternation ---------------------------------------------------------------------------------

Op = Callable[[], float]  # one batch; returns its seconds


def alternate(ops: dict[str, dict[str, Op]], rounds: int, nbytes: int, verify: Callable[[], None],
              sides: tuple[str, ...] = SIDES) -> dict[str, dict[str, list[float]]]:
    """GB/s samples [direction][side]: one untimed warm-up round, then `verify()`, then `rounds`
    rounds of SET then GET, each direction taking the sides in turn, who goes first rotating
    (of two, raw and tier, swapping)."""
    samples: dict[str, dict[str, list[float]]] = {d: {s: [] for s in sides} for d in DIRECTIONS}
    for r in range(-1, rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for direction in DIRECTIONS:
            for side in order:
                seconds = ops[side][direction]()
                if r >= 0:
                    samples[direction][side].append(nbytes / seconds / 1e9)
        if r == -1:
            verify()
    return samples


def rounds_for(size: int, batch: int, rounds: int, min_bytes: int) -> int:
    """At least `rounds`, and enough that each side moves `min_bytes` per direction (a batch of
    16 x 512 KiB takes a few ms: one scheduler hiccup would swing a short series)."""
    return max(rounds, -(-min_bytes // (size * batch)))


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Per direction: median GB/s of each side, their ratio (the verdict's), and the ratios of
    the rounds (raw and tier of one round ran back to back, so they saw the same machine)."""
    out = {}
    for direction, by_side in samples.items():
        raw, tier = statistics.median(by_side["raw"]), statistics.median(by_side["tier"])
        paired = [t / r for t, r in zip(by_side["tier"], by_side["raw"], strict=True)]
        out[direction] = {"raw_gbps": raw, "tier_gbps": tier, "ratio": tier / raw,
                          "round_ratio_median": statistics.median(paired), "round_ratio_min": min(paired),
                          "round_ratio_max": max(paired), "raw_samples": by_side["raw"],
                          "tier_samples": by_side["tier"]}
    return out


def label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
