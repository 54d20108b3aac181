#!/usr/bin/env python
"""Tier benchmark: the disk tier (--l2 disk://) against same-run baselines.

    .venv/bin/python scripts/bench/bench_tiers.py [--out bench-out] [--quick]

Worker geometry of bench_data_plane.py: KV in vLLM's CPU layout (CPU_ATTN), 32 layers, 8 KV
heads, head size 128, bf16, 128-token blocks, 256-token chunks (32 MiB per chunk), a
registered worker, 8 chunks (256 MiB) per request. Three measurements:

  a. STORE with the disk tier vs without: two daemons (one with `--l2 disk://...`, default
     write-behind queue of a quarter of the pool), the same STOREs of fresh keys, in blocks
     that alternate between the daemons (order swapped every round; before each block the
     disk daemon's write queue has drained, so one daemon's write-behind never runs during
     the other's block, only during its own). Two paces: a 40 ms pause between requests
     (about a vLLM step) and back to back. Target: STORE p50 latency with the disk tier
     within 10% of without (write-behind is off the request path). Reports whether the
     write-behind kept up (writes, skipped writes, objects on disk).
  b. Promotion from disk vs a plain read: N chunks stored and written to disk, the pool
     CLEARed, then LOOKUPs with request ids (the scheduler adapter, so hits are leased; then
     end_session) that read the chunks back, verify them and put them into the pool. GB/s of
     promoted payload vs a plain single-threaded read (open + preadv into one preallocated
     buffer) of the same files, same order, same run; page cache warm, and cold (every file
     fdatasync'ed and dropped with POSIX_FADV_DONTNEED before each pass of either). Target:
     promotion >= 70% of the plain read's GB/s. Asserts the lookups hit N chunks, STATUS
     promotions_total grew by N, and (once, after the timed passes) that promoted bytes
     RETRIEVEd into a zeroed cache equal what was stored.
  c. Start with 100,000 chunks on disk: `DiskTier(root, capacity)` construction (the
     re-index from the listing) and a daemon's time to serve (engine built, pool ready: it
     answers HELLO before its engine re-indexes) with that directory vs with an empty one.
     No target: reported.

Prints a table, writes tiers.png and tiers.json to --out. About 2 minutes on 2 cores;
--quick is a smoke run with small sizes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_data_plane import (
    BLOCK,
    BLOCKS_PER_CHUNK,
    CHUNK,
    CHUNKS_PER_REQUEST,
    HEAD,
    KV_HEADS,
    LAYERS,
    NUM_BLOCKS,
    block_ids,
    make_kv,
    request_bytes,
)
from harness import figure, finish, parse, parser

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.storage.tiers.disk import DiskTier, object_name
from lmcache_mp.testing.launcher import DaemonProcess, start_daemon
from lmcache_mp.testing.launcher import daemon_status as status
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

CHUNK_BYTES = request_bytes() // CHUNKS_PER_REQUEST
GiB = 1 << 30
# The format the daemon gives our worker's chunks (to find their files on disk).
FMT = ChunkFormat("bench", 1, 0, "CPU_ATTN", "bfloat16", LAYERS, (KV_HEADS, BLOCK, 2 * HEAD), CHUNK)


# ---- helpers -----------------------------------------------------------------------------------

def tier(url: str) -> Any:
    """The daemon's one lower tier in STATUS (fields of `chunks.TierStats`)."""
    (only,) = status(url).tiers
    return only


def wait_written(url: str, objects: int | None = None, timeout_s: float = 120) -> tuple[Any, float]:
    """Until the write queue is empty (and the tier holds `objects` chunks); also how long it took."""
    start = time.monotonic()
    while True:
        t = tier(url)
        if t.write_queue_chunks == 0 and (objects is None or t.objects == objects):
            return t, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"write-behind not done after {timeout_s} s: {t}")
        time.sleep(0.01)


def hashes_for(tag: str, it: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{it}-{b}".encode()).digest()
            for b in range(CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK)]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def stop(daemon: DaemonProcess) -> None:
    rc = daemon.stop(timeout=60)  # SIGTERM: the daemon finishes its queued writes first
    if rc != 0 or "Traceback" in daemon.log():
        raise RuntimeError(f"daemon exited with {rc}:\n{daemon.log()[-3000:]}")


