#!/usr/bin/env python
"""Network-tier benchmark: the Redis, v1 remote, S3 and Mooncake Store tiers against same-run raw
baselines.

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
of 16 x 512 KiB). Parts c (S3) and d (Mooncake Store): `remote_stores.py`, sizes up to 8 MiB.
Part e (`remote_promotion.py`): the daemon's read-through from each tier (disk, Redis, S3,
Mooncake Store), the LOOKUP latency of a 32-chunk promotion and of one chunk; no target.
`--parts` picks the parts (default: all five). Prints a table, writes remote.json and remote.png
to --out. Parts a and b take about 1.5 minutes on 2 cores, e about 1.5; --quick is a smoke run
with smaller batches and sizes.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import socket
import struct
import time
from multiprocessing.connection import Connection
from pathlib import Path

import redis
import remote_promotion
import torch
from harness import figure, finish, parse, parser, scratch
from harness.tier_timing import (
    DIRECTIONS,
    FULL,
    QUICK,
    TARGET,
    TIMEOUT_S,
    GiB,
    MiB,
    Op,
    Step,
    alternate,
    check_exact,
    chunk_keys,
    label,
    make_chunks,
    make_outs,
    rounds_for,
    summarize,
    tier_get,
    tier_set,
    verify_tier,
)
from remote_stores import bench_mooncake, bench_s3, plan_for

from lmcache_mp.storage.chunk_format import as_buffer
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.redis import RedisTier
from lmcache_mp.storage.tiers.v1 import V1RemoteTier
from lmcache_mp.testing.servers import redis_server, start_v1_server
from lmcache_mp.v1remote.protocol import recv_exact_into

# One raw-peer request: op (b"S" receive a payload, b"G" send one, b"Y" acknowledge), slot, length.
RAW_HEADER = struct.Struct("<cxxxIQ")


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


PARTS = {"a": "redis", "b": "v1", "c": "s3", "d": "mooncake"}  # e: remote_promotion.py
TITLES = {"redis": "Redis", "v1": "v1 server", "s3": "S3", "mooncake": "Mooncake"}


def plot(result: dict, path: Path) -> None:
    panels = [(part, direction) for part in PARTS.values() if part in result for direction in DIRECTIONS]
    promotion = 2 if "promotion" in result else 0
    columns = max(1, len(panels) + promotion)
    with figure(path, 1, columns, figsize=(3.4 * columns, 3.6), squeeze=False) as axes:
        if promotion:
            remote_promotion.plot(result["promotion"], *axes[0][len(panels):])
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
            ax.set_title(f"{TITLES[part]} {direction}", fontsize=9)
            ax.legend(fontsize=7)


def main() -> int:
    command = parser(__doc__, "a smoke run with small sizes")
    command.add_argument("--parts", default="abcde", help="which measurements to run: a Redis, b v1, "
                         "c S3, d Mooncake Store, e read-through by a daemon (default: abcde)")
    args = parse(command)
    sizes, rounds, min_bytes = (QUICK, 3, 64 * MiB) if args.quick else (FULL, 9, 1 * GiB)
    plan = [(size, batch, rounds_for(size, batch, rounds, min_bytes)) for size, batch in sizes]
    started = time.monotonic()
    result: dict = {"target": TARGET, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "redis-py": redis.__version__, "torch": torch.__version__}
    checks: dict[str, bool] = {}
    with scratch("lmc-remote-") as tmp:
        if "a" in args.parts:
            print("a. Redis tier vs raw pipelined redis-py...", flush=True)
            result["redis"] = bench_redis(tmp, plan)
            report("redis", result["redis"], checks)
        if "b" in args.parts:
            print("\nb. v1 tier vs a raw socket transfer...", flush=True)
            result["v1"] = bench_v1(tmp, plan)
            report("v1", result["v1"], checks)
        if "c" in args.parts:
            print("\nc. S3 tier vs botocore's own PutObject / GetObject...", flush=True)
            result["s3"] = bench_s3(plan_for(plan, args.quick))
            report("s3", result["s3"], checks)
        if "d" in args.parts:
            print("\nd. Mooncake Store tier vs the client's zero-copy batch calls...", flush=True)
            result["mooncake"] = bench_mooncake(plan_for(plan, args.quick))
            report("mooncake", result["mooncake"], checks)
        if "e" in args.parts:
            print("\ne. read-through by a daemon: LOOKUPs that promote chunks from each tier...", flush=True)
            result["promotion"] = remote_promotion.bench_promotion(tmp, args.quick)
            remote_promotion.report(result["promotion"], result)
    result["seconds"] = time.monotonic() - started
    result["checks"] = checks
    finish(args.out, "remote", checks, result, lambda path: plot(result, path),
           note=f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
