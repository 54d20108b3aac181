#!/usr/bin/env python
"""CPU registration: how long a vLLM worker takes to register its CPU KV cache with the daemon.

    .venv/bin/python scripts/bench/bench_register.py [--sizes-gb 1 8] [--repeats 2] [--quick]
                                                     [--out bench-out]

The cache is in vLLM's CPU layout (CPU_ATTN: per layer [blocks, 8 KV heads, 128 tokens, 2 x 128],
bf16, 32 layers, all layers views of one allocation, as vLLM allocates it). Each measurement is a
fresh worker process (this script, `--child`) that allocates the cache, fills the two blocks of one
chunk, and times the real adapter's `register_kv_caches` against a real daemon (it returns when the
daemon has confirmed the registration); then it stores that chunk and retrieves it into two other
blocks, and checks both byte-exact: the daemon really reads and writes the worker's memory.

Paths, each in its own process:
- `memfd`: registering moves the cache itself (`lmcache_mp.transfer.shm_move`).
- `allocated`: the cache is allocated in shared memory from the start (`AllocateInSharedMemory`, what
  the connector gives vLLM as its KV-cache allocation context), so registering moves nothing; its
  allocation time is shown next to the plain `torch.zeros` of the other paths.
Baseline, same run: `memset` of a freshly mapped region of the cache's size (faulting memory in).
Target: registration <= 0.5 s per GiB. Seconds are wall time; CPU seconds (user + system,
all threads) are shown too, since wall time on a loaded machine says little. Prints a table,
writes register.json and register.png to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import available_gib, figure, finish, memset_s, parser, scratch

from lmcache_mp.testing.launcher import start_daemon
from lmcache_mp.transfer.shm_move import AllocateInSharedMemory
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

LAYERS, KV_HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 128, 256
DTYPE = torch.bfloat16
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK * 2 * HEAD * DTYPE.itemsize  # one block, all layers: 16 MiB
STORED, RETRIEVED = [0, 1], [3, 2]  # one chunk's blocks, and where it is retrieved to
# (A third path, torch's own `share_memory_()`, is gone: the daemon now maps only memfds sealed
# against shrinking, which torch's are not.)
PATHS = ("memfd", "allocated")
TARGET_S_PER_GIB = 0.5
SPARE_GIB = 2.0
CHILD_TIMEOUT_S = 600


# ---- the worker process ----------------------------------------------------------------------


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def allocate(nbytes: int, shared: bool) -> dict[str, torch.Tensor]:
    """vLLM's CPU allocation: one zeroed buffer, every layer a view of it."""
    if shared:
        with AllocateInSharedMemory():
            buffer = torch.zeros(nbytes, dtype=torch.int8, device=torch.device("cpu"))
    else:
        buffer = torch.zeros(nbytes, dtype=torch.int8, device=torch.device("cpu"))
    layers = buffer.view(DTYPE).view(LAYERS, nbytes // BLOCK_BYTES, KV_HEADS, BLOCK, 2 * HEAD)
    return {f"model.layers.{i}.self_attn.attn": layers[i] for i in range(LAYERS)}


def chunk_pages(kv: dict[str, torch.Tensor], blocks: list[int]) -> torch.Tensor:
    return torch.stack([layer[blocks] for layer in kv.values()]).view(torch.int16)


def wait_finished(worker: LMCacheMPWorkerAdapter, request_id: str, retrieve: bool) -> None:
    deadline = time.monotonic() + 60
    while request_id not in worker.get_finished({request_id})[1 if retrieve else 0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} did not finish")
        time.sleep(0.002)


def round_trip(url: str, worker: LMCacheMPWorkerAdapter, hashes: list[bytes]) -> None:
    """STORE one chunk, LOOKUP it, RETRIEVE it into other blocks."""
    worker.submit_store_request("store", LoadStoreOp(STORED, block_hashes=hashes), None)
    wait_finished(worker, "store", retrieve=False)
    scheduler = LMCacheMPSchedulerAdapter(url, None, "bench", 1, 0, BLOCK)
    try:
        scheduler.maybe_submit_lookup_request("load", block_hashes=hashes)
        while (hit := scheduler.check_lookup_result("load")) is None:
            time.sleep(0.001)
        assert hit == CHUNK, f"LOOKUP found {hit} tokens, expected {CHUNK}"
        worker.submit_retrieve_request("load", LoadStoreOp(RETRIEVED, block_hashes=hashes), None)
        wait_finished(worker, "load", retrieve=True)
        assert not worker.take_failed_retrieves(), "the RETRIEVE failed"
    finally:
        scheduler.shutdown()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lmcache_mp.transfer.shm_move").addHandler(handler)
    logging.getLogger("lmcache_mp.transfer.shm_move").setLevel(logging.INFO)

    started = time.perf_counter()
    kv = allocate(spec["bytes"], shared=spec["path"] == "allocated")
    allocate_s = time.perf_counter() - started
    chunk = torch.randint(-1000, 1000, chunk_pages(kv, STORED).shape, dtype=torch.int16)
    for i, layer in enumerate(kv.values()):
        layer[STORED] = chunk[i].view(DTYPE)
    worker = LMCacheMPWorkerAdapter(spec["url"], None, "bench", 1, 0, BLOCK)
    try:
        wall, cpu = time.perf_counter(), cpu_seconds()
        worker.register_kv_caches(kv, "CPU_ATTN")
        register_s, register_cpu_s = time.perf_counter() - wall, cpu_seconds() - cpu
        assert torch.equal(chunk_pages(kv, STORED), chunk), "registration changed the cache's bytes"
        round_trip(spec["url"], worker, [hashlib.sha256(os.urandom(16)).digest() for _ in STORED])
        assert torch.equal(chunk_pages(kv, RETRIEVED), chunk), "the retrieved chunk is not the stored one"
    finally:
        worker.shutdown()
    return {"allocate_s": allocate_s, "register_s": register_s, "register_cpu_s": register_cpu_s, "log": logs}


# ---- the parent --------------------------------------------------------------------------------




def run_child(url: str, path: str, nbytes: int) -> dict[str, Any]:
    spec = json.dumps({"url": url, "path": path, "bytes": nbytes})
    out = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the {path} worker failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The benchmark must measure the path it names, not a fallback.
    assert any(line.endswith("memfd)") for line in result["log"]), result["log"]
    return result


def needed_gib(path: str, size_gib: float) -> float:
    # The memfd move gives the old memory back as it goes, and an allocation in shared memory has
    # only one: the cache's size once.
    return size_gib + SPARE_GIB


def measure(url: str, sizes: list[float], repeats: int) -> dict[str, dict[str, Any]]:
    """Per size: the memset baseline and each path, interleaved, `repeats` times; medians."""
    results: dict[str, dict[str, Any]] = {}
    for size in sizes:
        nbytes = int(size * 2**30) // BLOCK_BYTES * BLOCK_BYTES
        samples: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
        baseline: list[float] = []
        for _ in range(repeats):
            if nbytes / 2**30 + SPARE_GIB > available_gib():
                print(f"skipped {size:g} GiB: {available_gib():.1f} GiB available", flush=True)
                break
            baseline.append(memset_s(nbytes))
            for path in PATHS:
                if needed_gib(path, size) > available_gib():
                    print(f"skipped {path} at {size:g} GiB: {available_gib():.1f} GiB available, "
                          f"needs {needed_gib(path, size):.1f}", flush=True)
                    continue
                samples[path].append(run_child(url, path, nbytes))
                print(f"  {size:g} GiB {path}: {samples[path][-1]['register_s']:.2f} s", flush=True)
        if not baseline:
            continue
        gib = nbytes / 2**30
        row: dict[str, Any] = {"gib": gib, "memset_s": statistics.median(baseline)}
        for path, runs in samples.items():
            if runs:
                row[path] = {key: statistics.median(run[key] for run in runs)
                             for key in ("register_s", "register_cpu_s", "allocate_s")}
        results[f"{size:g}"] = row
    return results


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print("\n| cache | path | register s | s/GiB | GB/s | CPU s/GiB | allocation s |")
    print("|---|---|---|---|---|---|---|")
    for size, row in results.items():
        gib = row["gib"]
        print(f"| {size} GiB | memset baseline | {row['memset_s']:.2f} | {row['memset_s'] / gib:.2f} | "
              f"{gib * 2**30 / row['memset_s'] / 1e9:.2f} | | |")
        for path in PATHS:
            if path in row:
                r = row[path]
                print(f"| {size} GiB | {path} | {r['register_s']:.2f} | {r['register_s'] / gib:.3f} | "
                      f"{gib * 2**30 / r['register_s'] / 1e9:.2f} | {r['register_cpu_s'] / gib:.3f} | "
                      f"{r['allocate_s']:.2f} |")


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    labels = ["memset baseline", *PATHS]
    colors = ["#999", "#d62728", "#1f77b4", "#2ca02c"]
    with figure(path, figsize=(7, 3.5)) as ax:
        width = 0.8 / len(labels)
        for i, row in enumerate(results.values()):
            values = [row["memset_s"] / row["gib"]] + [row[p]["register_s"] / row["gib"] if p in row else 0
                                                        for p in PATHS]
            for j, value in enumerate(values):
                x = i + (j - (len(labels) - 1) / 2) * width
                ax.bar(x, value, width, color=colors[j], label=labels[j] if i == 0 else None)
                ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=7)
        ax.axhline(TARGET_S_PER_GIB, color="k", linestyle="--", linewidth=0.8, label="target")
        ax.set_xticks(range(len(results)), [f"{size} GiB cache" for size in results])
        ax.set_ylabel("seconds per GiB (lower is better)")
        ax.set_title("CPU KV-cache registration (vLLM CPU layout, real daemon)", fontsize=9)
        ax.legend(fontsize=7)


def main() -> int:
    command = parser(__doc__, "1 GiB, one run per path")
    command.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 8], help="cache sizes in GiB")
    command.add_argument("--repeats", type=int, default=2, help="runs per size and path (medians)")
    command.add_argument("--child", help=argparse.SUPPRESS)
    args = command.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    sizes, repeats = ([1.0], 1) if args.quick else (args.sizes_gb, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    with scratch("lmc-bench-") as tmp:
        daemon = start_daemon(tmp, "--l1-size-gb", "0.1", "--chunk-size", str(CHUNK))
        try:
            results = measure(daemon.url, sizes, repeats)
        finally:
            daemon.stop()
    print_table(results)
    checks = {f"{path} at {size} GiB: {row[path]['register_s'] / row['gib']:.2f} s/GiB "
              f"(target <= {TARGET_S_PER_GIB})": row[path]["register_s"] / row["gib"] <= TARGET_S_PER_GIB
              for size, row in results.items() for path in ("memfd", "allocated") if path in row}
    finish(args.out, "register", checks, {"results": results, "load_average": os.getloadavg()},
           lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
