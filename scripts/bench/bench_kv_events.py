#!/usr/bin/env python
"""KV events benchmark: STORE throughput with the event stream off, stalled, and followed.

    .venv/bin/python scripts/bench/bench_kv_events.py [--out bench-out] [--quick] [--geometry 32x8 32x1]

The claim: a slow subscriber cannot slow STOREs (same-run STORE throughput with and without a
stalled subscriber within 5%). Three daemons, the same but for their KV event stream:
  a. no `--kv-events-listen` (the baseline);
  b. `--kv-events-listen ipc://...` with a *stalled* subscriber: a SUB socket connected and
     subscribed that never reads (receive high-water mark 1), and a replay DEALER that asks for
     every kept batch from seq 0 at the start of each of this daemon's blocks and never reads
     the answer either;
  c. `--kv-events-listen ipc://...` with a *live* subscriber: a thread of this process that
     reads and decodes every batch (vLLM's wire schema), as a KV-aware router does.
STOREs go the way vLLM's worker sends them: `LMCacheMPWorkerAdapter.submit_store_request`, then
`wait_for_stores` and `get_finished` (KV in vLLM's CPU layout, registered with the daemon;
bench_data_plane.py's worker), 256-token chunks, 8 chunks per request, every chunk new. Each
daemon's pool holds a fraction of what goes through it: a warm-up fills it, and from then on
every STORE evicts, so the stream carries BlockStored and BlockRemoved events alike.
Every round runs one block of requests per daemon, in an order rotated every round, and after
each block waits until that daemon has settled (its new chunks checksummed, its events published
and read), so that drift falls on all three alike and no daemon's background work runs in
another's block. Throughput per block: bytes (chunks) stored / the sum of its STOREs' times;
reported as medians over the rounds (the first round warms up), with each daemon's CPU time per
chunk (from /proc) over its blocks and their settling.
Geometries (head size 128, bf16): `32x8` as bench_data_plane.py's default (32 layers, 8 KV
heads, 128-token blocks: 32 MiB per chunk, a Llama-3-8B), and `32x1` (32 layers, 1 KV head,
16-token blocks: 4 MiB per chunk, that model at TP=8): 8x the chunks, so 8x the events, per byte.
Checks that the path was exercised (exit code 1 otherwise): every chunk offered was STORED
(/metrics), every daemon evicted; (a) publishes nothing; (b) and (c) published every event their
log recorded (kv_events_published_total == kv_events_seq) and dropped none; (c)'s subscriber
received every batch and event published (a replay from seq 0 fills in the batches published
before it joined), as many BlockStored as chunks stored and BlockRemoved as evictions; (b) was
sent batches it never read and answered its replay requests. Target: (b)/(a) and (c)/(a) >=
--min-ratio (0.95) in GB/s, every geometry (exit code 1 if missed). Prints a table, writes
kv_events.png and kv_events.json to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq
from bench_data_plane import CHUNK, CHUNKS_PER_REQUEST, DTYPE, GEOMETRIES, Geometry, block_ids, make_kv
from harness import figure, finish, parse, parser
from prometheus_client.parser import text_string_to_metric_families

from lmcache_mp.kv_events.log import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from lmcache_mp.protocol import StatusReport
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, free_port, start_daemon
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

GEOMETRIES = {"32x8": GEOMETRIES["32x8"], "32x1": Geometry(32, 1, 16, 192)}
CONFIGS = ("a. no events", "b. stalled subscriber", "c. live subscriber")
BASELINE, STALLED, LIVE = CONFIGS
COLORS = ["#999", "#d62728", "#1f77b4"]
END_SEQ = -1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def chunk_bytes(g: Geometry) -> int:
    return g.layers * g.blocks_per_chunk * math.prod(g.page_shape) * DTYPE.itemsize


def scrape(port: int) -> dict[str, float]:
    """The daemon's /metrics samples, by name and labels ("name{k=v}")."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# ---- the subscribers ------------------------------------------------------------------------------