class Worker:
    """A registered worker adapter on its own KV cache, storing requests of 8 chunks."""

    def __init__(self, url: str, kv: dict[str, torch.Tensor]):
        self.url = url
        self.kv = kv
        self.adapter = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, BLOCK)
        self.adapter.register_kv_caches(kv, "CPU_ATTN")
        assert self.adapter.instance_id in status(url).registered_instances, "worker not registered"

    def store(self, request_id: str, ids: list[int], hashes: list[bytes]) -> float:
        keys = self.adapter._keys.keys_for(request_id, LoadStoreOp(ids, block_hashes=hashes))
        t = time.perf_counter()
        result = self.adapter.mq_client.submit(
            RequestType.STORE, [keys, self.adapter.instance_id, ids, b""]).result(60)
        elapsed = time.perf_counter() - t
        assert all(o == 0 for o in result.outcomes), result.outcomes  # every chunk STORED
        return elapsed

    def retrieve(self, request_id: str, ids: list[int], hashes: list[bytes]) -> None:
        keys = self.adapter._keys.keys_for(request_id, LoadStoreOp(ids, block_hashes=hashes))
        reply = self.adapter.mq_client.submit(
            RequestType.RETRIEVE, [keys, self.adapter.instance_id, ids, b""]).result(60)
        assert reply.ok, reply.reason

    def close(self) -> None:
        self.adapter.shutdown()


def quiet(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


# ---- a. STORE with and without the disk tier ---------------------------------------------------

def bench_store(tmp: Path, rounds: int, per_block: int, paces: dict[str, float], l1_gb: float) -> dict:
    disk = tmp / "a-disk"
    attempted = rounds * per_block * len(paces) + 1
    size_gb = attempted * request_bytes() / GiB * 1.1 + 1  # every chunk fits: no eviction
    (tmp / "a1").mkdir()
    (tmp / "a2").mkdir()
    with_disk = start_daemon(tmp / "a1", "--l1-size-gb", str(l1_gb), "--chunk-size", str(CHUNK),
                             "--l2", f"disk://{disk}?size_gb={size_gb:.1f}")
    plain = start_daemon(tmp / "a2", "--l1-size-gb", str(l1_gb), "--chunk-size", str(CHUNK))
    daemons = {"disk tier": with_disk, "no disk tier": plain}
    workers: dict[str, Worker] = {}
    lat: dict[str, dict[str, list[float]]] = {p: {d: [] for d in daemons} for p in paces}
    drain: dict[str, list[float]] = {p: [] for p in paces}
    # per pace: chunks written, chunks skipped (queue full), seconds from block start to drained
    written: dict[str, list[float]] = {p: [0, 0, 0.0] for p in paces}
    counter = 0
    try:
        for name, daemon in daemons.items():
            workers[name] = Worker(daemon.url, make_kv()[1])
            workers[name].store(f"warm-{name}", block_ids(0), hashes_for(f"warm-{name}", 0))
        wait_written(with_disk.url)
        for pace, pause_s in paces.items():
            for r in range(rounds):
                order = list(daemons) if r % 2 == 0 else list(daemons)[::-1]
                for name in order:
                    before, _ = wait_written(with_disk.url)  # no block overlaps another's write-behind
                    started = time.monotonic()
                    for _ in range(per_block):
                        counter += 1
                        lat[pace][name].append(workers[name].store(
                            f"a{counter}", block_ids(counter), hashes_for(name, counter)))
                        if pause_s:
                            time.sleep(pause_s)
                    if name == "disk tier":  # how far behind the writer is at the block's end
                        after, drained_s = wait_written(with_disk.url)
                        drain[pace].append(drained_s)
                        w = written[pace]
                        w[0] += after.writes_total - before.writes_total
                        w[1] += after.skipped_writes_total - before.skipped_writes_total
                        w[2] += time.monotonic() - started
        final, _ = wait_written(with_disk.url)
        assert not status(plain.url).tiers
    finally:
        for w in workers.values():
            w.close()
        for daemon in daemons.values():
            stop(daemon)
        quiet(disk)
    nbytes = request_bytes()
    out: dict = {"paces_s": paces, "requests_per_block": per_block, "rounds": rounds,
                 "disk_tier": {"writes_total": final.writes_total, "objects": final.objects,
                               "skipped_writes_total": final.skipped_writes_total,
                               "write_errors_total": final.write_errors_total,
                               "evictions_total": final.evictions_total,
                               "chunks_stored": (counter // 2 + 1) * CHUNKS_PER_REQUEST,
                               "capacity_gb": size_gb},
                 "results": {}}
    for pace in paces:
        row = {}
        for name in daemons:
            s = lat[pace][name]
            row[name] = {"p50_ms": pct(s, 0.5) * 1e3, "p90_ms": pct(s, 0.9) * 1e3,
                         "gbps": nbytes / pct(s, 0.5) / 1e9, "n": len(s), "samples_ms": [x * 1e3 for x in s]}
        row["p50_ratio"] = row["disk tier"]["p50_ms"] / row["no disk tier"]["p50_ms"]
        row["p90_ratio"] = row["disk tier"]["p90_ms"] / row["no disk tier"]["p90_ms"]
        row["drain_after_block_s"] = drain[pace]
        chunks_written, chunks_skipped, seconds = written[pace]
        row["write_behind"] = {"chunks_written": chunks_written, "chunks_skipped": chunks_skipped,
                               "gbps": chunks_written * CHUNK_BYTES / seconds / 1e9}
        out["results"][pace] = row
    return out


# ---- b. promotion from disk vs a plain read ----------------------------------------------------

def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path], buf: memoryview) -> tuple[float, int]:
    """Single-threaded: open + preadv of each whole file into one preallocated buffer."""
    total = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < size:
                n = os.preadv(fd, [buf[done:size]], done)
                assert n > 0
                done += n
            total += size
        finally:
            os.close(fd)
    return time.perf_counter() - t, total


