#!/usr/bin/env python
"""Data-plane benchmark: STORE and RETRIEVE throughput through the real daemon.

    .venv/bin/python scripts/bench_data_plane.py [--out bench-out]

KV in vLLM's CPU layout (CPU_ATTN, [blocks, kv_heads, block_size, 2*head_size] per layer,
all layers views of one allocation) at a realistic geometry: 32 layers, 8 KV heads, head
size 128, bf16, 128-token blocks, 256-token chunks (32 MiB per chunk). Each request moves 8
chunks. "End to end" is the adapter's request -> daemon copy -> reply.
Baseline, same process, same pages: the fastest single-threaded torch gather and scatter into/out
of chunk-shaped buffers that we know of: `index_select` per layer to gather; to scatter, one
`copy_` per run of consecutive blocks, all layers at once (the daemon's own way; one `copy_` per
page and layer is 2.4x faster than `index_copy_`, and this is faster still).
RETRIEVE runs against two daemons: one with one copy thread (`--max-workers 1`) and one with two
(the default), which splits a RETRIEVE's chunks over both (issue 12). Every round measures all
paths one after the other, so that a busy machine slows them alike.
Target (issue 5): >= 70% of the baseline in both directions; the split RETRIEVE is compared with
the one-thread RETRIEVE. Prints a table, writes data_plane.png and data_plane.json to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_report import finish

from lmcache_mp.launcher import start_daemon
from lmcache_mp.protocol import RequestType
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

LAYERS, KV_HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 128, 256
CHUNKS_PER_REQUEST = 8
BLOCKS_PER_CHUNK = CHUNK // BLOCK
NUM_BLOCKS = 48  # 768 MiB of KV cache
DTYPE = torch.bfloat16


def make_kv() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole allocation, and its layers by name (views of it, as vLLM's CPU caches are)."""
    buffer = torch.empty(LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
    buffer.view(torch.int16).random_(-1000, 1000)
    return buffer, {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}


def request_bytes() -> int:
    return LAYERS * CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK * KV_HEADS * BLOCK * 2 * HEAD * DTYPE.itemsize


def block_ids(iteration: int) -> list[int]:
    """Where a request's chunks are stored from: not ascending, like vLLM after block reuse. They
    are retrieved into the same blocks in ascending order (a fresh request's blocks)."""
    n = CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK
    start = (iteration * 7) % (NUM_BLOCKS - n)
    return list(range(start, start + n))[::-1]


def hashes_for(iteration: int) -> list[bytes]:
    n = CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK
    return [hashlib.sha256(f"{iteration}-{b}".encode()).digest() for b in range(n)]


class Baseline:
    """Single-threaded torch gather and scatter of the same pages, chunk by chunk."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer
        self._chunks = [torch.empty(LAYERS, BLOCKS_PER_CHUNK, KV_HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
                        for _ in range(CHUNKS_PER_REQUEST)]

    def gather(self, ids: list[int]) -> float:
        per_chunk = torch.tensor(ids).view(CHUNKS_PER_REQUEST, BLOCKS_PER_CHUNK)
        start = time.perf_counter()
        for c, chunk in enumerate(self._chunks):
            for layer in range(LAYERS):
                torch.index_select(self._buffer[layer], 0, per_chunk[c], out=chunk[layer])
        return time.perf_counter() - start

    def scatter(self, ids: list[int]) -> float:
        """Into ascending `ids`: each chunk's blocks are one run, one copy_ for all layers."""
        start = time.perf_counter()
        for c, chunk in enumerate(self._chunks):
            first = ids[c * BLOCKS_PER_CHUNK]
            self._buffer[:, first:first + BLOCKS_PER_CHUNK].copy_(chunk)
        return time.perf_counter() - start


class Client:
    """A worker and a scheduler adapter on one daemon, the worker's caches registered."""

    def __init__(self, url: str, kv: dict[str, torch.Tensor]):
        self.worker = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, BLOCK)
        self.scheduler = LMCacheMPSchedulerAdapter(url, None, "bench", 1, 0, BLOCK)
        self.worker.register_kv_caches(kv, "CPU_ATTN")

    def store(self, it: int) -> float:
        ids = block_ids(it)
        keys = self._keys(it)
        start = time.perf_counter()
        payload = [keys, self.worker.instance_id, ids, b""]
        result = self.worker.mq_client.submit(RequestType.STORE, payload).result(60)
        elapsed = time.perf_counter() - start
        assert all(o == 0 for o in result.outcomes), result.outcomes
        return elapsed

    def retrieve(self, it: int) -> float:
        request_id = f"r{it}"
        self.scheduler.maybe_submit_lookup_request(request_id, block_hashes=hashes_for(it))
        while (hit := self.scheduler.check_lookup_result(request_id)) is None:
            time.sleep(0.0005)
        assert hit == CHUNKS_PER_REQUEST * CHUNK, hit
        payload = [self._keys(it), self.worker.instance_id, block_ids(it)[::-1], b""]
        start = time.perf_counter()
        reply = self.worker.mq_client.submit(RequestType.RETRIEVE, payload).result(60)
        elapsed = time.perf_counter() - start
        assert reply.ok, reply.reason
        self.scheduler.cleanup_lookup_result(request_id)
        return elapsed

    def _keys(self, it: int) -> list:
        return self.worker._keys.keys_for(f"r{it}", LoadStoreOp(block_ids(it), block_hashes=hashes_for(it)))

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def measure(buffer: torch.Tensor, kv: dict[str, torch.Tensor], urls: dict[str, str],
            iterations: int) -> dict[str, list[float]]:
    """Seconds per request, per path; every round runs each path once (the first round warms up)."""
    torch.set_num_threads(1)
    baseline = Baseline(buffer)
    clients = {name: Client(url, kv) for name, url in urls.items()}
    samples: dict[str, list[float]] = {name: [] for name in ROWS}
    try:
        for it in range(iterations + 1):
            ids = block_ids(it)
            times = {"baseline gather": baseline.gather(ids), "baseline scatter": baseline.scatter(ids[::-1])}
            for name, client in clients.items():
                times[f"STORE, {name}"] = client.store(it)
            for name, client in clients.items():
                times[f"RETRIEVE, {name}"] = client.retrieve(it)
            if it:
                for name in ROWS:
                    samples[name].append(times[name])
        return samples
    finally:
        for client in clients.values():
            client.close()


