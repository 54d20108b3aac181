"""bench_remote.py's part e: read-through by a real daemon, per tier. The figure a user's returning
prompt sees: the latency of one LOOKUP that promotes 32 chunks from the tier into the pool, and of
one that promotes a single chunk.

The path (bench_tiers.py part b's, on every tier at once): a daemon started with `--l2 URL`, a
registered worker STOREs 32 chunks in one request (8192 tokens), the daemon writes them behind to
its tier, the pool is CLEARed, and a LOOKUP with a request id (the scheduler adapter's: hits are
leased; then end_session) finds them in the tier, reads them, verifies them and commits them to the
pool. Timed: the LOOKUP from its submit to its answer. Per tier, after one untimed warm-up pass:

  - `reps` LOOKUPs of all 32 chunks, each after a CLEAR;
  - `reps_one` passes of 32 LOOKUPs of one chunk each (chunk k alone, its own two block hashes),
    one CLEAR per pass: what one chunk costs when it is all a LOOKUP reads. Printed beside the
    32-chunk median / 32, what a chunk costs inside a batch.

Checked, outside the timing: every LOOKUP hit all it asked for, the first one's hits were leased,
STATUS promotions_total grew by exactly the chunks asked in each pass, the write-behind skipped
nothing, and once per tier, after the timed passes, the chunks of a 32-chunk promotion RETRIEVEd
into a zeroed cache equal what was stored, byte for byte.

Chunks: 256 tokens of 32 layers x 2 KV heads x 128 x bf16 x K and V (one rank of an 8B model at
TP=4): 8 MiB, the largest size of parts c and d; 256 MiB a promotion (--quick: 2 layers, 512 KiB).
Tiers, each with its own server and daemon, all up at once, each round's passes taking the tiers in
turn, who goes first rotating (a busy machine slows them alike): disk (`disk://`; its reads come
from a warm page cache), Redis (`redis-server`, no persistence), S3 (SeaweedFS's gateway), Mooncake
Store (master and one storage node, TCP; the master's default read lease). The
network tiers' timeout_s is bench_remote's 30 s (a busy 2-core machine must not take a tier down
mid-pass); Mooncake's read buffer is the tier's default (1 GiB: 4 promotions). No target: reported.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_data_plane import BLOCK, CHUNK, DTYPE, Geometry, make_kv
from bench_tiers import Worker, clear_pool, stop, tier, timed_lookup
from harness import percentile
from harness.tier_timing import TIMEOUT_S, GiB, MiB, label

from lmcache_mp.testing.launcher import DaemonProcess, start_daemon
from lmcache_mp.testing.launcher import daemon_status as status
from lmcache_mp.testing.servers import MOONCAKE_DEFAULT_LEASE_MS, MooncakeStore, redis_server, s3_server
from vllm_adapter import LMCacheMPSchedulerAdapter

CHUNKS = 32  # one LOOKUP's promotion: an 8192-token prompt
KV_HEADS = 2
PREFIX = "bench-promotion"
WRITTEN_TIMEOUT_S = 300.0  # SeaweedFS takes ~0.05-0.1 GB/s of writes on 2 busy cores


@dataclass(frozen=True)
class Plan:
    layers: int  # sets the chunk's size: layers x 256 KiB
    reps: int  # timed 32-chunk LOOKUPs per tier
    reps_one: int  # timed passes of 32 one-chunk LOOKUPs per tier

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.layers, KV_HEADS, BLOCK, CHUNKS * CHUNK // BLOCK)

    @property
    def chunk_bytes(self) -> int:
        g = self.geometry
        return g.layers * g.blocks_per_chunk * math.prod(g.page_shape) * DTYPE.itemsize


FULL_PLAN = Plan(layers=32, reps=11, reps_one=3)
QUICK_PLAN = Plan(layers=2, reps=2, reps_one=1)


# ---- the stores, each as a tier URL --------------------------------------------------------------

@dataclass(frozen=True)
class Store:
    url: str
    env: dict[str, str]  # the daemon's environment for it (the S3 credential chain)
    server: str


StoreFactory = Callable[[Path, int], AbstractContextManager[Store]]  # (scratch, bytes of a promotion)


@contextmanager
def disk_store(tmp: Path, nbytes: int) -> Iterator[Store]:
    yield Store(f"disk://{tmp / 'e-disk-objects'}?size_gb={2 * nbytes / GiB + 0.1:.2f}", {},
                "local disk, page cache warm")


@contextmanager
def redis_store(tmp: Path, nbytes: int) -> Iterator[Store]:
    with redis_server(tmp / "e-redis-server", "--maxmemory", str(2 * nbytes + 256 * MiB),
                      "--maxmemory-policy", "noeviction") as server:
        yield Store(f"redis://127.0.0.1:{server.port}/0?timeout_s={TIMEOUT_S}&prefix={PREFIX}", {},
                    "redis-server")


@contextmanager
def s3_store(tmp: Path, nbytes: int) -> Iterator[Store]:
    with s3_server(PREFIX, "-volume.max=0") as server:  # as many volumes as the disk holds
        yield Store(server.url(PREFIX, timeout_s=str(TIMEOUT_S)), server.env(), "SeaweedFS S3 gateway")


@contextmanager
def mooncake_store(tmp: Path, nbytes: int) -> Iterator[Store]:
    store = MooncakeStore(segment_mb=2 * nbytes // MiB + 256, lease_ms=MOONCAKE_DEFAULT_LEASE_MS)
    try:  # stopped however its start ends: a start that fails leaves its processes running
        store.start()
        yield Store(store.url(PREFIX, timeout_s=str(TIMEOUT_S)), {},  # its default read buffer
                    "mooncake_master + one storage node (TCP)")
    finally:
        store.stop()


STORES: dict[str, StoreFactory] = {"disk": disk_store, "redis": redis_store, "s3": s3_store,
                                   "mooncake": mooncake_store}


# ---- one tier: its daemon, a worker and a scheduler ---------------------------------------------

@dataclass
class TierRun:
    name: str
    plan: Plan
    store: Store
    daemon: DaemonProcess
    worker: Worker
    scheduler: LMCacheMPSchedulerAdapter
    buffer: torch.Tensor  # the worker's whole KV allocation (its layers are views of it)
    hashes: list[bytes]
    lookup_32_s: list[float] = field(default_factory=list)
    lookup_1_s: list[float] = field(default_factory=list)
    written_s: float = 0.0
    passes: int = 0

    @property
    def ids(self) -> list[int]:
        return list(range(len(self.hashes)))

    def fill(self) -> None:
        """STORE the 32 chunks; wait until the write-behind has written them all (timed, once)."""
        t = time.monotonic()
        self.worker.store("e-store", self.ids, self.hashes)
        deadline = t + WRITTEN_TIMEOUT_S
        while (s := tier(self.daemon.url)).writes_total < CHUNKS or s.write_queue_chunks:
            assert time.monotonic() < deadline, f"{self.name}: write-behind not done: {s}"
            time.sleep(0.01)
        self.written_s = time.monotonic() - t
        assert s.writes_total == CHUNKS and s.skipped_writes_total == 0 and s.write_errors_total == 0, s

    def promote_all(self, timed: bool = True) -> None:
        """CLEAR, then one LOOKUP of the 32 chunks."""
        def one(rid: str) -> None:
            seconds, hit = timed_lookup(self.scheduler, rid, self.hashes)
            assert hit == CHUNKS * CHUNK, f"{self.name}: the LOOKUP hit {hit} tokens"
            if not timed:
                assert status(self.daemon.url).leases == CHUNKS, f"{self.name}: the hits are not leased"
            self.scheduler.end_session(rid)
            if timed:
                self.lookup_32_s.append(seconds)

        self._pass(one)

    def promote_each(self) -> None:
        """CLEAR, then 32 LOOKUPs of one chunk each."""
        def each(rid: str) -> None:
            for k in range(CHUNKS):
                seconds, hit = timed_lookup(self.scheduler, f"{rid}-{k}", self._chunk_hashes(k))
                assert hit == CHUNK, f"{self.name}: the LOOKUP of chunk {k} hit {hit} tokens"
                self.scheduler.end_session(f"{rid}-{k}")
                self.lookup_1_s.append(seconds)

        self._pass(each)

    def verify(self) -> int:
        """One more 32-chunk promotion, RETRIEVEd into a zeroed cache: the stored bytes, exactly."""
        original = self.buffer.clone()
        self.buffer.zero_()

        def retrieved(rid: str) -> None:
            _, hit = timed_lookup(self.scheduler, rid, self.hashes)
            assert hit == CHUNKS * CHUNK, f"{self.name}: the LOOKUP hit {hit} tokens"
            self.worker.retrieve(rid, self.ids, self.hashes)
            self.scheduler.end_session(rid)

        self._pass(retrieved)
        assert torch.equal(self.buffer.view(torch.int16), original.view(torch.int16)), \
            f"{self.name}: promoted chunks differ from the stored ones"
        return CHUNKS * self.plan.chunk_bytes

    def _pass(self, lookups: Callable[[str], None]) -> None:
        """`lookups(rid)` on an empty pool; asserts that they promoted the 32 chunks, no more."""
        clear_pool(self.daemon.url, CHUNKS)
        before = tier(self.daemon.url).promotions_total
        self.passes += 1
        lookups(f"e{self.passes}")
        grew = tier(self.daemon.url).promotions_total - before
        assert grew == CHUNKS, f"{self.name}: promotions_total grew by {grew}, expected {CHUNKS}"

    def _chunk_hashes(self, k: int) -> list[bytes]:
        per = CHUNK // BLOCK
        return self.hashes[k * per:(k + 1) * per]

    def figures(self, verified: int) -> dict:
        nbytes = CHUNKS * self.plan.chunk_bytes
        full, one = self.lookup_32_s, self.lookup_1_s
        after = tier(self.daemon.url)
        return {
            "server": self.store.server, "url": self.store.url, "chunks": CHUNKS,
            "chunk_bytes": self.plan.chunk_bytes, "verified_bytes": verified,
            "lookup_32": {"median_ms": statistics.median(full) * 1e3, "p90_ms": percentile(full, 90) * 1e3,
                          "gbps": nbytes / statistics.median(full) / 1e9, "n": len(full),
                          "samples_ms": [s * 1e3 for s in full]},
            "lookup_1": {"median_ms": statistics.median(one) * 1e3, "p90_ms": percentile(one, 90) * 1e3,
                         "gbps": self.plan.chunk_bytes / statistics.median(one) / 1e9, "n": len(one),
                         "samples_ms": [s * 1e3 for s in one]},
            "per_chunk_of_32_ms": statistics.median(full) * 1e3 / CHUNKS,
            "written_behind_s": self.written_s, "written_behind_gbps": nbytes / self.written_s / 1e9,
            "tier_after": {"promotions_total": after.promotions_total, "hits_total": after.hits_total,
                           "misses_total": after.misses_total, "corrupt_total": after.corrupt_total,
                           "errors_total": after.errors_total, "up": after.up},
        }


@contextmanager
def tier_run(name: str, tmp: Path, plan: Plan) -> Iterator[TierRun]:
    """The tier's store, a daemon over it, a registered worker and a scheduler adapter; all
    stopped at the end, in reverse."""
    nbytes = CHUNKS * plan.chunk_bytes
    pool_gb = max(0.1, 1.5 * nbytes / GiB)
    with STORES[name](tmp, nbytes) as store, ExitStack() as stack:
        (tmp / f"e-{name}").mkdir()
        daemon = start_daemon(tmp / f"e-{name}", "--l1-size-gb", f"{pool_gb:.2f}", "--chunk-size", str(CHUNK),
                              "--l2", store.url, "--l2-queue-gb", f"{pool_gb:.2f}", env=store.env,
                              ready_timeout=60)
        stack.callback(stop, daemon)
        buffer, kv = make_kv(plan.geometry)
        worker = Worker(daemon.url, kv)
        stack.callback(worker.close)
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "bench", 1, 0, BLOCK)
        stack.callback(scheduler.shutdown)
        hashes = [hashlib.sha256(f"e-{name}-{b}".encode()).digest() for b in range(plan.geometry.num_blocks)]
        yield TierRun(name, plan, store, daemon, worker, scheduler, buffer, hashes)


def enter_together(stack: ExitStack, contexts: list[AbstractContextManager[TierRun]]) -> list[TierRun]:
    """Enter `contexts` at once, each on a thread of its own (starting a store and a daemon is
    mostly waiting: ~20 s one after the other), those entered left to `stack` to exit; the first
    failure is raised once all have ended."""
    with ThreadPoolExecutor(len(contexts), thread_name_prefix="bench-promotion-start") as pool:
        futures = [pool.submit(context.__enter__) for context in contexts]
    for context, future in zip(contexts, futures, strict=True):
        if future.exception() is None:
            stack.push(context)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def rotated(runs: list[TierRun], r: int) -> list[TierRun]:
    return runs[r % len(runs):] + runs[:r % len(runs)]


def bench_promotion(tmp: Path, quick: bool) -> dict:
    plan = QUICK_PLAN if quick else FULL_PLAN
    with ExitStack() as stack:
        print(f"  starting the stores and their daemons: {', '.join(STORES)}...", flush=True)
        runs = enter_together(stack, [tier_run(name, tmp, plan) for name in STORES])
        for run in runs:
            print(f"  {run.name}: STORE of {CHUNKS} x {label(plan.chunk_bytes)}, written behind...",
                  flush=True)
            run.fill()
            run.promote_all(timed=False)  # warm-up; checks the leases
        print(f"  {plan.reps} rounds of one {CHUNKS}-chunk LOOKUP per tier, then {plan.reps_one} of "
              f"{CHUNKS} one-chunk LOOKUPs...", flush=True)
        for r in range(plan.reps):
            for run in rotated(runs, r):
                run.promote_all()
        for r in range(plan.reps_one):
            for run in rotated(runs, r):
                run.promote_each()
        tiers = {run.name: run.figures(run.verify()) for run in runs}
    for name, row in tiers.items():
        after = row["tier_after"]
        assert after["corrupt_total"] == 0 and after["errors_total"] == 0 and after["up"] == 1, (name, after)
    return {"chunks": CHUNKS, "chunk_bytes": plan.chunk_bytes, "reps": plan.reps, "reps_one": plan.reps_one,
            "tiers": tiers}


# ---- report ----------------------------------------------------------------------------------------

def raw_get_gbps(result: dict, tier_name: str, chunk_bytes: int) -> float | None:
    """The tier's raw client GET, GB/s, from parts a, c, d of this run at the same chunk size."""
    row = result.get(tier_name, {}).get("sizes", {}).get(chunk_bytes)
    return row["GET"]["raw_gbps"] if row else None