def bench_promotion(tmp: Path, requests: int, passes: int, cold: bool) -> dict:
    n = requests * CHUNKS_PER_REQUEST
    disk = tmp / "b-disk"
    (tmp / "b").mkdir()
    l1_gb = n * CHUNK_BYTES / GiB * 1.25
    daemon = start_daemon(tmp / "b", "--l1-size-gb", f"{l1_gb:.2f}", "--chunk-size", str(CHUNK),
                          "--l2", f"disk://{disk}?size_gb={n * CHUNK_BYTES / GiB * 1.5 + 1:.1f}",
                          "--l2-queue-gb", f"{l1_gb:.2f}")
    worker = scheduler = None
    reqs = [(f"b{i}", block_ids(i), hashes_for("b", i)) for i in range(requests)]
    files = [disk / (nm := object_name(ChunkKey(h, FMT)))[:2] / f"{nm}.kv"
             for _, _, hashes in reqs for h in hashes[BLOCKS_PER_CHUNK - 1::BLOCKS_PER_CHUNK]]
    results: dict[str, dict[str, list[float]]] = {}
    try:
        worker = Worker(daemon.url, make_kv()[1])
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "bench", 1, 0, BLOCK)
        for rid, ids, hashes in reqs:
            worker.store(rid, ids, hashes)
        written, _ = wait_written(daemon.url, objects=n)
        assert written.skipped_writes_total == 0 and written.writes_total == n, written
        missing = [f for f in files if not f.is_file()]
        assert not missing, f"{len(missing)} chunk files not where expected, e.g. {missing[0]}"
        # A torch allocation, like the pool's memory: a malloc'd buffer (bytearray, numpy) reads
        # from the page cache 3x slower on this VM, which would flatter the daemon.
        buf = memoryview(torch.ones(max(f.stat().st_size for f in files), dtype=torch.uint8).numpy())
        caches = ["warm", "cold"] if cold else ["warm"]
        plain_read(files, buf)  # warm the page cache once
        for p in range(passes):
            for cache in caches:
                res = results.setdefault(cache, {"plain_gbps": [], "promotion_gbps": []})
                # alternate which goes first, so neither always follows the other
                for what in (("plain", "promotion") if p % 2 == 0 else ("promotion", "plain")):
                    if cache == "cold":
                        drop_cache(files)
                    if what == "plain":
                        seconds, _ = plain_read(files, buf)
                        res["plain_gbps"].append(n * CHUNK_BYTES / seconds / 1e9)
                    else:
                        res["promotion_gbps"].append(
                            _promote_pass(daemon.url, scheduler, reqs, n, f"{cache}{p}"))
        # Once more, untimed: the promoted bytes are the stored bytes.
        verified = _verify(daemon.url, scheduler, worker, reqs, n)
        final = tier(daemon.url)
    finally:
        if scheduler is not None:
            scheduler.shutdown()
        if worker is not None:
            worker.close()
        stop(daemon)
        quiet(disk)
    out: dict = {"chunks": n, "chunk_bytes": CHUNK_BYTES, "passes": passes, "verified_bytes": verified,
                 "tier_after": {"promotions_total": final.promotions_total, "hits_total": final.hits_total,
                                "corrupt_total": final.corrupt_total, "misses_total": final.misses_total},
                 "results": {}}
    for cache, res in results.items():
        plain, promo = statistics.median(res["plain_gbps"]), statistics.median(res["promotion_gbps"])
        out["results"][cache] = {"plain_gbps": plain, "promotion_gbps": promo, "ratio": promo / plain,
                                 "plain_samples": res["plain_gbps"],
                                 "promotion_samples": res["promotion_gbps"]}
    return out


