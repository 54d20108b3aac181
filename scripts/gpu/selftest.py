#!/usr/bin/env python
"""Self-test of the data path on a GPU (or on CPU): the real daemon and workers, no vLLM.

    .venv/bin/python scripts/gpu/selftest.py [--device cuda|cpu] [--quick] [--out FILE]
                                             [--pin-gib 8,32]

The daemon (`lmcache-mp serve`, started with `CUDA_VISIBLE_DEVICES=GPU-<uuid>` on CUDA, so that
it finds the workers' device by UUID, not by ordinal) and this script as its workers. Caches are
allocated as vLLM 0.32 allocates them on a GPU (`lmcache_mp/testing/vllm_caches.py`, checked against
vLLM's own functions): one int8 buffer for every layer, and per layer a 4-D logical `[blocks,
heads, block_size, C]` view of it at its own storage offset, in the physical layout vLLM resolves.

Cases, each registered through `LMCacheMPWorkerAdapter` under the backend name vLLM sends:
  FLASH_ATTN/LBNHC   the H100 default: non-contiguous per-layer views (Llama-3-8B: 32 layers x 8 KV heads)
  FLASH_ATTN/LBHNC   contiguous per-layer views
  TRITON_MLA         4-D `[blocks, 1, block_size, 576]` (a DeepSeek latent)
  80L-2KV            80 layers x 2 KV heads (Llama-3-70B at TP=4): many layers, small pages
  FLASHINFER/split   vLLM blocks of 32 tokens split into kernel blocks of 16
Each case runs rounds of STORE (one request's chunks from scattered blocks), LOOKUP (through
`LMCacheMPSchedulerAdapter`, every chunk must hit) and RETRIEVE into other scattered blocks, every
byte compared. The first round checks ordering, skips and a tail (a short chunk of 3 blocks, filling
the first pages of its object and of the staging buffer): on CUDA the worker writes the pages behind
a long kernel on a side stream and STOREs at once with an interprocess event recorded after
the write (only a daemon that waits on the event stores the written bytes), then clears the
retrieve's blocks behind such a kernel and RETRIEVEs at once (only a daemon that waits writes after
the clearing); its RETRIEVE has -1 ids, whose blocks must stay as they were. The other rounds are
timed against a same-run baseline moving the same bytes: a pinned-host <-> device `copy_` on CUDA,
a plain `copy_` on CPU.
Then, at once: two TP ranks storing and retrieving together (each with its own event), and two KV
groups of one worker sharing one event (one event handle opened by concurrent requests). Then a
worker killed mid-STORE (behind a long kernel on CUDA: the daemon waits on a dead process's
event): the daemon drops it and serves on, or exits for its supervisor; either is reported. On CUDA
it also times pinning (`cudaHostRegister`) fresh mmaps of `--pin-gib` GiB.

Prints a table, writes the figures as JSON to `--out`; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
# This checkout's code, in this process and in the daemon it starts, installed or not (a lent GPU
# machine has no venv): the repository root first; the self-test's own modules sit beside it.
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))

from selftest_device import Device, device_of, finish, parser, pin_timings  # noqa: E402
from selftest_rounds import MODEL, TAIL_BLOCKS, Case, CaseReport, Worker, run_case, run_together  # noqa: E402

from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, free_port, start_daemon  # noqa: E402
from lmcache_mp.testing.vllm_caches import allocate_like_vllm  # noqa: E402
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp  # noqa: E402

KILL_WAIT_S = 240.0  # beyond the daemon's bound on a copy's completion wait


@dataclass(frozen=True)
class Geometry:
    """What every case shares: vLLM's block size, the daemon's chunk, a request's chunks."""

    block_size: int
    chunk_size: int
    chunks: int  # chunks per request
    rounds: int  # timed rounds per case, after the ordering round


FULL = Geometry(block_size=16, chunk_size=256, chunks=8, rounds=5)
QUICK = Geometry(block_size=16, chunk_size=64, chunks=2, rounds=3)


def cases(quick: bool) -> list[Case]:
    """Full: real models' geometries (32 MiB chunks for Llama-3-8B); quick: tiny ones."""
    layers, heads, head, latent = (4, 2, 64, 96) if quick else (32, 8, 128, 576)
    return [
        Case("FLASH_ATTN/LBNHC", "FLASH_ATTN", "LBNHC", layers, heads, head),
        Case("FLASH_ATTN/LBHNC", "FLASH_ATTN", "LBHNC", layers, heads, head),
        Case("TRITON_MLA", "TRITON_MLA", "LBNHC", layers, 1, latent, mla=True),
        Case("80L-2KV", "FLASH_ATTN", "LBNHC", 80, 2, 16 if quick else 128),
        Case("FLASHINFER/split", "FLASHINFER", "LBNHC", layers, heads, head,
             kernel_block_size=8 if quick else 16),
    ]


def case_block_size(case: Case, geo: Geometry) -> int:
    """The split case's vLLM blocks are twice its kernel blocks; every other case uses the geometry's."""
    return 2 * case.kernel_block_size if case.kernel_block_size else geo.block_size


