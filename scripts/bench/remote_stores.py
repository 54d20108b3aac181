"""bench_remote.py's parts c and d: the S3 tier and the Mooncake Store tier, each against its own
client used directly, on a real server on loopback (`lmcache_mp.testing.servers`).

  c. S3: SeaweedFS's S3 gateway (`weed`, the [s3] extra's test server). Baseline: the same botocore
     client the tier uses, PutObject / GetObject of each chunk's bytes, as many at once as the
     tier's max_in_flight (16), the GET's bytes copied into the destination buffers. Tier:
     `open_tier("s3://...")`.
  d. Mooncake: `mooncake_master` and one storage node. Baseline: the client's fastest path, its
     transfer engine reading from and writing into the caller's own registered buffers
     (`batch_put_from`, `batch_get_into`: no copy at all). Tier: `open_tier("mooncake://...")` with
     its defaults (each chunk copied through the client's buffer; `register_pool` off).

Both stores keep an object once written (Mooncake refuses a second put of a name; the tiers take an
existing object as stored), so every SET writes fresh names, and what the round before wrote is
removed first, outside the timing. Sizes stop at 8 MiB and each side moves at least 256 MiB per
direction: the servers run on the same 2 cores as the client.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from harness.tier_timing import (
    MiB,
    Op,
    Step,
    alternate,
    chunk_keys,
    label,
    make_chunks,
    make_outs,
    summarize,
    tier_get,
    tier_set,
    verify_tier,
)

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.chunk_format import as_buffer
from lmcache_mp.storage.tiers.base import StorageTier
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.testing.servers import MOONCAKE_DEFAULT_LEASE_MS, MooncakeStore, s3_server

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the raw Mooncake client's lines, as the tier's
MAX_SIZE = 8 * MiB
MIN_BYTES = 256 * MiB
S3_IN_FLIGHT = 16  # the S3 tier's default max_in_flight


def plan_for(plan: list[Step], quick: bool) -> list[Step]:
    """bench_remote's sizes up to MAX_SIZE, with fewer rounds where a size would move more than
    MIN_BYTES per side."""
    least = 3 if quick else 9
    return [(size, batch, max(least, min(rounds, -(-MIN_BYTES // (size * batch)))))
            for size, batch, rounds in plan if size <= MAX_SIZE]


class Rounds:
    """Fresh names for each SET of one side, the previous SET's removed before the clock starts."""

    def __init__(self, part: str, size: int, batch: int, remove: Callable[[list[ChunkKey]], None]):
        self._part, self._size, self._batch, self._remove = part, size, batch, remove
        self._round = 0
        self.keys = chunk_keys(f"{part}-0", size, batch)

    def next(self) -> list[ChunkKey]:
        self._remove(self.keys)
        self._round += 1
        self.keys = chunk_keys(f"{self._part}-{self._round}", self._size, self._batch)
        return self.keys


def measure(part: str, tier: StorageTier, size: int, batch: int, rounds: int,
            raw_set: Callable[[list[ChunkKey], list[torch.Tensor]], float],
            raw_get: Callable[[list[ChunkKey], list[torch.Tensor]], float],
            raw_remove: Callable[[list[ChunkKey]], None]) -> dict:
    chunks, outs = make_chunks(size, batch, seed=size), make_outs(size, batch)
    raw = Rounds(f"{part}-raw", size, batch, raw_remove)
    ours = Rounds(f"{part}-tier", size, batch, lambda keys: remove_all(tier, keys))
    ops: dict[str, dict[str, Op]] = {
        "raw": {"SET": lambda: raw_set(raw.next(), chunks), "GET": lambda: raw_get(raw.keys, outs)},
        "tier": {"SET": lambda: tier_set(tier, ours.next(), chunks),
                 "GET": lambda: tier_get(tier, ours.keys, outs)},
    }

    def verify() -> None:
        verify_tier(tier, ours.keys, chunks, outs)
        for out in outs:
            out.zero_()
        raw_get(raw.keys, outs)
        assert all(torch.equal(o, c) for o, c in zip(outs, chunks, strict=True)), f"raw {part} GET differs"

    result = summarize(alternate(ops, rounds, size * batch, verify))
    raw_remove(raw.keys)
    remove_all(tier, ours.keys)
    return result


def remove_all(tier: StorageTier, keys: list[ChunkKey]) -> None:
    for key in keys:
        tier.remove(key)


def run_sizes(part: str, tier: StorageTier, plan: list[Step], **raw: Callable) -> dict:
    results = {}
    for size, batch, rounds in plan:
        print(f"  {part}, {batch} x {label(size)}, {rounds} rounds...", flush=True)
        results[size] = {"batch": batch, "rounds": rounds, **measure(part, tier, size, batch, rounds, **raw)}
    final = tier.stats()
    assert final.errors_total == 0 and final.up == 1, final
    return results


