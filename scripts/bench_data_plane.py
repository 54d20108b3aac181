#!/usr/bin/env python
"""Data-plane benchmark: STORE and RETRIEVE throughput through the real daemon.

    .venv/bin/python scripts/bench_data_plane.py [--out bench-out]

KV in vLLM's CPU layout (CPU_ATTN, [blocks, kv_heads, block_size, 2*head_size] per layer,
all layers views of one allocation) at a realistic geometry: 32 layers, 8 KV heads, head
size 128, bf16, 128-token blocks, 256-token chunks (16 MiB... 32 MiB per chunk). Each request
moves 8 chunks. "End to end" is the adapter's request -> daemon copy -> reply.
Baseline, same process, same run: the fastest single-threaded torch gather and scatter of the
very same pages into/out of chunk-shaped buffers that we know of: `index_select` to gather, one
`copy_` per page to scatter (2.4x faster than `index_copy_` here, so the bar is higher).
RETRIEVE runs twice, against a daemon with one copy thread (`--max-workers 1`) and against one
with two (the default), which splits a RETRIEVE's chunks over both (issue 12).
Target (issue 5): >= 70% of the baseline in both directions. Prints a table, writes
data_plane.png and data_plane.json to --out.
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
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

LAYERS, KV_HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 128, 256
CHUNKS_PER_REQUEST = 8
BLOCKS_PER_CHUNK = CHUNK // BLOCK
NUM_BLOCKS = 48  # 768 MiB of KV cache
DTYPE = torch.bfloat16


def make_kv() -> dict[str, torch.Tensor]:
    buffer = torch.empty(LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
    buffer.view(torch.int16).random_(-1000, 1000)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}


def request_bytes() -> int:
    return LAYERS * CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK * KV_HEADS * BLOCK * 2 * HEAD * DTYPE.itemsize


def block_ids(iteration: int) -> list[int]:
    n = CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK
    start = (iteration * 7) % (NUM_BLOCKS - n)
    return list(range(start, start + n))[::-1]  # not ascending: like vLLM after block reuse


def hashes_for(iteration: int) -> list[bytes]:
    n = CHUNKS_PER_REQUEST * BLOCKS_PER_CHUNK
    return [hashlib.sha256(f"{iteration}-{b}".encode()).digest() for b in range(n)]


def baseline(kv: dict[str, torch.Tensor], iterations: int) -> tuple[list[float], list[float]]:
    """Single-threaded torch gather and scatter of the same pages, chunk by chunk."""
    ids_per_chunk = [block_ids(it) for it in range(iterations)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        views = list(kv.values())
        chunks = [torch.empty(LAYERS, BLOCKS_PER_CHUNK, KV_HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
                  for _ in range(CHUNKS_PER_REQUEST)]
        gather, scatter = [], []
        for it in range(iterations):
            ids = torch.tensor(block_ids(it))
            per_chunk = ids.view(CHUNKS_PER_REQUEST, BLOCKS_PER_CHUNK)
            t = time.perf_counter()
            for c, chunk in enumerate(chunks):
                for layer, view in enumerate(views):
                    torch.index_select(view, 0, per_chunk[c], out=chunk[layer])
            gather.append(time.perf_counter() - t)
            t = time.perf_counter()
            for c, chunk in enumerate(chunks):
                pairs = list(enumerate(ids_per_chunk[it][c * BLOCKS_PER_CHUNK:(c + 1) * BLOCKS_PER_CHUNK]))
                for layer, view in enumerate(views):
                    for i, block in pairs:
                        view[block].copy_(chunk[layer, i])
            scatter.append(time.perf_counter() - t)
        return gather, scatter
    finally:
        torch.set_num_threads(threads)


def through_daemon(url: str, kv: dict[str, torch.Tensor], iterations: int) -> tuple[list[float], list[float]]:
    worker = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(url, None, "bench", 1, 0, BLOCK)
    client = worker.mq_client
    from lmcache_mp.protocol import RequestType

    store_s, retrieve_s = [], []
    try:
        worker.register_kv_caches(kv, "CPU_ATTN")
        keys_of = worker._keys.keys_for
        for it in range(iterations + 1):  # the first round warms up
            ids = block_ids(it)
            op = LoadStoreOp(ids, block_hashes=hashes_for(it))
            keys = keys_of(f"r{it}", op)
            t = time.perf_counter()
            result = client.submit(RequestType.STORE, [keys, worker.instance_id, ids, b""]).result(60)
            elapsed = time.perf_counter() - t
            assert all(o == 0 for o in result.outcomes), result.outcomes
            scheduler.maybe_submit_lookup_request(f"r{it}", block_hashes=op.block_hashes)
            while (hit := scheduler.check_lookup_result(f"r{it}")) is None:
                time.sleep(0.0005)
            assert hit == CHUNKS_PER_REQUEST * CHUNK, hit
            t2 = time.perf_counter()
            reply = client.submit(RequestType.RETRIEVE, [keys, worker.instance_id, ids[::-1], b""]).result(60)
            elapsed2 = time.perf_counter() - t2
            assert reply.ok, reply.reason
            scheduler.cleanup_lookup_result(f"r{it}")
            if it:
                store_s.append(elapsed)
                retrieve_s.append(elapsed2)
        return store_s, retrieve_s
    finally:
        worker.shutdown()
        scheduler.shutdown()


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
    kv = make_kv()
    gather, scatter = baseline(kv, args.iterations)
    retrieve: dict[int, list[float]] = {}
    for workers in (1, 2):  # copy threads: a RETRIEVE is split over both when there are two
        daemon = start_daemon(tmp, "--l1-size-gb", "1.2", "--chunk-size", str(CHUNK),
                              "--max-workers", str(workers))
        try:
            store, retrieve[workers] = through_daemon(daemon.url, kv, args.iterations)
        finally:
            daemon.stop()

    def gbps(samples: list[float]) -> float:
        return nbytes / statistics.median(samples) / 1e9

    rows = {"baseline gather": gbps(gather), "STORE": gbps(store), "baseline scatter": gbps(scatter),
            "RETRIEVE, 1 thread": gbps(retrieve[1]), "RETRIEVE, split": gbps(retrieve[2])}
    ratios = {"STORE / gather": rows["STORE"] / rows["baseline gather"],
              "RETRIEVE, 1 thread / scatter": rows["RETRIEVE, 1 thread"] / rows["baseline scatter"],
              "RETRIEVE, split / scatter": rows["RETRIEVE, split"] / rows["baseline scatter"]}
    print(f"\n{'path':<22}{'GB/s':>8}{'median ms':>12}")
    for (name, rate), samples in zip(rows.items(), (gather, store, scatter, retrieve[1], retrieve[2]),
                                     strict=True):
        print(f"{name:<22}{rate:>8.2f}{statistics.median(samples) * 1e3:>12.1f}")
    print(f"split RETRIEVE / 1-thread RETRIEVE: {rows['RETRIEVE, split'] / rows['RETRIEVE, 1 thread']:.2f}x")
    finish(args.out, "data_plane", {f"{name} = {ratio:.0%} (target >= 70%)": ratio >= 0.7
                                    for name, ratio in ratios.items()},
           {"gbps": rows, "ratios": ratios, "request_bytes": nbytes,
            "split_speedup": rows["RETRIEVE, split"] / rows["RETRIEVE, 1 thread"]},
           lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
