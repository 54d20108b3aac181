"""What the tier tests share: chunks of random bytes and their keys, a tier's round trip, daemons
beside each other on one store, and a worker's retrieve of a daemon's chunks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache_mp.chunks import ChunkKey, TierStats
from lmcache_mp.storage.tiers.remote import NetworkTier
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import fmt, run_worker, status

WAIT_S = 20.0


def chunks(n: int, nbytes: int = 64 << 10, seed: int = 0) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    keys = [ChunkKey(bytes([seed, i]) * 16, fmt()) for i in range(n)]
    return keys, [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]


def empties(n: int, nbytes: int = 64 << 10) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def round_trip(tier: NetworkTier, n: int = 20) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    """Put `n` chunks, then check that the tier holds exactly them, byte for byte, and that neither an
    absent hash nor the same hash under another format is found; the keys and the bytes."""
    keys, data = chunks(n)
    absent = ChunkKey(b"\xff" * 32, fmt())
    assert tier.batched_put(list(zip(keys, data, strict=True))) == n
    assert tier.batched_contains([*keys, absent]) == [True] * n + [False]
    got = tier.batched_get([*keys, absent], empties(n + 1))
    assert all(torch.equal(g, d) for g, d in zip(got, data, strict=False)) and got[-1] is None
    assert tier.batched_contains([ChunkKey(keys[0].chunk_hash, fmt(model="other"))]) == [False]
    return keys, data


# ---- daemons sharing one store ----------------------------------------------------------------------


def wait_shared(url: str, chunks_written: int) -> TierStats:
    def written() -> bool:
        (t,) = status(url).tiers
        return t.write_queue_chunks == 0 and t.writes_total == chunks_written
    wait_until(written)
    return status(url).tiers[0]


def tier_daemon_args(tier_url: str) -> tuple[str, ...]:
    return ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--l2", tier_url)


def beside(daemon: DaemonProcess, name: str) -> str:
    """A socket URL next to `daemon`'s, for a second daemon in the same directory."""
    return daemon.url.replace("daemon.sock", f"{name}.sock")


def retrieve_into(daemon: DaemonProcess, hashes: list[bytes], out: Path) -> dict:
    run_worker({"url": daemon.url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
                "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": "m",
                "block_ids": list(range(20, 20 + len(hashes))), "request_id": "reader", "out": str(out),
                "block_hashes": [h.hex() for h in hashes]})
    return torch.load(out)
