#!/usr/bin/env python
"""Control-plane benchmark: LOOKUP round trips through the real daemon, hits and misses.

    .venv/bin/python scripts/bench/bench_control_plane.py [--out bench-out] [--samples N] [--parts ...]

1. The path vLLM takes, over ipc://. One or two stand-in worker processes register
   CPU caches as the ranks of a model (world size 1 and 2) and store 128 chunks each; the
   scheduler side, `LMCacheMPSchedulerAdapter` as vLLM's scheduler uses it, then looks up
   prompts of 1, 8, 32 and 128 chunks: hits on every rank, leased, and the session ended with
   END_SESSION as vLLM does once it has loaded them. Every round runs, in rotation so that all
   see the same noise, each after a bare pyzmq DEALER/ROUTER echo to another process (what any
   ZeroMQ request costs before doing any work; the first one timed): a PING through the same
   client, the hit with its END_SESSION (which the adapter defers to its next request), then a
   PING that carries the END_SESSION and waits until the daemon has answered both (timed as
   "next": what the request after a hit pays for its END_SESSION), and a miss of as many
   chunks. Every hit is checked to hit all its
   chunks, and after each world size's rounds no session and no lease may be left.
   Targets: a 32-chunk hit with its END_SESSION within 1.2x the PING (p50)
   and 3x (p99); a 32-chunk LOOKUP within 1.1x the bare echo (p50).
2. Misses over TCP loopback, and lookups per second from one client (one at a time and 64 in
   flight) and from 8 client processes. Target: >= 10,000 lookups/s from one client.
3. Where the time goes: the hit rotation again against a daemon started under
   `scripts/profile/daemon_profile.py` (per-phase timers).
4. The floor: the hit rotation against a daemon whose LOOKUP only walks the prefix
   (`scripts/profile/daemon_floor.py`: no pins, no leases), the ratios no lease work could beat.
Prints tables, writes control_plane.png and control_plane.json to --out.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from harness import figure, finish, parse, parser, scratch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.testing.launcher import daemon_status, free_port, start_daemon

CHUNK_COUNTS = (1, 8, 32, 128)
WORLD_SIZES = (1, 2)
MODEL = "bench-model"
BLOCK = 16  # vLLM block size
CHUNK = 256  # daemon chunk size: 16 blocks, as vLLM's default block size with lmcache's chunk
BLOCKS_PER_CHUNK = CHUNK // BLOCK
STORED_CHUNKS = max(CHUNK_COUNTS)
CACHE_SHAPE = [STORED_CHUNKS * BLOCKS_PER_CHUNK, 2, BLOCK, 64]  # CPU_ATTN: blocks x KV x tokens x dim
CACHE_LAYERS = 2
DAEMON_ARGS = ("--l1-size-gb", "0.1", "--chunk-size", str(CHUNK))
PROFILE = Path(__file__).resolve().parents[1] / "profile"  # the daemons under a profiler or a floor


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def block_hashes(seed: str, count: int) -> list[bytes]:
    """A vLLM-like chain of block hashes."""
    out, prev = [], seed.encode()
    for _ in range(count):
        prev = hashlib.sha256(prev).digest()
        out.append(prev)
    return out


# ---- the stand-in ranks ----------------------------------------------------------------------


def _rank_worker(url: str, world_size: int, rank: int, ready: Any, stop: Any) -> None:
    """A worker process of one rank: registers CPU caches, stores STORED_CHUNKS chunks, holds
    its registration (its liveness is its process) until told to stop."""
    import torch

    from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

    buffer = torch.randn(CACHE_LAYERS, *CACHE_SHAPE).to(torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(CACHE_LAYERS)}
    worker = LMCacheMPWorkerAdapter(url, None, MODEL, world_size, rank, BLOCK)
    worker.register_kv_caches(caches, "CPU_ATTN")
    hashes = block_hashes("hit", CACHE_SHAPE[0])
    worker.submit_store_request("store", LoadStoreOp(list(range(len(hashes))), block_hashes=hashes), None)
    deadline = time.monotonic() + 60
    while "store" not in worker.get_finished({"store"})[0]:
        if time.monotonic() > deadline:
            raise TimeoutError("the store did not finish")
        time.sleep(0.01)
    ready.set()
    stop.wait()
    worker.shutdown()


class Ranks:
    """`world_size` rank processes, each registered with its chunks stored."""

    def __init__(self, url: str, world_size: int):
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._procs = []
        for rank in range(world_size):
            ready = ctx.Event()
            proc = ctx.Process(target=_rank_worker, args=(url, world_size, rank, ready, self._stop))
            proc.start()
            self._procs.append(proc)
            if not ready.wait(120):
                self.close()
                raise RuntimeError(f"rank {rank} did not register and store in time")

    def close(self) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# ---- the bare pyzmq echo -----------------------------------------------------------------------


def _echo_server(url: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            return
        sock.send_multipart(frames)


class Echo:
    """A bare pyzmq ROUTER echoing in another process, and a DEALER to it: the floor of any
    ZeroMQ request (our daemon's socket pattern, with no work on either side)."""

    def __init__(self, url: str):
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self._proc = ctx.Process(target=_echo_server, args=(url, ready))
        self._proc.start()
        ready.wait(30)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.connect(url)

    def round_trip(self) -> None:
        self._sock.send_multipart([b"12345678", b"\x07", b"x" * 64])
        self._sock.recv_multipart()

    def close(self) -> None:
        self._sock.send_multipart([b"stop"])
        self._proc.join(10)
        self._sock.close(linger=0)


# ---- 1. the hit path, interleaved ----------------------------------------------------------------


class Rotation:
    """One scheduler adapter and the ops of one round, each timed."""

    def __init__(self, url: str, world_size: int, echo: Echo):
        from vllm_adapter import LMCacheMPSchedulerAdapter

        self.sched = LMCacheMPSchedulerAdapter(url, None, MODEL, world_size, 0, BLOCK)
        self.echo = echo
        self.hit_hashes = block_hashes("hit", STORED_CHUNKS * BLOCKS_PER_CHUNK)
        self.miss_hashes = block_hashes("miss", STORED_CHUNKS * BLOCKS_PER_CHUNK)
        self._n = 0

    def ping(self) -> None:
        self.sched.mq_client.submit(RequestType.PING, [self._n]).result(5)

    def lookup(self, hashes: list[bytes]) -> tuple[float, float, int]:
        """A lookup and its END_SESSION, as vLLM makes them: (seconds to the lookup's result,
        seconds to that and the END_SESSION sent, hit tokens)."""
        self._n += 1
        request_id = f"bench-{self._n}"
        sched = self.sched
        start = time.perf_counter()
        sched.maybe_submit_lookup_request(request_id, block_hashes=hashes, tails=True)  # the connector's
        sched.lookup_futures[request_id].wait(5)  # blocks on the socket (vLLM polls once a step)
        hit = sched.check_lookup_result(request_id)
        sched.cleanup_lookup_result(request_id)
        looked_up = time.perf_counter()
        sched.end_session(request_id)
        ended = time.perf_counter()
        return looked_up - start, ended - start, hit or 0

    def settle(self) -> float:
        """A PING that waits until the daemon has answered every request sent, so that no other
        sample pays for this one's work. The END_SESSION goes out with it (the scheduler adapter
        defers releases to the next request): returns its seconds, what that next request pays."""
        start = time.perf_counter()
        self.ping()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sched.shutdown()


def run_rotation(rot: Rotation, chunks: int, samples: int) -> dict[str, list[float]]:
    hit_hashes = rot.hit_hashes[:chunks * BLOCKS_PER_CHUNK]
    miss_hashes = rot.miss_hashes[:chunks * BLOCKS_PER_CHUNK]
    times: dict[str, list[float]] = {k: [] for k in ("ping", "hit", "hit+end", "echo", "miss", "next")}
    for i in range(samples + samples // 10):
        keep = i >= samples // 10  # the first tenth warms up
        # An echo before each daemon request, so that each finds the daemon idle alike (the one
        # timed follows a daemon request, as each daemon request follows an echo).
        t = time.perf_counter()
        rot.echo.round_trip()
        echo = time.perf_counter() - t
        t = time.perf_counter()
        rot.ping()
        ping = time.perf_counter() - t
        rot.echo.round_trip()
        hit, hit_end, tokens = rot.lookup(hit_hashes)
        if tokens != chunks * CHUNK:
            raise AssertionError(f"a {chunks}-chunk hit found {tokens // CHUNK} chunks")
        after_end = rot.settle()
        rot.echo.round_trip()
        miss, _, tokens = rot.lookup(miss_hashes)
        if tokens:
            raise AssertionError(f"a miss found {tokens // CHUNK} chunks")
        rot.settle()
        if keep:
            for name, value in zip(times, (ping, hit, hit_end, echo, miss, after_end), strict=True):
                times[name].append(value)
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, samples in times.items():
        row[f"{name}_p50_us"], row[f"{name}_p99_us"] = percentiles(samples)
    row["hit+end / ping p50"] = row["hit+end_p50_us"] / row["ping_p50_us"]
    row["hit+end / ping p99"] = row["hit+end_p99_us"] / row["ping_p99_us"]
    # What the request after the hit pays for carrying its END_SESSION (not part of hit + END).
    row["next - ping p50 us"] = row["next_p50_us"] - row["ping_p50_us"]
    row["hit / echo p50"] = row["hit_p50_us"] / row["echo_p50_us"]
    row["ping / echo p50"] = row["ping_p50_us"] / row["echo_p50_us"]
    return row


def hit_path(tmp: Path, samples: int, world_sizes: tuple[int, ...] = WORLD_SIZES,
             chunk_counts: tuple[int, ...] = CHUNK_COUNTS,
             daemon_prefix: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Per world size, one row per chunk count; the daemon is started under `daemon_prefix`."""
    results: dict[str, list[dict]] = {}
    echo = Echo(f"ipc://{tmp / 'echo.sock'}")
    try:
        for world_size in world_sizes:
            daemon = start_daemon(tmp, *DAEMON_ARGS, command_prefix=daemon_prefix)
            ranks = rot = None
            try:
                ranks = Ranks(daemon.url, world_size)
                rot = Rotation(daemon.url, world_size, echo)
                rows = []
                for chunks in chunk_counts:
                    print(f"world size {world_size}: {chunks}-chunk hits, misses, PING, echo...", flush=True)
                    rows.append({"chunks": chunks, **summarize(run_rotation(rot, chunks, samples))})
                results[f"world size {world_size}"] = rows
                left = daemon_status(daemon.url)
                if left.sessions or left.leases:
                    raise AssertionError(f"{left.sessions} sessions holding {left.leases} leases left")
            finally:
                if rot is not None:
                    rot.close()
                if ranks is not None:
                    ranks.close()
                daemon.stop()
    finally:
        echo.close()
    return results


# ---- 2. misses over TCP, throughput ----------------------------------------------------------------


def miss_keys(num_chunks: int, request_id: str) -> list[IPCCacheEngineKey]:
    return [IPCCacheEngineKey(MODEL, 1, None, chunk_hash=i.to_bytes(4, "big") * 8, request_id=request_id)
            for i in range(num_chunks)]


def tcp_miss_latency(url: str, num_chunks: int, n: int) -> list[float]:
    client = MessageQueueClient(url)
    client.handshake("bench")
    keys = miss_keys(num_chunks, "bench")
    out = []
    try:
        for i in range(n + n // 10):
            t = time.perf_counter()
            client.submit(RequestType.LOOKUP, [keys]).result(5)
            if i >= n // 10:
                out.append(time.perf_counter() - t)
    finally:
        client.close()
    return out


def lookups_per_second(url: str, num_chunks: int, seconds: float, depth: int) -> float:
    client = MessageQueueClient(url)
    client.handshake("bench")
    keys = miss_keys(num_chunks, "bench")
    done = 0
    try:
        end = time.perf_counter() + seconds
        window = []
        start = time.perf_counter()
        while time.perf_counter() < end:
            window.append(client.submit(RequestType.LOOKUP, [keys]))
            if len(window) >= depth:
                window.pop(0).result(5)
                done += 1
        for f in window:
            f.result(5)
            done += 1
        return done / (time.perf_counter() - start)
    finally:
        client.close()


def _client_proc(url: str, num_chunks: int, seconds: float, queue: mp.Queue) -> None:
    queue.put(lookups_per_second(url, num_chunks, seconds, depth=1))


def multi_client_rate(url: str, num_chunks: int, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(url, num_chunks, seconds, queue)) for _ in range(clients)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def misses_and_throughput(tmp: Path, samples: int, seconds: float) -> dict[str, Any]:
    results: dict[str, Any] = {"tcp misses": [], "throughput": {}}
    url = f"tcp://127.0.0.1:{free_port()}"
    # Unauthenticated on purpose: the benchmark measures the bare transport.
    daemon = start_daemon(tmp, "--l1-size-gb", "0.01", "--allow-unauthenticated-tcp", url=url)
    try:
        for chunks in CHUNK_COUNTS:
            print(f"tcp: {chunks}-chunk misses...", flush=True)
            p50, p99 = percentiles(tcp_miss_latency(url, chunks, samples))
            results["tcp misses"].append({"chunks": chunks, "p50_us": p50, "p99_us": p99})
    finally:
        daemon.stop()
    url = f"ipc://{tmp / 'rate.sock'}"
    daemon = start_daemon(tmp, "--l1-size-gb", "0.01", url=url)
    try:
        print("ipc: lookups per second...", flush=True)
        results["throughput"] = {
            "1 client, 1 in flight": lookups_per_second(url, 32, seconds, depth=1),
            "1 client, 64 in flight": lookups_per_second(url, 32, seconds, depth=64),
            "8 clients, 1 in flight each": multi_client_rate(url, 32, 8, seconds),
        }
    finally:
        daemon.stop()
    return results


# ---- 3. the daemon-side profile ------------------------------------------------------------------


def profile(tmp: Path, samples: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per world size, the 32-chunk rotation against a daemon under daemon_profile.py; per phase,
    microseconds per call and per round."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for world_size in WORLD_SIZES:
        path = tmp / f"profile-{world_size}.json"
        prefix = (sys.executable, str(PROFILE / "daemon_profile.py"), str(path), "--")
        hit_path(tmp, samples, (world_size,), (32,), prefix)
        rounds = samples + samples // 10
        out[f"world size {world_size}"] = {
            name: {"calls": v["calls"], "cpu_us_per_call": v["cpu_ns"] / max(v["calls"], 1) / 1e3,
                   "cpu_us_per_round": v["cpu_ns"] / rounds / 1e3,
                   "wall_us_per_call": v["wall_ns"] / max(v["calls"], 1) / 1e3}
            for name, v in json.loads(path.read_text()).items()}
    return out


# ---- 4. the floor: LOOKUP without leases -----------------------------------------------------------


def floor(tmp: Path, samples: int) -> dict[str, list[dict]]:
    """The hit rotation against a daemon whose LOOKUP only walks the prefix (daemon_floor.py):
    what a LOOKUP costs before any pin or lease, for the ratios faster leases could reach."""
    prefix = (sys.executable, str(PROFILE / "daemon_floor.py"), "--")
    return hit_path(tmp, samples, daemon_prefix=prefix)


# ---- report -------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    with figure(path, figsize=(7, 4)) as ax:
        for world, rows in results["hit path"].items():
            xs = [r["chunks"] for r in rows]
            ax.plot(xs, [r["hit+end_p50_us"] for r in rows], marker="o", label=f"hit + END_SESSION, {world}")
            ax.plot(xs, [r["miss_p50_us"] for r in rows], marker="x", linestyle="--", label=f"miss, {world}")
            ax.plot(xs, [r["ping_p50_us"] for r in rows], color="gray", linestyle=":", label=f"PING, {world}")
            ax.plot(xs, [r["echo_p50_us"] for r in rows], color="black", linestyle=":", linewidth=0.8,
                    label=f"bare pyzmq echo, {world}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunks per LOOKUP")
        ax.set_ylabel("p50 round trip (us)")
        ax.set_title("LOOKUP through lmcache-mp (ipc://), interleaved with PING and echo")
        ax.legend(fontsize=6)


def print_hit_table(title: str, hit_path_rows: dict[str, list[dict]]) -> None:
    print(f"\n{title}")
    print(f"{'':<14}{'chunks':>7}{'PING':>7}{'echo':>7}{'hit':>7}{'hit+END':>8}{'miss':>7}"
          f"{'hit+END/PING':>14}{'p99 ratio':>10}{'hit/echo':>9}{'next':>7}"
          "   (p50 us; p99 in JSON; next: the PING after a hit, carrying its END_SESSION)")
    for world, rows in hit_path_rows.items():
        for r in rows:
            print(f"{world:<14}{r['chunks']:>7}{r['ping_p50_us']:>7.0f}{r['echo_p50_us']:>7.0f}"
                  f"{r['hit_p50_us']:>7.0f}{r['hit+end_p50_us']:>8.0f}{r['miss_p50_us']:>7.0f}"
                  f"{r['hit+end / ping p50']:>14.2f}{r['hit+end / ping p99']:>10.2f}"
                  f"{r['hit / echo p50']:>9.2f}{r['next_p50_us']:>7.0f}")


def print_tables(results: dict) -> None:
    print_hit_table("the hit path", results["hit path"])
    if "floor" in results:
        print_hit_table("the floor: the same rotation, LOOKUP walking the prefix only (no pins, no leases)",
                        results["floor"])
    print()
    for r in results["tcp misses"]:
        print(f"tcp miss, {r['chunks']:>3} chunks: p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us")
    for name, rate in results["throughput"].items():
        print(f"ipc {name:<30}{rate:>10.0f} lookups/s (32-chunk misses)")
    for world, phases in results.get("profile", {}).items():
        print(f"\ndaemon-side profile, 32-chunk rotation, {world} "
              "(CPU us per call, per round; wall us per call):")
        for name, v in phases.items():
            print(f"  {name:<48}{v['cpu_us_per_call']:>8.1f}{v['cpu_us_per_round']:>8.1f}"
                  f"{v['wall_us_per_call']:>8.1f}  ({v['calls']} calls)")


def main() -> int:
    command = parser(__doc__)
    command.add_argument("--samples", type=int, default=2000, help="rounds per latency point")
    command.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput run")
    command.add_argument("--parts", default="hits,misses,profile,floor",
                         help="which parts to run, of hits (1), misses (2), profile (3) and floor (4); "
                              "default: %(default)s")
    args = parse(command)
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"hit path": {}, "tcp misses": [], "throughput": {}}
    with scratch("lmc-bench-") as tmp:
        if "hits" in parts:
            results["hit path"] = hit_path(tmp, args.samples)
        if "misses" in parts:
            results.update(misses_and_throughput(tmp, args.samples, args.seconds))
        if "profile" in parts:
            results["profile"] = profile(tmp, args.samples // 4)
        if "floor" in parts:
            results["floor"] = floor(tmp, args.samples // 2)
    print_tables(results)
    checks = {}
    for world, rows in results["hit path"].items():
        r = next(r for r in rows if r["chunks"] == 32)
        checks[f"32-chunk hit + END_SESSION p50 <= 1.2x PING ({world})"] = r["hit+end / ping p50"] <= 1.2
        checks[f"32-chunk hit + END_SESSION p99 <= 3x PING ({world})"] = r["hit+end / ping p99"] <= 3.0
        checks[f"32-chunk LOOKUP hit p50 <= 1.1x bare pyzmq echo ({world})"] = r["hit / echo p50"] <= 1.1
    if results["throughput"]:
        best_one_client = max(results["throughput"]["1 client, 1 in flight"],
                              results["throughput"]["1 client, 64 in flight"])
        checks[">= 10,000 lookups/s from one client"] = best_one_client >= 10_000
    results["targets"] = checks
    finish(args.out, "control_plane", checks, results, lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