ROWS = ("baseline gather", "STORE, 1 thread", "baseline scatter", "RETRIEVE, 1 thread", "RETRIEVE, split")


def plot(rows: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(rows)
    ax.bar(names, [rows[n] for n in names], color=["#999", "#1f77b4", "#999", "#ff7f0e", "#d62728"])
    for i, n in enumerate(names):
        ax.annotate(f"{rows[n]:.1f}", (i, rows[n]), ha="center", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("KV copy throughput (32 layers x 8 heads x 128, bf16, 256-token chunks)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="where to write the PNG and JSON")
    parser.add_argument("--iterations", type=int, default=8, help="requests per direction")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp"))
    nbytes = request_bytes()
    print(f"KV cache {LAYERS} layers x {NUM_BLOCKS} blocks; {nbytes / 2**20:.0f} MiB per request", flush=True)
    buffer, kv = make_kv()
    daemons = {}
    try:
        for name, workers in (("1 thread", 1), ("split", 2)):  # copy threads: two split a RETRIEVE
            (tmp / str(workers)).mkdir()
            daemons[name] = start_daemon(tmp / str(workers), "--l1-size-gb", "1.2", "--chunk-size",
                                         str(CHUNK), "--max-workers", str(workers))
        samples = measure(buffer, kv, {name: d.url for name, d in daemons.items()}, args.iterations)
    finally:
        for daemon in daemons.values():
            daemon.stop()

    rows = {name: nbytes / statistics.median(samples[name]) / 1e9 for name in ROWS}
    ratios = {"STORE / gather": rows["STORE, 1 thread"] / rows["baseline gather"],
              "RETRIEVE, 1 thread / scatter": rows["RETRIEVE, 1 thread"] / rows["baseline scatter"],
              "RETRIEVE, split / scatter": rows["RETRIEVE, split"] / rows["baseline scatter"]}
    speedup = rows["RETRIEVE, split"] / rows["RETRIEVE, 1 thread"]
    print(f"\n{'path':<22}{'GB/s':>8}{'median ms':>12}")
    for name, rate in rows.items():
        print(f"{name:<22}{rate:>8.2f}{statistics.median(samples[name]) * 1e3:>12.1f}")
    print(f"split RETRIEVE / 1-thread RETRIEVE: {speedup:.2f}x")
    finish(args.out, "data_plane", {f"{name} = {ratio:.0%} (target >= 70%)": ratio >= 0.7
                                    for name, ratio in ratios.items()},
           {"gbps": rows, "ratios": ratios, "request_bytes": nbytes, "split_speedup": speedup},
           lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