def clear_pool(url: str, expected: int) -> None:
    client = MessageQueueClient(url)
    try:
        deadline = time.monotonic() + 10
        while status(url).leases:  # end_session is fire and forget
            assert time.monotonic() < deadline, "leases not released"
            time.sleep(0.005)
        # CLEAR leaves pinned chunks, and the pool's sealer pins each new chunk while it checksums it.
        dropped = client.submit(RequestType.CLEAR, []).result(30)
        deadline = time.monotonic() + 30
        while dropped < expected and time.monotonic() < deadline:
            time.sleep(0.01)
            dropped += client.submit(RequestType.CLEAR, []).result(30)
        assert dropped == expected, f"CLEAR dropped {dropped} objects, expected {expected}"
        assert status(url).objects == 0
    finally:
        client.close()


def timed_lookup(scheduler: LMCacheMPSchedulerAdapter, rid: str, hashes: list[bytes]) -> tuple[float, int]:
    t = time.perf_counter()
    scheduler.maybe_submit_lookup_request(rid, block_hashes=hashes)
    scheduler.lookup_futures[rid].wait(60)
    hit = scheduler.check_lookup_result(rid)
    elapsed = time.perf_counter() - t
    scheduler.cleanup_lookup_result(rid)
    return elapsed, hit


def _promote_pass(url: str, scheduler: LMCacheMPSchedulerAdapter, reqs: list, n: int, tag: str) -> float:
    clear_pool(url, n)
    before = tier(url).promotions_total
    seconds = 0.0
    for i, (_, _, hashes) in enumerate(reqs):
        rid = f"{tag}-{i}"
        elapsed, hit = timed_lookup(scheduler, rid, hashes)
        assert hit == CHUNKS_PER_REQUEST * CHUNK, f"lookup hit {hit} tokens"
        if i == 0:
            assert status(url).leases == CHUNKS_PER_REQUEST, "the hits are not leased"
        scheduler.end_session(rid)
        seconds += elapsed
    grew = tier(url).promotions_total - before
    assert grew == n, f"promotions_total grew by {grew}, expected {n}"
    return n * CHUNK_BYTES / seconds / 1e9


def _verify(url: str, scheduler: LMCacheMPSchedulerAdapter, worker: Worker, reqs: list, n: int) -> int:
    """Promote everything once more, RETRIEVE it into a zeroed cache, compare with the original."""
    clear_pool(url, n)
    views = list(worker.kv.values())
    original = [v.clone() for v in views]
    for v in views:
        v.zero_()
    covered: set[int] = set()
    for i, (_, ids, hashes) in enumerate(reqs):
        _, hit = timed_lookup(scheduler, f"verify-{i}", hashes)
        assert hit == CHUNKS_PER_REQUEST * CHUNK
        worker.retrieve(f"verify-{i}", ids, hashes)
        scheduler.end_session(f"verify-{i}")
        covered.update(ids)
    idx = torch.tensor(sorted(covered))
    for v, o in zip(views, original, strict=True):
        assert torch.equal(v[idx].view(torch.int16), o[idx].view(torch.int16)), \
            "promoted chunks differ from the stored ones"
    return n * CHUNK_BYTES


# ---- c. start with 100,000 chunks on disk ------------------------------------------------------