def report(e: dict, result: dict) -> None:
    nbytes = e["chunks"] * e["chunk_bytes"]
    print(f"\ne. read-through by a daemon: a LOOKUP that promotes {e['chunks']} chunks of "
          f"{label(e['chunk_bytes'])} ({nbytes / MiB:.0f} MiB) from the tier into the pool (median and "
          f"p90 of {e['reps']}), and LOOKUPs of one chunk ({e['reps_one']} x {e['chunks']}); "
          "raw GET: the tier's own client, parts a-d, batches of the same chunks")
    print(f"{'tier':<10}{'32 chunks: p50 ms':>18}{'p90 ms':>8}{'GB/s':>7}{'1 chunk: p50 ms':>17}{'p90 ms':>8}"
          f"{'32-chunk p50/32':>17}{'raw GET GB/s':>14}{'written behind':>16}")
    for name, row in e["tiers"].items():
        full, one = row["lookup_32"], row["lookup_1"]
        raw = raw_get_gbps(result, name, e["chunk_bytes"])
        print(f"{name:<10}{full['median_ms']:>18.1f}{full['p90_ms']:>8.1f}{full['gbps']:>7.2f}"
              f"{one['median_ms']:>17.2f}{one['p90_ms']:>8.2f}{row['per_chunk_of_32_ms']:>17.2f}"
              f"{'-' if raw is None else f'{raw:.2f}':>14}{row['written_behind_s']:>13.2f} s")
    verified = sum(row["verified_bytes"] for row in e["tiers"].values())
    print(f"every pass promoted exactly {e['chunks']} chunks (STATUS promotions_total); verified "
          f"{verified / MiB:.0f} MiB of promoted chunks byte for byte; written behind: from the STORE "
          "to the tier's last write")


