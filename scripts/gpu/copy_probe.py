#!/usr/bin/env python
"""Where a STORE's and a RETRIEVE's time goes on a GPU, in one process, no daemon:

    python scripts/gpu/copy_probe.py [--chunks 8] [--repeats 7]

The daemon's own copy code (`TransferContext`: the staged gather/scatter and the lane's copy
stream) between a cache allocated as vLLM 0.32 allocates it (FLASH_ATTN, LBNHC, 32 layers x 8 KV
heads x 128, bf16, 16-token blocks) and page-locked host memory registered as the daemon's pool
registers it (`cudaHostRegister` of an mmap), against a single `copy_` of the same bytes (torch's
pinned memory, and the registered mmap), and split into its parts: the gathers alone (device to
staging buffer) and the chunk DMAs alone. What `selftest.py` measures end to end adds the
control plane (ZeroMQ, the worker's event, the reply) to the first row.
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's code, installed or not (a lent GPU machine has no venv)

from lmcache_mp.testing.vllm_caches import allocate_like_vllm  # noqa: E402
from lmcache_mp.transfer.context import Lane, TransferContext, as_words  # noqa: E402
from lmcache_mp.transfer.cuda import register_host_memory  # noqa: E402
from lmcache_mp.transfer.layouts import describe_caches  # noqa: E402

CHUNK_TOKENS, BLOCK = 256, 16


def timed(work: Callable[[], None], repeats: int) -> float:
    """Median seconds of `work` to completion on the device."""
    work()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def store_timeline(ctx: TransferContext, ids: list[int], chunks: list[torch.Tensor], repeats: int) -> None:
    """A TransferContext STORE seen from the host and from the device: how long the host takes to
    enqueue it, the device's time per chunk (gather and DMA; events on the lane's stream), and the
    whole operation's wall time (the lane's wait for its completion included). Host-bound if the
    enqueue takes about as long as the device does."""
    rows: list[tuple[float, float, float, list[float]]] = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(chunks) + 1)]
        start = time.perf_counter()
        with ctx.operation(ids, b"", Lane.STORE) as copies:
            marks[0].record()  # the lane's stream is the current one inside the operation
            for i, chunk in enumerate(chunks):
                copies.gather(i, chunk)
                marks[i + 1].record()
            enqueued = time.perf_counter() - start
        wall = time.perf_counter() - start
        per_chunk = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        rows.append((enqueued * 1e3, wall * 1e3, sum(per_chunk), per_chunk))
    enqueued, wall, device_ms, per_chunk = sorted(rows[1:], key=lambda row: row[1])[len(rows[1:]) // 2]
    print(f"STORE timeline (median of {repeats} by wall time): host enqueue {enqueued:.2f} ms, device "
          f"{device_ms:.2f} ms (per chunk {' '.join(f'{ms:.2f}' for ms in per_chunk)}), wall {wall:.2f} ms",
          flush=True)


def per_request_costs(device: torch.device, ids: list[int], count: int = 200) -> dict[str, float]:
    """Microseconds, median of `count`: the worker's event (create, record, export), the daemon's
    block-id upload, and the daemon's opening of the worker's event (in another process, as the
    daemon does: CUDA opens no IPC handle of its own process)."""
    def worker_event() -> torch.cuda.Event:
        event = torch.cuda.Event(interprocess=True)
        event.record()
        event.ipc_handle()
        return event

    costs = {"worker: interprocess event created, recorded, exported": _median_us(worker_event, count),
             "daemon: block ids uploaded (pageable, non_blocking)": _median_us(
                 lambda: torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True), count)}
    events = [worker_event() for _ in range(count)]
    torch.cuda.synchronize()
    child = subprocess.run([sys.executable, __file__, "--open-events"], capture_output=True, text=True,
                           input="\n".join(event.ipc_handle().hex() for event in events), timeout=120)
    if child.returncode:
        raise RuntimeError(f"the event-opening process failed: {child.stderr}")
    costs["daemon: worker's event opened (from_ipc_handle) and waited on"] = float(child.stdout.split()[-1])
    return costs


def _median_us(work: Callable[[], object], count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def open_events() -> None:
    """The child of `per_request_costs`: open each event handle read from stdin, print the median."""
    handles = [bytes.fromhex(line) for line in sys.stdin.read().split()]
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    opened = iter(handles)
    def open_and_wait() -> None:
        torch.cuda.Event.from_ipc_handle(device, next(opened)).wait(stream)
    print(_median_us(open_and_wait, len(handles)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8, help="chunks per request")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--open-events", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.open_events:
        open_events()
        return 0
    device = torch.device("cuda", 0)
    blocks_per_request = args.chunks * CHUNK_TOKENS // BLOCK
    _, caches = allocate_like_vllm(32, 2 * blocks_per_request + 8, 8, BLOCK, 128, torch.bfloat16,
                                   "LBNHC", device=device)
    layers, geometry = describe_caches(list(caches.values()), "FLASH_ATTN", BLOCK)
    ctx = TransferContext(layers, geometry, CHUNK_TOKENS)
    ids = random.Random(0).sample(range(geometry.num_blocks), blocks_per_request)
    nbytes = ctx.chunk_nbytes * args.chunks
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(area, dtype=torch.uint8)
    unpin = register_host_memory(host.data_ptr(), nbytes)
    size = ctx.chunk_nbytes
    chunks = [ctx.chunk_view(host[i * size:(i + 1) * size]) for i in range(args.chunks)]
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat = torch.ones(nbytes, dtype=torch.uint8, device=device)
    staging = torch.empty((args.chunks, *chunks[0].shape), dtype=geometry.dtype, device=device)

    def store() -> None:
        with ctx.operation(ids, b"", Lane.STORE) as copies:
            for i, chunk in enumerate(chunks):
                copies.gather(i, chunk)

    def retrieve() -> None:
        with ctx.operation(ids, b"", Lane.LOAD) as copies:
            for i, chunk in enumerate(chunks):
                copies.scatter(chunk, i)

    index = torch.tensor(ids, device=device).view(args.chunks, -1)
    all_layers = ctx._all_layers
    assert all_layers is not None, "the layers are not one stacked view"

    def gathers_only() -> None:
        for i in range(args.chunks):
            torch.index_select(all_layers, 1, index[i], out=staging[i])

    words, staging_words = as_words(all_layers, staging)

    def gathers_in_words() -> None:
        for i in range(args.chunks):
            torch.index_select(words, 1, index[i], out=staging_words[i])

    def dmas_only() -> None:
        for i, chunk in enumerate(chunks):
            chunk.copy_(staging[i], non_blocking=True)

    gather_stream, dma_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def overlapped() -> None:
        """The next step's upper bound: each chunk's gather (into one of two staging slots, on its
        own stream) overlaps the previous chunk's DMA (on another)."""
        gathered = [torch.cuda.Event() for _ in chunks]
        sent = [torch.cuda.Event() for _ in chunks]
        for i, chunk in enumerate(chunks):
            with torch.cuda.stream(gather_stream):
                if i >= 2:
                    gather_stream.wait_event(sent[i - 2])
                torch.index_select(words, 1, index[i], out=staging_words[i % 2])
                gathered[i].record(gather_stream)
            with torch.cuda.stream(dma_stream):
                dma_stream.wait_event(gathered[i])
                chunk.copy_(staging[i % 2], non_blocking=True)
                sent[i].record(dma_stream)

    rows = [
        ("STORE, TransferContext (gather + DMA per chunk)", store),
        ("  gathers alone (device -> staging), 2-byte elements", gathers_only),
        ("  gathers alone (device -> staging), 8-byte words", gathers_in_words),
        ("  chunk DMAs alone (staging -> registered host)", dmas_only),
        ("  gathers overlapping the DMAs (2 slots, 2 streams)", overlapped),
        ("RETRIEVE, TransferContext (DMA + scatter per chunk)", retrieve),
        ("baseline: one copy_ device -> torch pinned", lambda: pinned.copy_(flat, non_blocking=True)),
        ("baseline: one copy_ device -> registered mmap", lambda: host.copy_(flat, non_blocking=True)),
        ("baseline: one copy_ torch pinned -> device", lambda: flat.copy_(pinned, non_blocking=True)),
    ]
    print(f"{torch.cuda.get_device_name(device)}; {args.chunks} chunks of {ctx.chunk_nbytes / 2**20:.0f} MiB "
          f"({nbytes / 2**20:.0f} MiB a request)")
    for name, work in rows:
        seconds = timed(work, args.repeats)
        print(f"{name:<55}{seconds * 1e3:>8.2f} ms {nbytes / seconds / 1e9:>7.1f} GB/s", flush=True)
    store_timeline(ctx, ids, chunks, args.repeats)
    print("per-request costs besides the copies:")
    for name, micros in per_request_costs(device, ids).items():
        print(f"  {name:<53}{micros:>8.1f} us", flush=True)
    unpin()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
