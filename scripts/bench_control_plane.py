#!/usr/bin/env python
"""Control-plane benchmark: LOOKUP round trips through the real daemon.

    .venv/bin/python scripts/bench_control_plane.py [--out bench-out]

For prompts of 1, 8, 32 and 128 chunks, over ipc:// and over TCP loopback, it measures the
scheduler adapter's LOOKUP round trip (submit -> daemon -> result) p50/p99, then lookups per
second from one client (one at a time, and pipelined 64 deep) and from 8 client processes.
The baseline measured in the same run is a bare pyzmq DEALER/ROUTER echo between the same
two processes' kind of sockets: what any ZeroMQ design pays before doing any work.
Targets (issue 5): p50 <= 100 us and p99 <= 1 ms for 32 chunks over ipc://; >= 10,000 lookups/s
from one client. Prints a table, writes control_plane.png and control_plane.json to --out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import tempfile
import time
from pathlib import Path

import zmq
from bench_report import finish

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.launcher import start_daemon
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType

CHUNK_COUNTS = (1, 8, 32, 128)
MODEL = "bench-model"


def keys_for(num_chunks: int, request_id: str) -> list[IPCCacheEngineKey]:
    return [IPCCacheEngineKey(MODEL, 1, None, chunk_hash=i.to_bytes(4, "big") * 8, request_id=request_id)
            for i in range(num_chunks)]


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def lookup_latency(url: str, num_chunks: int, n: int) -> list[float]:
    client = MessageQueueClient(url)
    client.handshake("bench")
    keys = keys_for(num_chunks, "bench")
    out = []
    try:
        for _ in range(n // 10):  # warm-up
            client.submit(RequestType.LOOKUP, [keys]).result(5)
        for _ in range(n):
            t = time.perf_counter()
            client.submit(RequestType.LOOKUP, [keys]).result(5)
            out.append(time.perf_counter() - t)
    finally:
        client.close()
    return out


def lookups_per_second(url: str, num_chunks: int, seconds: float, depth: int) -> float:
    client = MessageQueueClient(url)
    client.handshake("bench")
    keys = keys_for(num_chunks, "bench")
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


def _echo_server(url: str, ready: mp.Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            return
        sock.send_multipart(frames)


def zmq_echo_baseline(url: str, n: int) -> list[float]:
    """Bare pyzmq round trips to another process: the floor for any ZeroMQ request."""
    ctx_mp = mp.get_context("spawn")
    ready = ctx_mp.Event()
    proc = ctx_mp.Process(target=_echo_server, args=(url, ready))
    proc.start()
    ready.wait(30)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(url)
    out = []
    for i in range(n + n // 10):
        t = time.perf_counter()
        sock.send_multipart([b"12345678", b"\x07", b"x" * 64])
        sock.recv_multipart()
        if i >= n // 10:
            out.append(time.perf_counter() - t)
    sock.send_multipart([b"stop"])
    proc.join(10)
    sock.close(linger=0)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for transport, rows in results["latency"].items():
        xs = [r["chunks"] for r in rows]
        ax.plot(xs, [r["p50_us"] for r in rows], marker="o", label=f"{transport} p50")
        ax.plot(xs, [r["p99_us"] for r in rows], marker="x", linestyle="--", label=f"{transport} p99")
    for transport, base in results["zmq_echo_baseline"].items():
        ax.axhline(base["p50_us"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"bare zmq echo p50 ({transport})", (1, base["p50_us"]), fontsize=7, color="gray")
    ax.axhline(100, color="red", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunks per LOOKUP")
    ax.set_ylabel("round trip (us)")
    ax.set_title("LOOKUP round trip through lmcache-mp")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="where to write the PNG and JSON")
    parser.add_argument("--samples", type=int, default=3000, help="round trips per latency point")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp"))
    urls = {"ipc": f"ipc://{tmp / 'daemon.sock'}", "tcp": f"tcp://127.0.0.1:{free_port()}"}
    results: dict = {"latency": {}, "zmq_echo_baseline": {}, "throughput": {}}
    print("bare pyzmq echo baseline (same-run floor)...", flush=True)
    for transport, url in (("ipc", f"ipc://{tmp / 'echo.sock'}"), ("tcp", f"tcp://127.0.0.1:{free_port()}")):
        p50, p99 = percentiles(zmq_echo_baseline(url, args.samples))
        results["zmq_echo_baseline"][transport] = {"p50_us": p50, "p99_us": p99}
    for transport, url in urls.items():
        daemon = start_daemon(tmp, "--l1-size-gb", "0.01", url=url)
        try:
            rows = []
            for chunks in CHUNK_COUNTS:
                print(f"{transport}: LOOKUP of {chunks} chunks...", flush=True)
                p50, p99 = percentiles(lookup_latency(url, chunks, args.samples))
                rows.append({"chunks": chunks, "p50_us": p50, "p99_us": p99})
            results["latency"][transport] = rows
            results["throughput"][transport] = {
                "1 client, 1 in flight": lookups_per_second(url, 32, args.seconds, depth=1),
                "1 client, 64 in flight": lookups_per_second(url, 32, args.seconds, depth=64),
                "8 clients, 1 in flight each": multi_client_rate(url, 32, 8, args.seconds),
            }
        finally:
            daemon.stop()
    print()
    print(f"{'transport':<10}{'chunks':>8}{'p50 us':>10}{'p99 us':>10}")
    for transport, rows in results["latency"].items():
        for r in rows:
            print(f"{transport:<10}{r['chunks']:>8}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}")
    for transport, base in results["zmq_echo_baseline"].items():
        print(f"bare pyzmq echo ({transport}): p50 {base['p50_us']:.0f} us, p99 {base['p99_us']:.0f} us")
    print()
    for transport, rates in results["throughput"].items():
        for name, rate in rates.items():
            print(f"{transport:<5}{name:<30}{rate:>10.0f} lookups/s (32 chunks)")
    ipc32 = next(r for r in results["latency"]["ipc"] if r["chunks"] == 32)
    best_one_client = max(results["throughput"]["ipc"]["1 client, 1 in flight"],
                          results["throughput"]["ipc"]["1 client, 64 in flight"])
    checks = {
        "p50 <= 100 us (32 chunks, ipc)": ipc32["p50_us"] <= 100,
        "p99 <= 1 ms (32 chunks, ipc)": ipc32["p99_us"] <= 1000,
        ">= 10,000 lookups/s from one client": best_one_client >= 10_000,
    }
    results["targets"] = checks
    finish(args.out, "control_plane", checks, results, lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