def pool_gb(geo: Geometry, all_cases: list[Case]) -> float:
    """A pool that holds every chunk of the run (no eviction to blur the counts), with room."""
    total = sum(c.chunk_bytes(geo.chunk_size) for c in all_cases) * geo.chunks * (geo.rounds + 8)
    return round(total * 1.25 / 2**30 + 0.05, 3)


def new_worker(url: str, case: Case, geo: Geometry, device: Device, seed: int, *, model: str = MODEL,
               world_size: int = 1, rank: int = 0) -> Worker:
    block_size = case_block_size(case, geo)
    # A request's chunks and tail, as source and as destination, and a few blocks never used.
    num_blocks = 2 * (geo.chunks * (geo.chunk_size // block_size) + TAIL_BLOCKS) + 2
    _, caches = allocate_like_vllm(case.layers, num_blocks, case.kv_heads, block_size, case.head_size,
                                   torch.bfloat16, case.physical, case.mla, case.kernel_block_size,
                                   device=device.torch_device)
    adapter = LMCacheMPWorkerAdapter(url, None, model, world_size, rank, block_size)
    return Worker(case, caches, block_size, geo.chunk_size, geo.chunks, device, adapter, seed)


def print_progress(report: CaseReport) -> None:
    """One line per finished case: a long or stuck run shows how far it got."""
    verdict = "; ".join(report.failures) or "ok"
    speeds = (f", STORE {report.store_gbps:.2f} GB/s, RETRIEVE {report.retrieve_gbps:.2f} GB/s"
              if report.store_gbps else "")
    tail = " and its tail" if report.tail_retrieved else ""
    print(f"  {report.name}: {report.chunks_retrieved}/{report.chunks_expected} chunks{tail} retrieved"
          f"{speeds}: "
          f"{verdict}", flush=True)


def run_cases(geo: Geometry, device: Device, daemon: DaemonProcess, quick: bool,
              metrics_port: int) -> list[CaseReport]:
    reports = []
    for seed, case in enumerate(cases(quick)):
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, MODEL, 1, 0, case_block_size(case, geo))
        worker = new_worker(daemon.url, case, geo, device, seed)
        try:
            baseline = device.copy_baseline(worker.request_bytes, geo.rounds)
            reports.append(run_case(worker, scheduler, daemon.url, geo.rounds, baseline, metrics_port))
            print_progress(reports[-1])
        finally:
            worker.close()
            scheduler.shutdown()
            device.release_cached_memory()  # the caches are gone: the next case gets the room
    return reports


def run_concurrent(geo: Geometry, device: Device, daemon: DaemonProcess, quick: bool) -> list[CaseReport]:
    """Two TP ranks at once (own events), then two KV groups of one worker sharing one event."""
    case = cases(quick)[0]
    reports = []
    scenarios = (("2 ranks", [MODEL + "-tp2"] * 2, 2, False),
                 ("2 groups, 1 event", [MODEL + "#g0", MODEL + "#g1"], 1, True))
    for name, models, world_size, shared_event in scenarios:
        workers = [new_worker(daemon.url, replace(case, name=f"{name} #{i}"), geo, device, 100 + i,
                              model=model, world_size=world_size, rank=i if world_size > 1 else 0)
                   for i, model in enumerate(models)]
        schedulers = [LMCacheMPSchedulerAdapter(daemon.url, None, model, world_size, 0, geo.block_size)
                      for model in dict.fromkeys(models)]
        try:
            reports.extend(run_together(workers, schedulers, daemon.url, shared_event))
            for report in reports[-len(workers):]:
                print_progress(report)
        finally:
            for worker in workers:
                worker.close()
            for scheduler in schedulers:
                scheduler.shutdown()
            device.release_cached_memory()
    return reports


def kill_worker_mid_store(geo: Geometry, device: Device, daemon: DaemonProcess, quick: bool,
                          delay_cycles: int, metrics_port: int) -> dict[str, Any]:
    """A worker process registers, STOREs its request behind a long kernel (CUDA) and is killed
    while the daemon copies or waits; then the daemon must either serve on, with the worker's
    registration dropped and a fresh round bit-exact, or have exited non-zero for its supervisor."""
    before = len(daemon_status(daemon.url).registered_instances)
    command = [sys.executable, __file__, "--device", device.name, "--delay-cycles", str(delay_cycles),
               *(["--quick"] if quick else []), "--child-store", daemon.url]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    running = daemon_status(daemon.url).transfers_running if daemon.proc.poll() is None else 0
    child.kill()
    child.wait()
    result: dict[str, Any] = {"child_said": line, "copying_when_killed": running > 0}
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and daemon.proc.poll() is None:
        status = daemon_status(daemon.url)
        if len(status.registered_instances) == before and status.transfers_running == 0:
            break
        time.sleep(0.2)
    if daemon.proc.poll() is not None:
        result.update(outcome="daemon exited", exit_code=daemon.proc.returncode,
                      ok=daemon.proc.returncode != 0 and "CRITICAL" in daemon.log())
        return result
    status = daemon_status(daemon.url)
    dropped = len(status.registered_instances) == before and status.transfers_running == 0
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, MODEL + "-after", 1, 0, geo.block_size)
    worker = new_worker(daemon.url, cases(quick)[0], geo, device, 7, model=MODEL + "-after")
    try:
        after = run_case(worker, scheduler, daemon.url, 0, (0.0, 0.0), metrics_port)
    finally:
        worker.close()
        scheduler.shutdown()
    result.update(outcome="daemon served on", dropped=dropped, round_after=not after.failures,
                  ok=dropped and not after.failures)
    return result