def fill_directory(root: Path, count: int) -> float:
    """`count` valid objects with 64-byte payloads, written straight into place (same files a
    DiskTier would write, without its temp-file-and-rename, to be quick)."""
    from lmcache_mp.storage import chunk_format

    t = time.perf_counter()
    DiskTier(root, GiB).close()  # creates the directory layout
    payload = bytes(64)
    for i in range(count):
        key = ChunkKey(hashlib.sha256(i.to_bytes(8, "little")).digest(), FMT)
        name = object_name(key)
        fd = os.open(root / name[:2] / f"{name}.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, chunk_format.encode_header(key, payload) + payload)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def bench_start(tmp: Path, count: int, repeats: int) -> dict:
    root = tmp / "c-disk"
    empty = tmp / "c-empty"
    try:
        fill_s = fill_directory(root, count)
        reindex = []
        for _ in range(repeats):
            t = time.perf_counter()
            tier_ = DiskTier(root, 10 * GiB)
            reindex.append(time.perf_counter() - t)
            objects = tier_.stats().objects
            tier_.close()
            assert objects == count, f"re-indexed {objects} objects, expected {count}"
        start = {"empty directory": [], f"{count:,} chunks": []}
        logged = []
        for _ in range(repeats):
            for name, d in ((f"{count:,} chunks", root), ("empty directory", empty)):
                run = tmp / f"c-run-{time.monotonic_ns()}"
                run.mkdir()
                t = time.perf_counter()
                daemon = start_daemon(run, "--l1-size-gb", "0.1", "--chunk-size", str(CHUNK),
                                      "--l2", f"disk://{d}?size_gb=10", ready_timeout=120)
                start[name].append(time.perf_counter() - t)
                if d == root:
                    found = tier(daemon.url).objects
                    assert found == count, f"daemon indexed {found} objects, expected {count}"
                    m = re.search(r"indexed (\d+) objects .* in ([\d.]+) s", daemon.log())
                    if m:
                        logged.append(float(m.group(2)))
                stop(daemon)
    finally:
        quiet(root, empty)
    return {"objects": count, "fill_s": fill_s, "reindex_s": reindex,
            "reindex_median_s": statistics.median(reindex), "daemon_reindex_logged_s": logged,
            "daemon_ready_s": start,
            "daemon_ready_median_s": {k: statistics.median(v) for k, v in start.items()}}


# ---- report ------------------------------------------------------------------------------------

def report_store(a: dict, checks: dict[str, bool]) -> None:
    print(f"\na. STORE of {CHUNKS_PER_REQUEST} chunks ({request_bytes() / 2**20:.0f} MiB), fresh keys, "
          f"{a['rounds']} alternating rounds of {a['requests_per_block']} requests per daemon and pace")
    print(f"{'pace':<14}{'daemon':<15}{'p50 ms':>9}{'p90 ms':>9}{'GB/s':>8}{'n':>5}")
    for pace, row in a["results"].items():
        for name in ("no disk tier", "disk tier"):
            r = row[name]
            print(f"{pace:<14}{name:<15}{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}{r['gbps']:>8.2f}{r['n']:>5}")
        wb = row["write_behind"]
        print(f"{'':<14}write-behind: {wb['chunks_written']} chunks written, {wb['chunks_skipped']} skipped "
              f"(queue full), {wb['gbps']:.2f} GB/s; queue drained "
              f"{statistics.median(row['drain_after_block_s']):.2f} s after a block (median)")
        checks[f"a. {pace}: STORE p50 with the disk tier within 10% of without "
               f"({row['p50_ratio'] - 1:+.1%}; p90 {row['p90_ratio'] - 1:+.1%})"] = row["p50_ratio"] <= 1.10
    d = a["disk_tier"]
    print(f"disk tier: {d['chunks_stored']} chunks stored, {d['writes_total']} written, "
          f"{d['skipped_writes_total']} skipped (write queue full), {d['write_errors_total']} write errors, "
          f"{d['evictions_total']} evictions; {d['objects']} objects on disk")


def report_promotion(b: dict, checks: dict[str, bool]) -> None:
    print(f"\nb. promotion of {b['chunks']} chunks ({b['chunks'] * CHUNK_BYTES / GiB:.1f} GiB) by LOOKUPs "
          f"of {CHUNKS_PER_REQUEST} chunks, median of {b['passes']} passes")
    print(f"{'page cache':<12}{'plain read GB/s':>17}{'promotion GB/s':>16}{'ratio':>8}")
    for cache, row in b["results"].items():
        print(f"{cache:<12}{row['plain_gbps']:>17.2f}{row['promotion_gbps']:>16.2f}{row['ratio']:>8.0%}")
        checks[f"b. promotion >= 70% of a plain read, page cache {cache} ({row['ratio']:.0%})"] = \
            row["ratio"] >= 0.7
    print(f"verified {b['verified_bytes'] / GiB:.2f} GiB of promoted chunks byte for byte; "
          f"corrupt {b['tier_after']['corrupt_total']}")


def report_start(c: dict) -> None:
    print(f"\nc. start with {c['objects']:,} chunks on disk (directory filled in {c['fill_s']:.1f} s)")
    print(f"DiskTier() construction (re-index): median {c['reindex_median_s']:.3f} s "
          f"({', '.join(f'{x:.3f}' for x in c['reindex_s'])}); the daemon's own log line: "
          f"{', '.join(f'{x:.3f}' for x in c['daemon_reindex_logged_s'])} s")
    for name, v in c["daemon_ready_s"].items():
        print(f"daemon start to serving, {name}: median {statistics.median(v):.2f} s "
              f"({', '.join(f'{x:.2f}' for x in v)})")


def _bars(ax, labels: list[str], values: list[float], colors: list[str], ylabel: str, title: str) -> None:
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom", fontsize=7)


def plot(result: dict, path: Path) -> None:
    with figure(path, 1, 3, figsize=(12, 3.6)) as axes:
        if "store" in result:
            labels, values, colors = [], [], []
            for pace, row in result["store"]["results"].items():
                for name, color in (("no disk tier", "#999"), ("disk tier", "#1f77b4")):
                    labels.append(f"{pace}\n{name}")
                    values.append(row[name]["p50_ms"])
                    colors.append(color)
            _bars(axes[0], labels, values, colors, "STORE p50 (ms), 256 MiB", "a. STORE, disk tier on vs off")
        if "promotion" in result:
            labels, values, colors = [], [], []
            for cache, row in result["promotion"]["results"].items():
                labels += [f"{cache}\nplain read", f"{cache}\npromotion"]
                values += [row["plain_gbps"], row["promotion_gbps"]]
                colors += ["#999", "#ff7f0e"]
            _bars(axes[1], labels, values, colors, "GB/s", "b. promotion from disk vs plain read")
        if "start" in result:
            c = result["start"]
            labels = ["DiskTier()\nre-index", *[f"daemon ready\n{k}" for k in c["daemon_ready_median_s"]]]
            values = [c["reindex_median_s"], *c["daemon_ready_median_s"].values()]
            _bars(axes[2], labels, values, ["#2ca02c", "#999", "#2ca02c"][:len(values)], "seconds",
                  f"c. start with {c['objects']:,} chunks on disk")


def main() -> int:
    command = parser(__doc__, "a smoke run with small sizes")
    command.add_argument("--no-cold", action="store_true", help="skip the cold-page-cache passes of b")
    command.add_argument("--parts", default="abc", help="which measurements to run (default: abc)")
    args = parse(command)
    q = args.quick
    tmp = Path(tempfile.mkdtemp(prefix="lmc-tiers-", dir="/tmp"))
    print(f"KV cache {LAYERS} layers x {NUM_BLOCKS} blocks; {CHUNK_BYTES / 2**20:.0f} MiB per chunk, "
          f"{request_bytes() / 2**20:.0f} MiB per request; scratch in {tmp}", flush=True)
    result: dict = {}
    checks: dict[str, bool] = {}
    try:
        if "a" in args.parts:
            print("a. STORE with and without the disk tier...", flush=True)
            result["store"] = bench_store(tmp, rounds=2 if q else 4, per_block=2 if q else 10,
                                          paces={"40 ms pause": 0.040, "back to back": 0.0}, l1_gb=3.0)
            report_store(result["store"], checks)
        if "b" in args.parts:
            print("\nb. promotion from disk vs a plain read...", flush=True)
            result["promotion"] = bench_promotion(tmp, requests=2 if q else 8, passes=1 if q else 3,
                                                  cold=not args.no_cold)
            report_promotion(result["promotion"], checks)
        if "c" in args.parts:
            print("\nc. start with many chunks on disk...", flush=True)
            result["start"] = bench_start(tmp, count=5_000 if q else 100_000, repeats=1 if q else 3)
            report_start(result["start"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["checks"] = checks
    finish(args.out, "tiers", checks, result, lambda path: plot(result, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
