#!/usr/bin/env python
"""Self-test of the data path on a GPU (or on CPU): the real daemon and a worker, no vLLM.

    .venv/bin/python scripts/gpu_selftest.py [--device cuda|cpu] [--quick] [--out FILE]
                                             [--pin-gib 8,32]

Two processes: `lmcache-mp serve` and this script as the worker. For each KV layout vLLM 0.32
uses on a GPU (FLASH_ATTN and FLASHINFER: `[num_blocks, kv_heads, block_size, 2*head_size]`
per layer; MLA: `[num_blocks, block_size, latent_dim]`) the worker allocates one cache tensor
per layer on `--device`, registers them through `LMCacheMPWorkerAdapter`, and runs rounds of:
  STORE     the pages of one request (`--chunks` chunks) written into scattered blocks, stored;
  LOOKUP    through `LMCacheMPSchedulerAdapter`, which must hit every chunk (and lease it);
  RETRIEVE  into other scattered blocks, then compared bit for bit with what was written.
The first round checks ordering. On CUDA the worker writes the pages on a side stream behind
a long-running kernel and STOREs at once with an interprocess event recorded after the write:
only a daemon that waits on the event stores the written bytes. Likewise it clears the
retrieve's blocks behind a long kernel and RETRIEVEs at once with an event: only a daemon that
waits writes its bytes after the clearing. On CPU writes are synchronous and no event is sent.
The other rounds are timed (submit to reported finished) and give STORE and RETRIEVE GB/s,
next to a same-run baseline moving the same bytes: on CUDA a pinned-host <-> device `copy_`,
on CPU a plain `copy_` between two tensors (the shared-memory path's analogue). Each round
checks the path it measured: the daemon's STATUS counts one new object per stored chunk, the
lookup hits every chunk, the retrieve spends its leases. On CUDA it also times pinning
(`cudaHostRegister`) fresh mmaps of `--pin-gib` GiB, skipping sizes the host cannot hold.

Prints a table, writes the figures as JSON to `--out`; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
# This checkout's code, in this process and in the daemon it starts, installed or not.
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))

from lmcache_mp.config import available_memory_bytes  # noqa: E402
from lmcache_mp.launcher import DaemonProcess, daemon_status, start_daemon  # noqa: E402
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp  # noqa: E402

MODEL = "gpu-selftest"
# Layout in the report -> the attention backend name the worker registers with (what vLLM sends).
LAYOUTS = {"FLASH_ATTN": "FLASH_ATTN", "FLASHINFER": "FLASHINFER", "MLA": "TRITON_MLA"}
POLL_S = 0.0002  # between get_finished polls while a request is timed
WAIT_S = 60.0  # the longest a request may take before the run fails
# The pin test leaves this much of the host's available memory untouched.
PIN_HEADROOM_BYTES = 4 << 30


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_size: int
    latent_dim: int  # MLA: kv_lora_rank + rope dim
    block_size: int
    chunk_size: int
    chunks: int  # chunks per request
    rounds: int  # timed rounds per layout, after the ordering round
    dtype: torch.dtype = torch.bfloat16

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def blocks_per_request(self) -> int:
        return self.chunks * self.blocks_per_chunk

    def page_shape(self, layout: str) -> tuple[int, ...]:
        """One block of one layer, the block dimension removed."""
        if layout == "MLA":
            return (self.block_size, self.latent_dim)
        return (self.kv_heads, self.block_size, 2 * self.head_size)

    def request_bytes(self, layout: str) -> int:
        page = torch.Size(self.page_shape(layout)).numel() * self.dtype.itemsize
        return self.layers * self.blocks_per_request * page


# A Llama-3-8B-like model (32 layers, 8 KV heads of 128) and a DeepSeek-like MLA latent (512 + 64),
# vLLM's GPU block size 16, 256-token chunks: 32 MiB per chunk, 8 chunks (256 MiB) per request.
FULL = Geometry(layers=32, kv_heads=8, head_size=128, latent_dim=576, block_size=16, chunk_size=256,
                chunks=8, rounds=5)
QUICK = Geometry(layers=4, kv_heads=2, head_size=64, latent_dim=96, block_size=16, chunk_size=64,
                 chunks=2, rounds=3)


# ---- the device: every CUDA-specific line lives in CudaDevice ---------------------------------


class CpuDevice:
    """Synchronous writes, no streams and no events: the reply of a request means it is done."""

    name = "cpu"
    torch_device = torch.device("cpu")
    ordering_checked = False  # nothing runs behind the worker's back to order against

    def description(self) -> str:
        return f"CPU, torch {torch.__version__}"

    def behind_long_kernel(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record_event(self) -> torch.cuda.Event | None:
        return None

    def synchronize(self) -> None:
        pass

    def copy_baseline(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """GB/s of `copy_` between two tensors of `nbytes`, each way: what the shared-memory path
        does at best, one contiguous memcpy."""
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        return _copy_gbps(b, a, self, repeats), _copy_gbps(a, b, self, repeats)

    def pin_seconds(self, nbytes: int) -> float:
        raise RuntimeError("pinning host memory needs CUDA")

    def release_cached_memory(self) -> None:
        pass


class CudaDevice:
    name = "cuda"
    ordering_checked = True

    def __init__(self, delay_cycles: int):
        self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self._side = torch.cuda.Stream(self.torch_device)
        self._delay_cycles = delay_cycles

    def description(self) -> str:
        props = torch.cuda.get_device_properties(self.torch_device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"

    @contextlib.contextmanager
    def behind_long_kernel(self) -> Iterator[None]:
        """Run the block's work on the side stream behind a kernel that spins `delay_cycles`
        (after what the current stream queued so far, e.g. the pages to write)."""
        self._side.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self._side):
            torch.cuda._sleep(self._delay_cycles)
            yield

    def record_event(self) -> torch.cuda.Event:
        """An interprocess event after everything queued on the side stream: what the daemon waits on."""
        event = torch.cuda.Event(interprocess=True)
        event.record(self._side)
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def copy_baseline(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """GB/s of `copy_` device -> pinned host (what a STORE moves) and back (a RETRIEVE)."""
        device = torch.ones(nbytes, dtype=torch.uint8, device=self.torch_device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return _copy_gbps(host, device, self, repeats), _copy_gbps(device, host, self, repeats)

    def pin_seconds(self, nbytes: int) -> float:
        """Seconds `cudaHostRegister` takes to pin a fresh anonymous mmap of `nbytes` (untouched:
        pinning faults every page in), as the daemon pins its pool in pieces."""
        cudart = torch.cuda.cudart()
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(area)
        address = ctypes.addressof(anchor)
        try:
            start = time.perf_counter()
            error = cudart.cudaHostRegister(address, nbytes, 0)
            elapsed = time.perf_counter() - start
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {error}")
            cudart.cudaHostUnregister(address)
            return elapsed
        finally:
            del anchor  # the mmap cannot close while a ctypes object holds its buffer
            area.close()


Device = CpuDevice | CudaDevice


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, device: Device, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    device.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        device.synchronize()
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


# ---- one layout -------------------------------------------------------------------------------


@dataclass
class LayoutReport:
    layout: str
    backend: str
    cache_shape: list[int]
    request_bytes: int
    rounds: int = 0
    chunks_expected: int = 0
    chunks_stored: int = 0  # new objects in the daemon's pool, by STATUS
    chunks_hit: int = 0  # chunks the lookups found
    chunks_retrieved: int = 0  # chunks of retrieves that reported success and compared equal
    bit_exact: bool = True
    ordering_checked: bool = False
    ordering_store_s: float = 0.0
    ordering_retrieve_s: float = 0.0
    store_gbps: float = 0.0
    retrieve_gbps: float = 0.0
    baseline_store_gbps: float = 0.0
    baseline_retrieve_gbps: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def store_vs_baseline(self) -> float:
        return self.store_gbps / self.baseline_store_gbps if self.baseline_store_gbps else 0.0

    @property
    def retrieve_vs_baseline(self) -> float:
        return self.retrieve_gbps / self.baseline_retrieve_gbps if self.baseline_retrieve_gbps else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "store_vs_baseline": self.store_vs_baseline,
                "retrieve_vs_baseline": self.retrieve_vs_baseline}


class LayoutRun:
    """One registered worker with caches in one layout, and the rounds run through it."""

    def __init__(self, layout: str, geo: Geometry, device: Device, url: str,
                 scheduler: LMCacheMPSchedulerAdapter, seed: int):
        self.layout, self.geo, self.device, self.url, self.scheduler = layout, geo, device, url, scheduler
        n = geo.blocks_per_request
        num_blocks = 2 * n + 8  # a few never used, so that neither request's blocks are 0..n-1
        shape = (num_blocks, *geo.page_shape(layout))
        # One tensor per layer, as vLLM allocates them on a GPU.
        self.caches = {f"model.layers.{i}.attn": torch.zeros(shape, dtype=geo.dtype,
                                                             device=device.torch_device)
                       for i in range(geo.layers)}
        rng = random.Random(seed)
        picked = rng.sample(range(num_blocks), 2 * n)  # scattered, not ascending: like vLLM's
        self.src_ids, self.dst_ids = picked[:n], picked[n:]
        self.src_index = torch.tensor(self.src_ids, device=device.torch_device)
        self.dst_index = torch.tensor(self.dst_ids, device=device.torch_device)
        self.report = LayoutReport(layout, LAYOUTS[layout], list(shape), geo.request_bytes(layout))
        self.worker = LMCacheMPWorkerAdapter(url, None, MODEL, 1, 0, geo.block_size)

    def run(self, baseline: tuple[float, float]) -> LayoutReport:
        report = self.report
        report.baseline_store_gbps, report.baseline_retrieve_gbps = baseline
        try:
            self.worker.register_kv_caches(self.caches, layout=LAYOUTS[self.layout])
            report.ordering_checked = self.device.ordering_checked
            report.ordering_store_s, report.ordering_retrieve_s = self._round(0, behind_kernel=True)
            timed = [self._round(r, behind_kernel=False) for r in range(1, self.geo.rounds + 1)]
        finally:
            self.worker.shutdown()
        report.rounds = self.geo.rounds + 1
        report.store_gbps = report.request_bytes / statistics.median(t[0] for t in timed) / 1e9
        report.retrieve_gbps = report.request_bytes / statistics.median(t[1] for t in timed) / 1e9
        return report

    def _round(self, number: int, behind_kernel: bool) -> tuple[float, float]:
        """Store fresh pages, look them up, retrieve them elsewhere, compare; (store s, retrieve s)."""
        request_id = f"{self.layout}-{number}"
        hashes = [hashlib.sha256(f"{self.layout}/{number}/{b}".encode()).digest()
                  for b in range(self.geo.blocks_per_request)]
        pages = self._random_pages()
        objects_before = daemon_status(self.url).objects
        store_op = LoadStoreOp(self.src_ids, block_hashes=hashes)
        store_s = self._store(request_id, store_op, pages, behind_kernel)
        self._check_stored(objects_before)
        self._lookup(request_id, hashes)
        retrieve_s = self._retrieve(request_id, LoadStoreOp(self.dst_ids, block_hashes=hashes), behind_kernel)
        self._check_retrieved(request_id, pages)
        return store_s, retrieve_s

    def _random_pages(self) -> torch.Tensor:
        """[layers, blocks of a request, *page] of random bytes (any bit pattern of the dtype)."""
        pages = torch.empty((self.geo.layers, self.geo.blocks_per_request, *self.geo.page_shape(self.layout)),
                            dtype=self.geo.dtype, device=self.device.torch_device)
        pages.view(torch.uint8).random_(0, 256)
        return pages

    def _write(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        for layer, cache in enumerate(self.caches.values()):
            cache.index_copy_(0, index, pages[layer])

    def _read(self, index: torch.Tensor) -> torch.Tensor:
        return torch.stack([cache.index_select(0, index) for cache in self.caches.values()])

    def _store(self, request_id: str, op: LoadStoreOp, pages: torch.Tensor, behind_kernel: bool) -> float:
        """Write the pages into the source blocks and STORE them; seconds from submit to finished.
        Behind the kernel, the write is still queued when the STORE goes out."""
        if behind_kernel:
            with self.device.behind_long_kernel():
                self._write(self.src_index, pages)
                event = self.device.record_event()
        else:
            self._write(self.src_index, pages)
            self.device.synchronize()
            event = self.device.record_event()
        start = time.perf_counter()
        self.worker.batched_submit_store_requests([request_id], [op], event)
        self._wait(lambda: request_id in self.worker.get_finished({request_id})[0], f"store {request_id}")
        return time.perf_counter() - start  # `event` lived until here: past the daemon's reply

    def _retrieve(self, request_id: str, op: LoadStoreOp, behind_kernel: bool) -> float:
        """RETRIEVE into the destination blocks; seconds from submit to finished. They hold
        stale bytes first; behind the kernel, they are cleared after the RETRIEVE went out (the
        daemon must write only after that)."""
        self._fill(self.dst_index, 0xFF)
        self.device.synchronize()
        if behind_kernel:
            with self.device.behind_long_kernel():
                self._fill(self.dst_index, 0)
                event = self.device.record_event()
        else:
            event = self.device.record_event()
        start = time.perf_counter()
        self.worker.batched_submit_retrieve_requests([request_id], [op], event)
        self._wait(lambda: request_id in self.worker.get_finished(set())[1], f"retrieve {request_id}")
        elapsed = time.perf_counter() - start
        self.device.synchronize()
        return elapsed

    def _fill(self, index: torch.Tensor, byte: int) -> None:
        for cache in self.caches.values():
            cache.view(torch.uint8).view(cache.shape[0], -1).index_fill_(0, index, byte)

    def _lookup(self, request_id: str, hashes: list[bytes]) -> None:
        self.scheduler.maybe_submit_lookup_request(request_id, block_hashes=hashes)
        self._wait(lambda: self.scheduler.check_lookup_result(request_id) is not None, f"lookup {request_id}")
        hit = self.scheduler.check_lookup_result(request_id) or 0
        self.scheduler.cleanup_lookup_result(request_id)
        self.report.chunks_hit += hit // self.geo.chunk_size
        expected = self.geo.chunks * self.geo.chunk_size
        if hit != expected:
            self._fail(f"{request_id}: the lookup hit {hit} tokens of {expected}")

    def _check_stored(self, objects_before: int) -> None:
        stored = daemon_status(self.url).objects - objects_before
        self.report.chunks_expected += self.geo.chunks
        self.report.chunks_stored += stored
        if stored != self.geo.chunks:
            self._fail(f"the daemon's pool gained {stored} objects for a store of {self.geo.chunks} chunks")

    def _check_retrieved(self, request_id: str, pages: torch.Tensor) -> None:
        failed = self.worker.take_failed_retrieves()
        if request_id in failed:
            self._fail(f"{request_id}: the retrieve failed")
            return
        leases = daemon_status(self.url).leases
        if leases:
            self._fail(f"{request_id}: {leases} leases left after the retrieve (it should spend them)")
        got = self._read(self.dst_index)
        if not torch.equal(got.view(torch.uint8), pages.view(torch.uint8)):
            self.report.bit_exact = False
            wrong = (got.view(torch.uint8) != pages.view(torch.uint8)).sum().item()
            self._fail(f"{request_id}: {wrong} of {pages.nbytes} retrieved bytes differ from those written")
            return
        self.report.chunks_retrieved += self.geo.chunks

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.layout}: {what} not finished in {WAIT_S:g} s")
            time.sleep(POLL_S)

    def _fail(self, message: str) -> None:
        self.report.failures.append(f"{self.layout}: {message}")


# ---- the run ----------------------------------------------------------------------------------


def pool_gb(geo: Geometry) -> float:
    """A pool that holds every chunk of the run (no eviction to blur the counts), with room."""
    total = sum(geo.request_bytes(layout) for layout in LAYOUTS) * (geo.rounds + 1)
    return round(total * 1.25 / 2**30 + 0.05, 3)


def pin_timings(device: Device, sizes_gib: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for gib in sizes_gib:
        nbytes = gib << 30
        if device.name != "cuda":
            rows.append({"gib": gib, "skipped": "needs CUDA"})
        elif nbytes + PIN_HEADROOM_BYTES > (available := available_memory_bytes() or 0):
            rows.append({"gib": gib, "skipped": f"the host has {available / 2**30:.0f} GiB "
                                                f"available, {gib + PIN_HEADROOM_BYTES // 2**30} needed"})
        else:
            seconds = device.pin_seconds(nbytes)
            rows.append({"gib": gib, "seconds": seconds, "gbps": nbytes / seconds / 1e9})
    return rows


def run_layouts(geo: Geometry, device: Device, daemon: DaemonProcess) -> list[LayoutReport]:
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, MODEL, 1, 0, geo.block_size)
    reports = []
    try:
        for seed, layout in enumerate(LAYOUTS):
            baseline = device.copy_baseline(geo.request_bytes(layout), geo.rounds)
            reports.append(LayoutRun(layout, geo, device, daemon.url, scheduler, seed).run(baseline))
            device.release_cached_memory()  # the caches are gone: the next layout gets the room
    finally:
        scheduler.shutdown()
    return reports


def print_table(reports: list[LayoutReport], pins: list[dict[str, Any]]) -> None:
    print(f"\n{'layout':<12}{'MiB/req':>9}{'STORE GB/s':>12}{'copy GB/s':>11}{'ratio':>7}"
          f"{'RETRIEVE GB/s':>15}{'copy GB/s':>11}{'ratio':>7}  bit-exact")
    for r in reports:
        print(f"{r.layout:<12}{r.request_bytes / 2**20:>9.1f}"
              f"{r.store_gbps:>12.2f}{r.baseline_store_gbps:>11.2f}{r.store_vs_baseline:>7.0%}"
              f"{r.retrieve_gbps:>15.2f}{r.baseline_retrieve_gbps:>11.2f}"
              f"{r.retrieve_vs_baseline:>7.0%}  {r.bit_exact}")
    for pin in pins:
        if "seconds" in pin:
            print(f"pin {pin['gib']} GiB (cudaHostRegister): {pin['seconds']:.2f} s, {pin['gbps']:.1f} GB/s")
        else:
            print(f"pin {pin['gib']} GiB: skipped ({pin['skipped']})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny caches (a smoke run, seconds)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--pin-gib", default="8,32",
                        help="GiB to time pinning, comma-separated ('' for none; CUDA only)")
    parser.add_argument("--delay-cycles", type=int, default=1_000_000_000,
                        help="GPU cycles the long kernel spins before the ordering round's writes")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    geo = QUICK if args.quick else FULL
    device: Device = CudaDevice(args.delay_cycles) if args.device == "cuda" else CpuDevice()
    print(f"{device.description()}; {'quick' if args.quick else 'full'} geometry {geo}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-gpu-", dir="/tmp"))  # short: Unix socket paths are limited
    daemon = start_daemon(tmp, "--l1-size-gb", str(pool_gb(geo)), "--chunk-size", str(geo.chunk_size),
                          ready_timeout=300)
    try:
        reports = run_layouts(geo, device, daemon)
    finally:
        daemon.stop(timeout=30)
    failures = [f for r in reports for f in r.failures]
    if "Traceback" in daemon.log():
        failures.append(f"the daemon logged a traceback (see {daemon.log_path})")
    pins = pin_timings(device, [int(s) for s in args.pin_gib.split(",") if s.strip()])
    print_table(reports, pins)
    figures = {"device": device.name, "device_description": device.description(), "quick": args.quick,
               "geometry": {**asdict(geo), "dtype": str(geo.dtype).removeprefix("torch.")},
               "layouts": {r.layout: r.as_json() for r in reports}, "pin": pins,
               "ok": not failures, "failures": failures}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"{len(failures)} failure(s)" if failures else "OK: every retrieved byte equals the byte written")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