class Stalled:
    """A subscriber that stopped reading: SUB subscribed to everything, receive HWM 1, never read;
    a replay DEALER that asks for every kept batch and never reads the answer."""

    def __init__(self, pub: str, replay: str):
        self._context = zmq.Context()
        self.sub = self._context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.dealer = self._context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.RCVHWM, 1)
        self.dealer.connect(replay)
        self.replays_asked = 0

    def ask_replay(self) -> None:
        self.dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        self.replays_asked += 1

    def backlog(self) -> int:
        """Drain what is queued for it now (at the end): batches the daemon had sent it."""
        got = 0
        while self.sub.poll(200):
            self.sub.recv_multipart()
            got += 1
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self._context.term()


class Live(threading.Thread):
    """A subscriber that reads and decodes every batch as it comes (a router), counting events."""

    def __init__(self, pub: str, replay: str):
        super().__init__(name="live-subscriber", daemon=True)
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # keeps everything: any loss is the daemon's
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub)
        self._replay = replay
        self._decoder = msgspec.msgpack.Decoder(type=EventBatch)
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self.first_seq: int | None = None  # the first batch it got live
        self.next_seq = 0  # the batch seq it expects next
        self.gaps = 0
        self.batches = 0
        self.replayed = 0  # of them, from the replay socket (`fill_in`)
        self.counts = {"stored": 0, "removed": 0, "cleared": 0}
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            if not self._sub.poll(50):
                continue
            while True:
                try:
                    _, seq, payload = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._apply(int.from_bytes(seq, "big"), payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        with self._lock:
            if self.first_seq is None:
                self.first_seq = self.next_seq = seq
            if seq != self.next_seq:
                self.gaps += 1
            self.next_seq = seq + 1
            self.batches += 1
            self._count(batch)

    def _count(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.counts["stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.counts["removed"] += len(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared), event
                self.counts["cleared"] += 1

    def caught_up(self, batches_published: int) -> bool:
        with self._lock:
            return self.first_seq is not None and self.next_seq == batches_published

    def fill_in(self, timeout_s: float = 30.0) -> None:
        """Replay the batches published before it joined (seq 0 on), as a router that joins late
        does (once it got a live batch; while the replay keeps them all)."""
        with self._lock:
            first = self.first_seq
        assert first is not None, "the live subscriber got nothing"
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self._replay)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay answer from {self._replay} in {timeout_s} s")
                _, _, seq, payload = dealer.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_SEQ:
                    break
                if number < first:
                    with self._lock:
                        self.batches += 1
                        self.replayed += 1
                        self._count(self._decoder.decode(payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        if not self._halt.is_set():
            self._halt.set()
            self.join()
            self._sub.close(linger=0)
            self._context.term()


# ---- the worker -----------------------------------------------------------------------------------


class Worker:
    """A vLLM worker's adapter on one daemon, the benchmark's caches registered with it."""

    def __init__(self, url: str, kv: dict[str, torch.Tensor], g: Geometry, name: str):
        self._g = g
        self._tag = name
        self.adapter = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, g.block)
        self.adapter.register_kv_caches(kv, "CPU_ATTN")
        self.requests = 0  # requests stored so far: each one's chunks are new

    def store(self) -> float:
        """One request's STORE of new chunks, the way vLLM's worker sends it; seconds to its reply."""
        n = self.requests
        self.requests += 1
        ids = block_ids(n, self._g)
        hashes = [hashlib.sha256(f"{self._tag}-{n}-{b}".encode()).digest() for b in range(len(ids))]
        op, rid = LoadStoreOp(ids, block_hashes=hashes), f"{self._tag}-{n}"
        start = time.perf_counter()
        self.adapter.submit_store_request(rid, op, None)
        self.adapter.wait_for_stores([rid], 60)
        elapsed = time.perf_counter() - start
        finished, _ = self.adapter.get_finished({rid})
        assert finished == {rid} and not self.adapter.holds_stores(), (rid, finished)
        return elapsed

    def close(self) -> None:
        self.adapter.shutdown()


# ---- one geometry ---------------------------------------------------------------------------------


class Rig:
    """The three daemons of one geometry, their workers and subscribers."""

    def __init__(self, g: Geometry, tmp: Path, pool_gb: float):
        self.g = g
        self.daemons: dict[str, DaemonProcess] = {}
        self.ports: dict[str, int] = {}
        self.workers: dict[str, Worker] = {}
        self.stalled: Stalled | None = None
        self.live: Live | None = None
        _, kv = make_kv(g)
        try:
            for i, name in enumerate(CONFIGS):
                home = tmp / f"{g.layers}x{g.kv_heads}-{name[0]}"
                home.mkdir()
                self.ports[name] = free_port()
                sock = home / "kv-events.sock"
                events = [] if name == BASELINE else ["--kv-events-listen", f"ipc://{sock}"]
                self.daemons[name] = start_daemon(home, "--l1-size-gb", str(pool_gb), "--chunk-size",
                                                  str(CHUNK), "--metrics-port", str(self.ports[name]),
                                                  *events)
                self.workers[name] = Worker(self.daemons[name].url, kv, g, f"{g.layers}x{g.kv_heads}-{i}")
            self.stalled = Stalled(*self.status(STALLED).kv_events_endpoints)
            self.live = Live(*self.status(LIVE).kv_events_endpoints)
        except BaseException:
            self.close()
            raise

    def status(self, name: str) -> StatusReport:
        return daemon_status(self.daemons[name].url)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Until no daemon works in the background: every new chunk checksummed, every event
        published, and read by the live subscriber."""
        deadline = time.monotonic() + timeout_s
        assert self.live is not None
        for name in CONFIGS:
            while True:
                s = self.status(name)
                published = name == BASELINE or s.kv_events_published_total == s.kv_events_seq
                if (not s.pool_unsealed and published
                        and (name != LIVE or self.live.caught_up(s.kv_events_batches_total))):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: not settled in {timeout_s} s: {s}")
                time.sleep(0.005)

    def close(self) -> None:
        """Subscribers and workers, then the daemons (and their pool files), whatever failed before."""
        try:
            for sub in (self.live, self.stalled):
                if sub is not None:
                    sub.close()
            for worker in self.workers.values():
                worker.close()
        finally:
            for daemon in self.daemons.values():
                try:
                    daemon.stop()
                except Exception:  # stop the others all the same
                    daemon.proc.kill()
                    daemon.proc.wait()
                    daemon.discard_pool()


def run(g: Geometry, tmp: Path, pool_gb: float, rounds: int, per_block: int) -> dict[str, Any]:
    """Blocks of `per_block` requests per daemon, `rounds` + 1 rounds (the first warms up)."""
    nchunk = chunk_bytes(g)
    request = nchunk * CHUNKS_PER_REQUEST
    pool_chunks = int(pool_gb * 2**30) // nchunk
    warm = math.ceil(pool_chunks / CHUNKS_PER_REQUEST) + 1  # requests: then every STORE evicts
    print(f"\n{g.layers} layers x {g.kv_heads} KV heads, {g.block}-token blocks: {nchunk / 2**20:.0f} MiB "
          f"per chunk, {request / 2**20:.0f} MiB per request; pools of {pool_gb} GiB ({pool_chunks} chunks); "
          f"{rounds} rounds of {per_block} requests per daemon after {warm} to fill the pools", flush=True)
    rig = Rig(g, tmp, pool_gb)
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}  # seconds per block
    cpu: dict[str, float] = dict.fromkeys(CONFIGS, 0.0)  # daemon CPU seconds over the timed blocks
    try:
        for worker in rig.workers.values():
            for _ in range(warm):
                worker.store()
        rig.settle()
        assert rig.live is not None
        rig.live.fill_in()
        for r in range(rounds + 1):
            k = r % len(CONFIGS)
            for name in CONFIGS[k:] + CONFIGS[:k]:
                worker, pid = rig.workers[name], rig.daemons[name].proc.pid
                cpu_before = cpu_s(pid)
                if name == STALLED:
                    assert rig.stalled is not None
                    rig.stalled.ask_replay()
                elapsed = sum(worker.store() for _ in range(per_block))
                rig.settle()  # its background work done (counted in its CPU), before the next block
                if r:
                    samples[name].append(elapsed)
                    cpu[name] += cpu_s(pid) - cpu_before
        return finish_rig(rig, g, samples, cpu, per_block, warm)
    finally:
        rig.close()


def finish_rig(rig: Rig, g: Geometry, samples: dict[str, list[float]], cpu: dict[str, float], per_block: int,
               warm: int) -> dict[str, Any]:
    """The figures, and the checks that the path was exercised, of one geometry's run."""
    assert rig.live is not None and rig.stalled is not None
    nchunk = chunk_bytes(g)
    block_chunks = per_block * CHUNKS_PER_REQUEST
    statuses = {name: rig.status(name) for name in CONFIGS}
    metrics = {name: scrape(port) for name, port in rig.ports.items()}
    rig.live.close()
    backlog = rig.stalled.backlog()
    checks: dict[str, bool] = {}
    daemons: dict[str, Any] = {}
    for name in CONFIGS:
        s, m = statuses[name], metrics[name]
        offered = rig.workers[name].requests * CHUNKS_PER_REQUEST
        stored = m.get("lmcache_mp_store_chunks_total{outcome=stored}", 0)
        evictions = m.get("lmcache_mp_pool_evictions_total", 0)
        daemons[name] = {"chunks_offered": offered, "chunks_stored": stored, "evictions": evictions,
                         "objects": s.objects, "kv_events_seq": s.kv_events_seq,
                         "kv_events_batches_total": s.kv_events_batches_total,
                         "kv_events_published_total": s.kv_events_published_total,
                         "kv_events_dropped_total": s.kv_events_dropped_total,
                         "kv_events_endpoints": s.kv_events_endpoints}
        checks[f"{name}: every chunk offered STORED ({stored:.0f} of {offered})"] = stored == offered
        checks[f"{name}: the pool evicted ({evictions:.0f} chunks)"] = evictions == offered - s.objects > 0
        if name == BASELINE:
            checks[f"{name}: no events published"] = (not s.kv_events_endpoints
                                                     and s.kv_events_published_total == 0)
        else:
            checks[f"{name}: every event published, none dropped ({s.kv_events_published_total} of "
                   f"{s.kv_events_seq})"] = (s.kv_events_published_total == s.kv_events_seq > offered
                                             and s.kv_events_dropped_total == 0)
    s, m, live = statuses[LIVE], daemons[LIVE], rig.live
    received = sum(live.counts.values())
    checks[f"{LIVE}: received every batch ({live.batches} of {s.kv_events_batches_total}, {live.gaps} gaps) "
           f"and event ({received} of {s.kv_events_published_total})"] = (
        live.batches == s.kv_events_batches_total and live.gaps == 0
        and received == s.kv_events_published_total)
    checks[f"{LIVE}: BlockStored for every chunk stored ({live.counts['stored']}), BlockRemoved for every "
           f"eviction ({live.counts['removed']})"] = (live.counts["stored"] == m["chunks_stored"]
                                                      and live.counts["removed"] == m["evictions"])
    replays = metrics[STALLED].get("lmcache_mp_kv_events_replays_total", 0)
    checks[f"{STALLED}: sent batches it never read ({backlog} queued for it at the end), answered its "
           f"{rig.stalled.replays_asked} replay requests ({replays:.0f})"] = (
        backlog > 0 and replays == rig.stalled.replays_asked)
    rows = {}
    for name in CONFIGS:
        blocks = samples[name]
        rows[name] = {"gbps": statistics.median(block_chunks * nchunk / t for t in blocks) / 1e9,
                      "chunks_per_s": statistics.median(block_chunks / t for t in blocks),
                      "store_ms": statistics.median(blocks) / per_block * 1e3,
                      "daemon_cpu_us_per_chunk": cpu[name] / (block_chunks * len(blocks)) * 1e6,
                      "block_s": blocks}
    print(f"{'daemon':<24}{'GB/s':>8}{'chunks/s':>10}{'STORE ms':>10}{'daemon CPU us/chunk':>21}")
    for name, row in rows.items():
        print(f"{name:<24}{row['gbps']:>8.2f}{row['chunks_per_s']:>10.0f}{row['store_ms']:>10.2f}"
              f"{row['daemon_cpu_us_per_chunk']:>21.0f}")
    ratios = {f"{name} / {BASELINE}": rows[name]["gbps"] / rows[BASELINE]["gbps"] for name in (STALLED, LIVE)}
    # The median of each round's own ratio (the blocks of one round ran seconds apart).
    paired = {f"{name} / {BASELINE}": statistics.median(
        base / t for t, base in zip(samples[name], samples[BASELINE], strict=True))
        for name in (STALLED, LIVE)}
    for what, ratio in ratios.items():
        print(f"STORE GB/s, {what}: {ratio:.1%} (median of the rounds' own ratios: {paired[what]:.1%})")
    print(f"live subscriber: {live.counts}; stalled subscriber: {backlog} of "
          f"{statuses[STALLED].kv_events_batches_total} batches queued for it at the end")
    return {"geometry": {"layers": g.layers, "kv_heads": g.kv_heads, "head_size": 128,
                         "block_tokens": g.block, "chunk_tokens": CHUNK, "chunk_bytes": nchunk,
                         "chunks_per_request": CHUNKS_PER_REQUEST},
            "requests_per_block": per_block, "warm_up_requests": warm, "rows": rows,
            "ratios": ratios, "paired_ratios": paired,
            "daemons": daemons,
            "live_subscriber": {"batches": live.batches, "replayed": live.replayed, "gaps": live.gaps,
                                **live.counts},
            "stalled_subscriber": {"backlog_batches": backlog, "replays_asked": rig.stalled.replays_asked,
                                   "replays_answered": replays},
            "checks": checks}


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    with figure(path, 1, len(results), figsize=(5 * len(results), 3.5), squeeze=False,
                title="STORE throughput with KV events off, stalled and followed") as axes:
        for ax, (name, result) in zip(axes[0], results.items(), strict=True):
            values = [result["rows"][c]["gbps"] for c in CONFIGS]
            ax.bar([c.replace(" ", "\n", 1) for c in CONFIGS], values, color=COLORS)
            for i, v in enumerate(values):
                ax.annotate(f"{v:.2f} ({v / values[0]:.0%})", (i, v), ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("STORE GB/s (median of rounds)")
            ax.set_title(f"{name}: {result['geometry']['chunk_bytes'] / 2**20:.0f} MiB chunks", fontsize=9)


def main() -> int:
    command = parser(__doc__, "smoke run: 2 rounds of 512 MiB blocks, 0.5 GiB pools (overrides those; "
                     "its ratios are too noisy to judge the target by)",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    command.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), default=list(GEOMETRIES),
                         help="KV geometries to measure, each with its own three daemons")
    command.add_argument("--rounds", type=int, default=30,
                         help="timed rounds (one block per daemon each), after one to warm up")
    command.add_argument("--block-mib", type=int, default=1536,
                         help="KV stored per daemon per round (whole 8-chunk requests)")
    command.add_argument("--pool-gb", type=float, default=1.0,
                         help="each daemon's pool: a fraction of what goes through it, so STOREs evict")
    command.add_argument("--min-ratio", type=float, default=0.95,
                         help="target: STORE GB/s of b and c over a's (exit code 1 if missed; 0 to skip)")
    args = parse(command)
    if args.quick:
        args.rounds, args.block_mib, args.pool_gb = 2, 512, 0.5
    tmp = Path(tempfile.mkdtemp(prefix="lmc-kv-events-", dir="/tmp"))
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in args.geometry:
            g = GEOMETRIES[name]
            per_block = max(1, args.block_mib * 2**20 // (chunk_bytes(g) * CHUNKS_PER_REQUEST))
            results[name] = run(g, tmp, args.pool_gb, args.rounds, per_block)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall_s = time.monotonic() - started
    checks: dict[str, bool] = {}
    for name, result in results.items():
        checks |= {f"{name}: {what}": ok for what, ok in result.pop("checks").items()}
    path_ok = all(checks.values())
    for name, result in results.items():
        for what, ratio in result["ratios"].items():
            checks[f"{name}: STORE GB/s, {what} = {ratio:.1%} (target >= {args.min_ratio:.0%})"] = (
                ratio >= args.min_ratio)
    print(f"\nwall time {wall_s:.0f} s")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    finish(args.out, "kv_events", checks, {"config": config, "wall_s": wall_s, "results": results,
                                           "path_exercised": path_ok, "checks": checks},
           lambda path: plot(results, path))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
