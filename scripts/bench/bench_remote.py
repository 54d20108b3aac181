#!/usr/bin/env python
"""Network-tier benchmark: the Redis tier and the v1 remote tier against same-run raw baselines.

    .venv/bin/python scripts/bench/bench_remote.py [--out bench-out] [--quick]

Chunks of 512 KiB, 2 MiB, 8 MiB and 32 MiB (the last is one 256-token chunk of the real layout
of bench_data_plane.py: 32 layers x 8 KV heads x 128 x bf16 x K and V; the others are the same
layout with fewer tokens), in batches of 16 (8 of 32 MiB). Payloads are random bytes in torch
uint8 tensors and reads land in preallocated, touched torch uint8 tensors: the pool's L1 slots,
the path the daemon takes. GB/s counts payload bytes only. Two parts:

  a. Redis: one real `redis-server` (no persistence) on a free loopback port. Baseline: raw
     redis-py (hiredis, as the tier uses it), one `pipeline(transaction=False)` of SETs of
     `bytes` values of the chunk size, `execute()`; then one pipeline of GETs of those keys.
     Tier: `open_tier("redis://...")`, `batched_put([(ChunkKey, chunk), ...])` and
     `batched_get(keys, outs)`, same server, same run.
  b. v1: `lmcache-mp remote-server` as a process, and `open_tier("lmcache://...")`. Baseline:
     a raw socket transfer of the same bytes over loopback TCP to a trivial peer in another
     process (so it shares no GIL with the client, as the server does not): a 16-byte header
     per item, then for SET the payload, which the peer recv_into's a preallocated buffer (one
     slot per item of the batch), acknowledged once per batch; for GET the peer sends each
     item's payload from its slot, and the client recv_into's the out tensor. The tier's SET
     is timed up to the answer of one EXIST sent after the PUTs on the same connection (PUT has
     no reply), so both sides stop the clock once the peer holds every byte.

Per size, the raw and tier transfers alternate within each round (SETs, then GETs; who goes
first swaps every round), after one untimed warm-up round; the figure is the median over the
rounds. Checked, outside the timing: the tier really is RedisTier / V1RemoteTier; each tier GET
raised hits_total by exactly the batch size (hits, not misses), each tier SET writes_total; the
tier's reads are byte-exact (once per size, into zeroed outs), as are the raw GETs. Target:
tier >= 70% of the raw baseline, for GET and for SET, each size; a MET/MISS line each.

Rounds: at least 9 per size, and enough that each side moves 1 GiB per direction (128 rounds
of 16 x 512 KiB). Prints a table, writes remote.json and remote.png to --out. About 1.5 minutes
on 2 cores; --quick is a smoke run with smaller batches and sizes (about 10 s).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import redis
import torch
from harness import figure, finish, parse, parser

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.storage.chunk_format import as_buffer
from lmcache_mp.storage.tiers.base import StorageTier
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.redis import RedisTier
from lmcache_mp.storage.tiers.v1 import V1RemoteTier
from lmcache_mp.testing.servers import redis_server, start_v1_server
from lmcache_mp.v1remote.protocol import recv_exact_into

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
# One raw-peer request: op (b"S" receive a payload, b"G" send one, b"Y" acknowledge), slot, length.
RAW_HEADER = struct.Struct("<cxxxIQ")


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


def alternate(ops: dict[str, dict[str, Op]], rounds: int, nbytes: int,
              verify: Callable[[], None]) -> dict[str, dict[str, list[float]]]:
    """GB/s samples [direction][side]: one untimed warm-up round, then `verify()`, then `rounds`
    rounds of SET then GET, each direction alternating raw and tier, who goes first swapping."""
    samples: dict[str, dict[str, list[float]]] = {d: {s: [] for s in SIDES} for d in DIRECTIONS}
    for r in range(-1, rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
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


# ---- a. Redis ------------------------------------------------------------------------------------

def raw_redis_set(client: redis.Redis, names: list[bytes], values: list[bytes]) -> float:
    t = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for name, value in zip(names, values, strict=True):
        pipe.set(name, value)
    replies = pipe.execute()
    elapsed = time.perf_counter() - t
    assert all(reply is True for reply in replies), replies
    return elapsed


def raw_redis_get(client: redis.Redis, names: list[bytes], size: int) -> float:
    t = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    values = pipe.execute()
    elapsed = time.perf_counter() - t
    assert all(v is not None and len(v) == size for v in values), "raw GET missed"
    return elapsed


def redis_one_size(client: redis.Redis, tier: RedisTier, size: int, batch: int, rounds: int) -> dict:
    chunks = make_chunks(size, batch, seed=size)
    values = [bytes(as_buffer(c)) for c in chunks]  # what a raw redis-py user would hold
    names = [f"bench-remote-raw:{size}:{i}".encode() for i in range(batch)]
    keys = chunk_keys("redis", size, batch)
    outs = make_outs(size, batch)
    ops: dict[str, dict[str, Op]] = {
        "raw": {"SET": lambda: raw_redis_set(client, names, values),
                "GET": lambda: raw_redis_get(client, names, size)},
        "tier": {"SET": lambda: tier_set(tier, keys, chunks),
                 "GET": lambda: tier_get(tier, keys, outs)},
    }

    def verify() -> None:
        verify_tier(tier, keys, chunks, outs)
        assert client.mget(names) == values, "raw GET read back other bytes"

    result = summarize(alternate(ops, rounds, size * batch, verify))
    client.flushall()
    return result


def bench_redis(tmp: Path, plan: list[Step]) -> dict:
    largest = max(size * batch for size, batch, _ in plan)
    maxmemory = 4 * largest + 256 * MiB  # raw and tier copies of a batch, each overwritten in place
    results: dict = {}
    with redis_server(tmp / "redis", "--maxmemory", str(maxmemory), "--maxmemory-policy",
                      "noeviction") as server:
        version = server.cli("INFO", "server")
        client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=TIMEOUT_S)
        tier = open_tier(f"redis://127.0.0.1:{server.port}/0?timeout_s={TIMEOUT_S}&prefix=bench-remote")
        assert isinstance(tier, RedisTier), f"open_tier gave {type(tier).__name__}"
        try:
            for size, batch, rounds in plan:
                print(f"  redis, {batch} x {label(size)}, {rounds} rounds...", flush=True)
                results[size] = {"batch": batch, "rounds": rounds,
                                 **redis_one_size(client, tier, size, batch, rounds)}
            final = tier.stats()
        finally:
            tier.close()
            client.close()
    assert final.errors_total == 0 and final.up == 1, final
    server_version = next((line.split(":", 1)[1].strip() for line in version.splitlines()
                           if line.startswith("redis_version:")), "?")
    return {"server": f"redis-server {server_version}", "maxmemory": maxmemory,
            "hiredis": redis.utils.HIREDIS_AVAILABLE, "sizes": results}


# ---- b. v1 remote server -------------------------------------------------------------------------

def raw_peer(conn: Connection, slots: int, slot_bytes: int) -> None:
    """The raw baseline's peer (its own process): one connection, served on this thread."""
    buffer = bytearray(slots * slot_bytes)
    view = memoryview(buffer)
    view[:] = b"\x01" * len(view)  # touched: no page faults in the timed transfers
    head = bytearray(RAW_HEADER.size)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while recv_exact_into(sock, memoryview(head)) == RAW_HEADER.size:
            op, slot, length = RAW_HEADER.unpack(head)
            item = view[slot * slot_bytes:slot * slot_bytes + length]
            if op == b"S":
                assert recv_exact_into(sock, item) == length, "short SET payload"
            elif op == b"G":
                sock.sendall(item)
            else:
                sock.sendall(b"y")