def plot(e: dict, latency_ax: Any, chunk_ax: Any) -> None:
    """Two panels: the 32-chunk LOOKUP's median (bar) and p90 (tick) per tier; per chunk, the
    one-chunk LOOKUP's median beside the 32-chunk median / 32."""
    names = list(e["tiers"])
    xs = range(len(names))
    full = [e["tiers"][n]["lookup_32"] for n in names]
    latency_ax.bar(xs, [f["median_ms"] for f in full], 0.6, color="#ff7f0e", label="median")
    latency_ax.scatter(xs, [f["p90_ms"] for f in full], marker="_", s=200, color="k", label="p90")
    for x, f in zip(xs, full, strict=True):
        latency_ax.annotate(f"{f['gbps']:.2f} GB/s", (x, f["median_ms"]), ha="center", va="bottom",
                            fontsize=7)
    latency_ax.set_xticks(list(xs), names, fontsize=7)
    latency_ax.set_ylabel("ms")
    latency_ax.set_title(f"e. LOOKUP promoting {e['chunks']} x {label(e['chunk_bytes'])}", fontsize=9)
    latency_ax.legend(fontsize=7)
    one = [e["tiers"][n]["lookup_1"]["median_ms"] for n in names]
    share = [e["tiers"][n]["per_chunk_of_32_ms"] for n in names]
    chunk_ax.bar([x - 0.2 for x in xs], one, 0.4, color="#2ca02c", label="1-chunk LOOKUP")
    chunk_ax.bar([x + 0.2 for x in xs], share, 0.4, color="#ff7f0e",
                 label=f"{e['chunks']}-chunk LOOKUP / {e['chunks']}")
    chunk_ax.set_xticks(list(xs), names, fontsize=7)
    chunk_ax.set_ylabel("ms per chunk (median)")
    chunk_ax.set_title(f"e. per chunk of {label(e['chunk_bytes'])}", fontsize=9)
    chunk_ax.legend(fontsize=7)