def child_store(url: str, device: Device, geo: Geometry, quick: bool) -> None:
    """The worker that is killed: register, write behind a long kernel, STORE, say so, wait."""
    worker = new_worker(url, cases(quick)[3], geo, device, 9, model=MODEL + "-killed")
    worker.register()
    hashes = worker.hashes("killed")
    with device.behind_long_kernel():
        worker.write(worker.random_pages())
        event = device.record_event()
    op = LoadStoreOp(worker.src_ids, block_hashes=hashes)
    worker.adapter.batched_submit_store_requests(["killed"], [op], event)
    print("stored", flush=True)
    time.sleep(3600)


def print_table(reports: list[CaseReport], kill: dict[str, Any], pins: list[dict[str, Any]]) -> None:
    print(f"\n{'case':<22}{'MiB/req':>9}{'STORE GB/s':>12}{'copy GB/s':>11}{'ratio':>7}"
          f"{'RETRIEVE GB/s':>15}{'copy GB/s':>11}{'ratio':>7}  bit-exact")
    for r in reports:
        speeds = (f"{r.store_gbps:>12.2f}{r.baseline_store_gbps:>11.2f}{r.store_vs_baseline:>7.0%}"
                  f"{r.retrieve_gbps:>15.2f}{r.baseline_retrieve_gbps:>11.2f}{r.retrieve_vs_baseline:>7.0%}"
                  if r.store_gbps else f"{'(not timed: at once with another)':>63}")
        print(f"{r.name:<22}{r.request_bytes / 2**20:>9.1f}{speeds}  {r.bit_exact}")
    print("\nmean ms of the timed rounds, as the worker saw them / inside the daemon (the rest: ZeroMQ "
          "and the adapter's completion path)")
    for r in reports:
        if r.store_gbps:
            print(f"{r.name:<22}STORE {r.store_ms_worker:7.2f} / {r.store_ms_daemon:7.2f}   "
                  f"RETRIEVE {r.retrieve_ms_worker:7.2f} / {r.retrieve_ms_daemon:7.2f}")
    print(f"worker killed mid-STORE: {kill}")
    for pin in pins:
        if "seconds" in pin:
            print(f"pin {pin['gib']} GiB (cudaHostRegister): {pin['seconds']:.2f} s, {pin['gbps']:.1f} GB/s")
        else:
            print(f"pin {pin['gib']} GiB: skipped ({pin['skipped']})")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--pin-gib", default="8,32",
                   help="GiB to time pinning, comma-separated ('' for none; CUDA only)")
    p.add_argument("--child-store", metavar="URL", help=argparse.SUPPRESS)  # the killed worker
    args = p.parse_args()
    geo = QUICK if args.quick else FULL
    device = device_of(args, p)
    if args.child_store:
        child_store(args.child_store, device, geo, args.quick)
        return 0
    print(f"{device.description()}; {'quick' if args.quick else 'full'} geometry {geo}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-gpu-", dir="/tmp"))  # short: Unix socket paths are limited
    try:
        return run_selftest(args, device, geo, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_selftest(args: argparse.Namespace, device: Device, geo: Geometry, tmp: Path) -> int:
    """The cases, the killed worker and the pinning timings against a daemon started in `tmp`."""
    metrics_port = free_port()
    daemon = start_daemon(tmp, "--l1-size-gb", str(pool_gb(geo, cases(args.quick))), "--chunk-size",
                          str(geo.chunk_size), "--metrics-port", str(metrics_port), ready_timeout=300,
                          env=device.daemon_env())
    try:
        reports = (run_cases(geo, device, daemon, args.quick, metrics_port)
                   + run_concurrent(geo, device, daemon, args.quick))
        print("  killing a worker mid-STORE...", flush=True)
        kill = kill_worker_mid_store(geo, device, daemon, args.quick, args.delay_cycles, metrics_port)
    finally:
        daemon.stop(timeout=30)
    failures = [f for r in reports for f in r.failures]
    if not kill["ok"]:
        failures.append(f"worker killed mid-STORE: {kill}")
    if "Traceback" in daemon.log():
        failures.append(f"the daemon logged a traceback:\n{daemon.log()[-4000:]}")
    pins = pin_timings(device, [int(s) for s in args.pin_gib.split(",") if s.strip()])
    print_table(reports, kill, pins)
    figures = {"device": device.name, "device_description": device.description(), "quick": args.quick,
               "geometry": asdict(geo), "cases": {r.name: r.as_json() for r in reports},
               "killed_worker": kill, "pin": pins, "ok": not failures, "failures": failures}
    return finish(args.out, figures, failures, "every retrieved byte equals the byte written")


if __name__ == "__main__":
    raise SystemExit(main())