# ---- c. S3 ---------------------------------------------------------------------------------------

def bench_s3(plan: list[Step]) -> dict:
    # Deleted objects keep their space until SeaweedFS compacts its volumes: the run writes a few
    # GB, more than the test server's 8 volumes hold; as many as the disk holds, then.
    with s3_server("bench-remote", "-volume.max=0") as server, environment(server.env()):
        client = server.client(timeout_s=60, attempts=5, connections=S3_IN_FLIGHT)  # retries as the tier
        pool = ThreadPoolExecutor(S3_IN_FLIGHT, thread_name_prefix="bench-s3-raw")
        tier = open_tier(server.url("bench", timeout_s="60"))
        try:
            def name(key: ChunkKey) -> str:
                return f"raw/{key.chunk_hash.hex()}"

            def raw_set(keys: list[ChunkKey], chunks: list[torch.Tensor]) -> float:
                values = [bytes(as_buffer(c)) for c in chunks]  # what a raw boto3 user would send
                t = time.perf_counter()
                list(pool.map(lambda kv: client.put_object(Bucket=server.bucket, Key=name(kv[0]), Body=kv[1]),
                              zip(keys, values, strict=True)))
                return time.perf_counter() - t

            def raw_get(keys: list[ChunkKey], outs: list[torch.Tensor]) -> float:
                def one(key_out: tuple[ChunkKey, torch.Tensor]) -> None:
                    data = client.get_object(Bucket=server.bucket, Key=name(key_out[0]))["Body"].read()
                    key_out[1].numpy()[:] = np.frombuffer(data, dtype=np.uint8)

                t = time.perf_counter()
                list(pool.map(one, zip(keys, outs, strict=True)))
                return time.perf_counter() - t

            def raw_remove(keys: list[ChunkKey]) -> None:
                client.delete_objects(Bucket=server.bucket,
                                      Delete={"Objects": [{"Key": name(k)} for k in keys], "Quiet": True})

            results = run_sizes("s3", tier, plan, raw_set=raw_set, raw_get=raw_get, raw_remove=raw_remove)
        finally:
            tier.close()
            pool.shutdown()
    return {"server": "SeaweedFS S3 gateway", "sizes": results}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """The S3 tier takes its credentials from boto3's chain: this process's environment, here."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- d. Mooncake Store ---------------------------------------------------------------------------

def bench_mooncake(plan: list[Step]) -> dict:
    largest = max(size * batch for size, batch, _ in plan)
    store = MooncakeStore(segment_mb=4 * largest // MiB + 256, lease_ms=MOONCAKE_DEFAULT_LEASE_MS)
    client = None
    tier = None
    try:
        store.start()  # in the try: a start that fails leaves its processes running
        client = store.client()
        tier = open_tier(store.url("bench", local_buffer_mb=str(4 * largest // MiB + 64), timeout_s="60"))
        registered: dict[int, torch.Tensor] = {}  # held: a freed buffer's range could come back

        def pointers(tensors: list[torch.Tensor]) -> list[int]:
            for t in tensors:  # the raw client's buffers, registered once each
                if t.data_ptr() not in registered:
                    assert client.register_buffer(t.data_ptr(), t.nbytes) == 0
                    registered[t.data_ptr()] = t
            return [t.data_ptr() for t in tensors]

        def name(key: ChunkKey) -> str:
            return f"bench-raw/{key.chunk_hash.hex()}"

        def raw_set(keys: list[ChunkKey], chunks: list[torch.Tensor]) -> float:
            names, ptrs, sizes = [name(k) for k in keys], pointers(chunks), [c.nbytes for c in chunks]
            t = time.perf_counter()
            codes = client.batch_put_from(names, ptrs, sizes)
            elapsed = time.perf_counter() - t
            assert all(code == 0 for code in codes), codes
            return elapsed

        def raw_get(keys: list[ChunkKey], outs: list[torch.Tensor]) -> float:
            names, ptrs, sizes = [name(k) for k in keys], pointers(outs), [o.nbytes for o in outs]
            t = time.perf_counter()
            got = client.batch_get_into(names, ptrs, sizes)
            elapsed = time.perf_counter() - t
            assert list(got) == sizes, got
            return elapsed

        def raw_remove(keys: list[ChunkKey]) -> None:
            client.batch_remove([name(k) for k in keys], True)

        results = run_sizes("mooncake", tier, plan, raw_set=raw_set, raw_get=raw_get, raw_remove=raw_remove)
    finally:
        if tier is not None:
            tier.close()
        if client is not None:
            client.close()
        store.stop()
    return {"server": "mooncake_master + one storage node (TCP)", "sizes": results}