class RawPeer:
    """The raw peer's process and this process's connection to it."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        self.proc = ctx.Process(target=raw_peer, args=(there, slots, slot_bytes), daemon=True,
                                name="bench-remote-raw-peer")
        self.proc.start()
        deadline = time.monotonic() + 60
        while not here.poll(0.05):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the raw peer did not start (exit code {self.proc.exitcode})")
        self.sock = socket.create_connection(("127.0.0.1", here.recv()), timeout=TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, chunks: list[torch.Tensor]) -> float:
        t = time.perf_counter()
        for slot, chunk in enumerate(chunks):
            payload = as_buffer(chunk)
            self.sock.sendall(RAW_HEADER.pack(b"S", slot, len(payload)))
            self.sock.sendall(payload)
        self.sock.sendall(RAW_HEADER.pack(b"Y", 0, 0))
        ack = self.sock.recv(1)
        elapsed = time.perf_counter() - t
        assert ack == b"y", "the raw peer did not acknowledge"
        return elapsed

    def get(self, outs: list[torch.Tensor]) -> float:
        t = time.perf_counter()
        self.sock.sendall(b"".join(RAW_HEADER.pack(b"G", slot, out.numel()) for slot, out in enumerate(outs)))
        for out in outs:
            view = as_buffer(out)
            assert recv_exact_into(self.sock, view) == len(view), "the raw peer closed early"
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def v1_one_size(peer: RawPeer, tier: V1RemoteTier, size: int, batch: int, rounds: int) -> dict:
    chunks = make_chunks(size, batch, seed=size + 1)
    keys = chunk_keys("v1", size, batch)
    outs = make_outs(size, batch)

    def sync() -> None:  # PUT has no reply: an EXIST after it answers once the server holds all
        assert tier.batched_contains(keys[-1:]) == [True], "the last PUT is not on the server"

    ops: dict[str, dict[str, Op]] = {
        "raw": {"SET": lambda: peer.set(chunks), "GET": lambda: peer.get(outs)},
        "tier": {"SET": lambda: tier_set(tier, keys, chunks, sync),
                 "GET": lambda: tier_get(tier, keys, outs)},
    }

    def verify() -> None:
        verify_tier(tier, keys, chunks, outs)
        for out in outs:
            out.zero_()
        peer.get(outs)  # the raw peer sends what it received in the warm-up SETs
        check_exact(outs, chunks, "raw peer")

    return summarize(alternate(ops, rounds, size * batch, verify))


def bench_v1(tmp: Path, plan: list[Step]) -> dict:
    largest = max(size * batch for size, batch, _ in plan)
    size_gb = (2 * largest + 256 * MiB) / GiB  # a batch and its overwrite; older sizes are evicted
    peer = RawPeer(max(batch for _, batch, _ in plan), max(size for size, _, _ in plan))
    try:
        server = start_v1_server(tmp, size_gb=f"{size_gb:.3f}")
    except BaseException:
        peer.close()
        raise
    tier: V1RemoteTier | None = None
    results: dict = {}
    try:
        opened = open_tier(f"lmcache://127.0.0.1:{server.port}?timeout_s={TIMEOUT_S}")
        assert isinstance(opened, V1RemoteTier), f"open_tier gave {type(opened).__name__}"
        tier = opened
        for size, batch, rounds in plan:
            print(f"  v1, {batch} x {label(size)}, {rounds} rounds...", flush=True)
            results[size] = {"batch": batch, "rounds": rounds, **v1_one_size(peer, tier, size, batch, rounds)}
        final = tier.stats()
    finally:
        if tier is not None:
            tier.close()
        peer.close()
        rc = server.stop()  # SIGTERM; checked below, so that a failure above is not masked
    log = server.log()
    assert rc == 0 and "Traceback" not in log, f"remote-server exited with {rc}:\n{log[-3000:]}"
    assert final.errors_total == 0 and final.up == 1, final
    return {"server": "lmcache-mp remote-server", "size_gb": size_gb, "sizes": results}


# ---- report ----------------------------------------------------------------------------------------

def label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def report(name: str, part: dict, checks: dict[str, bool]) -> None:
    print(f"\n{name} ({part['server']}): GB/s of payload, median of the rounds; tier/raw of those "
          "medians, and of each round: median (min-max)")
    print(f"{'chunk':>8}{'batch':>6}{'rounds':>7}  {'dir':<5}{'raw':>7}{'tier':>7}{'tier/raw':>10}"
          f"{'per round':>22}")
    for size, row in part["sizes"].items():
        for direction in DIRECTIONS:
            r = row[direction]
            rounds = (f"{r['round_ratio_median']:.0%} ({r['round_ratio_min']:.0%}-"
                      f"{r['round_ratio_max']:.0%})")
            print(f"{label(size):>8}{row['batch']:>6}{row['rounds']:>7}  {direction:<5}{r['raw_gbps']:>7.2f}"
                  f"{r['tier_gbps']:>7.2f}{r['ratio']:>10.0%}{rounds:>22}")
            checks[f"{name} {direction} {label(size)}: tier {r['tier_gbps']:.2f} GB/s is {r['ratio']:.0%} "
                   f"of raw {r['raw_gbps']:.2f} GB/s (target >= {TARGET:.0%})"] = r["ratio"] >= TARGET


def plot(result: dict, path: Path) -> None:
    panels = [(part, direction) for part in ("redis", "v1") if part in result for direction in DIRECTIONS]
    columns = max(1, len(panels))
    with figure(path, 1, columns, figsize=(3.4 * columns, 3.6), squeeze=False) as axes:
        for ax, (part, direction) in zip(axes[0], panels, strict=False):
            sizes = result[part]["sizes"]
            xs = range(len(sizes))
            raw = [row[direction]["raw_gbps"] for row in sizes.values()]
            tier = [row[direction]["tier_gbps"] for row in sizes.values()]
            ax.bar([x - 0.2 for x in xs], raw, 0.4, color="#999", label="raw")
            ax.bar([x + 0.2 for x in xs], tier, 0.4, color="#1f77b4", label="tier")
            for x, r, t in zip(xs, raw, tier, strict=True):
                ax.annotate(f"{t / r:.0%}", (x + 0.2, t), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(xs), [label(s) for s in sizes], fontsize=7)
            ax.set_ylabel("GB/s")
            ax.set_title(f"{'Redis' if part == 'redis' else 'v1 server'} {direction}", fontsize=9)
            ax.legend(fontsize=7)


def main() -> int:
    command = parser(__doc__, "a smoke run with small sizes")
    command.add_argument("--parts", default="ab", help="which measurements to run (default: ab)")
    args = parse(command)
    sizes, rounds, min_bytes = (QUICK, 3, 64 * MiB) if args.quick else (FULL, 9, 1 * GiB)
    plan = [(size, batch, rounds_for(size, batch, rounds, min_bytes)) for size, batch in sizes]
    tmp = Path(tempfile.mkdtemp(prefix="lmc-remote-", dir="/tmp"))
    started = time.monotonic()
    result: dict = {"target": TARGET, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "redis-py": redis.__version__, "torch": torch.__version__}
    checks: dict[str, bool] = {}
    try:
        if "a" in args.parts:
            print("a. Redis tier vs raw pipelined redis-py...", flush=True)
            result["redis"] = bench_redis(tmp, plan)
            report("redis", result["redis"], checks)
        if "b" in args.parts:
            print("\nb. v1 tier vs a raw socket transfer...", flush=True)
            result["v1"] = bench_v1(tmp, plan)
            report("v1", result["v1"], checks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = time.monotonic() - started
    result["checks"] = checks
    finish(args.out, "remote", checks, result, lambda path: plot(result, path),
           note=f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
