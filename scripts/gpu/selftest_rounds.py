"""The self-test's rounds (`selftest.py`): a worker with caches allocated as vLLM allocates
them, storing, looking up and retrieving its pages through the real adapters, every byte compared.

A round: write random pages into scattered source blocks, STORE them (the daemon's STATUS must
count one new pool object per chunk), LOOKUP (every chunk must hit), RETRIEVE into other scattered
blocks (its leases must be spent) and compare bit for bit. The ordering round's request also ends
with a tail: `TAIL_BLOCKS` blocks past its last chunk, stored and retrieved as one short chunk
(`vllm_adapter.tails`), which fills only the first pages of its object and of the staging buffer.
Blocks are vLLM's: with a kernel-block split a block id names `ratio` kernel blocks, which the
worker reads and writes together.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from selftest_device import Device

from lmcache_mp.testing.launcher import daemon_status
from lmcache_mp.testing.probes import scrape
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

MODEL = "gpu-selftest"
POLL_S = 0.0002  # between get_finished polls while a request is timed
WAIT_S = 120.0  # the longest a request may take before the run fails
SKIP_EVERY = 3  # the ordering round's RETRIEVE skips (-1) every third block
TAIL_BLOCKS = 3  # the ordering round's tail: fewer blocks than any case's chunk


@dataclass(frozen=True)
class Case:
    name: str
    backend: str  # the attention backend name the worker registers with (what vLLM sends)
    physical: str  # vLLM's KVCacheLayout: the memory order of [layers, blocks, heads, tokens, C]
    layers: int
    kv_heads: int
    head_size: int  # MLA: the latent's width
    mla: bool = False
    kernel_block_size: int | None = None

    def page_bytes(self, block_size: int) -> int:
        content = self.head_size if self.mla else 2 * self.head_size
        return self.kv_heads * block_size * content * torch.bfloat16.itemsize

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.layers * self.page_bytes(chunk_size)


@dataclass
class CaseReport:
    name: str
    backend: str
    physical: str
    cache_shape: list[int]
    request_bytes: int
    rounds: int = 0
    chunks_expected: int = 0
    chunks_stored: int = 0  # new objects in the daemon's pool, by STATUS
    chunks_hit: int = 0  # chunks the lookups found
    chunks_retrieved: int = 0  # chunks of retrieves that reported success and compared equal
    tail_retrieved: bool = False  # the ordering round's tail stored, retrieved and equal
    bit_exact: bool = True
    ordering_checked: bool = False
    ordering_store_s: float = 0.0
    ordering_retrieve_s: float = 0.0
    # Whether the event the ordering round's STORE / RETRIEVE sent was still pending when it was
    # sent: only then does its bit-exact result prove that the daemon waited for the event.
    ordering_store_pending: bool = False
    ordering_retrieve_pending: bool = False
    # Mean milliseconds of the timed rounds' STOREs and RETRIEVEs: as the worker saw them (submit to
    # reported finished), and inside the daemon (decoded request to reply, from its metrics); the
    # difference is the way there and back (ZeroMQ, the adapter's completion path).
    store_ms_worker: float = 0.0
    store_ms_daemon: float = 0.0
    retrieve_ms_worker: float = 0.0
    retrieve_ms_daemon: float = 0.0
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


def _wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not finished in {WAIT_S:g} s")
        time.sleep(POLL_S)


class Worker:
    """One registered worker: its caches, its adapter, the blocks its requests use."""

    def __init__(self, case: Case, caches: dict[str, torch.Tensor], block_size: int, chunk_size: int,
                 chunks: int, device: Device, adapter: LMCacheMPWorkerAdapter, seed: int):
        self.case, self.caches, self.device, self.adapter = case, caches, device, adapter
        self.chunks, self.chunk_size = chunks, chunk_size
        first = next(iter(caches.values()))
        ratio = block_size // first.shape[2]  # kernel blocks per vLLM block
        # Per layer, dim 0 indexes vLLM's blocks (a pure view, as vLLM's `group_kernel_blocks`).
        self.blocks = [c.unflatten(0, (-1, ratio)) if ratio > 1 else c for c in caches.values()]
        self.blocks_per_request = chunks * chunk_size // block_size  # its whole chunks'
        # Source and destination blocks of the request's chunks, then of its tail.
        span = self.blocks_per_request + TAIL_BLOCKS
        picked = random.Random(seed).sample(range(self.blocks[0].shape[0]), 2 * span)
        self.src_ids, self.dst_ids = picked[:span], picked[span:]
        self._src_index, self._dst_index = self._index(self.src_ids), self._index(self.dst_ids)
        self.page_shape = tuple(self.blocks[0].shape[1:])
        self.request_bytes = case.layers * self.blocks_per_request * case.page_bytes(block_size)
        self.report = CaseReport(case.name, case.backend, case.physical, list(first.shape),
                                 self.request_bytes)

    def register(self) -> None:
        self.adapter.register_kv_caches(self.caches, layout=self.case.backend)

    def close(self) -> None:
        self.adapter.shutdown()

    def hashes(self, tag: str) -> list[bytes]:
        return [hashlib.sha256(f"{tag}/{b}".encode()).digest() for b in range(self.blocks_per_request)]

    def random_pages(self) -> torch.Tensor:
        """[layers, blocks of a request and its tail, *page] of random bytes (any bit pattern)."""
        pages = torch.empty((self.case.layers, len(self.src_ids), *self.page_shape),
                            dtype=torch.bfloat16, device=self.device.torch_device)
        pages.view(torch.uint8).random_(0, 256)
        return pages

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, device=self.device.torch_device)

    def write(self, pages: torch.Tensor) -> None:
        """The pages into the source blocks: kernels only, so that behind a long kernel the host
        does not wait (an index uploaded from pageable memory would wait for the stream)."""
        for layer, blocks in enumerate(self.blocks):
            blocks.index_copy_(0, self._src_index, pages[layer])

    def read(self, ids: list[int]) -> torch.Tensor:
        index = self._index(ids)
        return torch.stack([blocks.index_select(0, index) for blocks in self.blocks])

    def fill_destination(self, byte: int) -> None:
        """Every byte of the destination blocks set to `byte` (kernels only, as `write`)."""
        for blocks in self.blocks:
            blocks.view(torch.uint8).index_fill_(0, self._dst_index, byte)

    def op(self, request_id: str, hashes: list[bytes], ids: list[int], tail: bool) -> LoadStoreOp:
        """The request's chunks in `ids`' first blocks, and with `tail`, its tail in the rest."""
        if not tail:
            return LoadStoreOp(ids[:self.blocks_per_request], block_hashes=hashes)
        tail_hash = hashlib.sha256(f"{request_id}/tail".encode()).digest()
        return LoadStoreOp(ids, block_hashes=hashes, tail_hash=tail_hash)

    def store(self, request_id: str, hashes: list[bytes], event: torch.cuda.Event | None,
              tail: bool = False) -> float:
        """STORE the source blocks (`tail`: the tail's too); seconds from submit to finished."""
        start = time.perf_counter()
        op = self.op(request_id, hashes, self.src_ids, tail)
        self.adapter.batched_submit_store_requests([request_id], [op], event)
        _wait(lambda: request_id in self.adapter.get_finished({request_id})[0],
              f"{self.case.name}: store {request_id}")
        return time.perf_counter() - start  # `event` lived until here: past the daemon's reply

    def retrieve(self, request_id: str, hashes: list[bytes], ids: list[int],
                 event: torch.cuda.Event | None, tail: bool = False) -> float:
        """RETRIEVE into blocks `ids` (-1: skip; `tail`: its last ones take the tail); seconds
        from submit to finished."""
        start = time.perf_counter()
        op = self.op(request_id, hashes, ids, tail)
        self.adapter.batched_submit_retrieve_requests([request_id], [op], event)
        _wait(lambda: request_id in self.adapter.get_finished(set())[1],
              f"{self.case.name}: retrieve {request_id}")
        elapsed = time.perf_counter() - start
        self.device.synchronize()
        return elapsed

    def check_retrieved(self, request_id: str, pages: torch.Tensor, ids: list[int], cleared: int,
                        tail: bool = False) -> None:
        """The kept blocks hold the pages; the skipped ones (-1) still hold the `cleared` byte."""
        report = self.report
        ids = ids if tail else ids[:self.blocks_per_request]
        if request_id in self.adapter.take_failed_retrieves():
            report.failures.append(f"{report.name}: {request_id}: the retrieve failed")
            return
        kept = [i for i, b in enumerate(ids) if b >= 0]
        skipped = [self.dst_ids[i] for i, b in enumerate(ids) if b < 0]
        got = self.read([ids[i] for i in kept]).view(torch.uint8)
        want = pages[:, kept].view(torch.uint8)
        untouched = not skipped or bool((self.read(skipped).view(torch.uint8) == cleared).all())
        if not torch.equal(got, want) or not untouched:
            report.bit_exact = False
            wrong = int((got != want).sum().item())
            report.failures.append(f"{report.name}: {request_id}: {wrong} retrieved bytes differ from those "
                                   f"written; skipped blocks untouched: {untouched}")
            return
        report.chunks_retrieved += self.chunks
        report.tail_retrieved = report.tail_retrieved or tail


def lookup(scheduler: LMCacheMPSchedulerAdapter, request_id: str, hashes: list[bytes], expected: int,
           report: CaseReport) -> None:
    scheduler.maybe_submit_lookup_request(request_id, block_hashes=hashes)
    _wait(lambda: scheduler.check_lookup_result(request_id) is not None, f"lookup {request_id}")
    hit = scheduler.check_lookup_result(request_id) or 0
    scheduler.cleanup_lookup_result(request_id)
    report.chunks_hit += hit // scheduler.chunk_size
    if hit != expected:
        report.failures.append(f"{report.name}: {request_id}: the lookup hit {hit} tokens of {expected}")


def _check_stored(url: str, objects_before: int, workers: list[Worker], tails: int = 0) -> None:
    """The pool gained one object per chunk stored, and one per tail."""
    stored = daemon_status(url).objects - objects_before - tails
    expected = sum(w.chunks for w in workers)
    for w in workers:
        w.report.chunks_expected += w.chunks
        w.report.chunks_stored += stored // len(workers)
    if stored != expected:
        workers[0].report.failures.append(f"{workers[0].report.name}: the daemon's pool gained {stored} "
                                          f"objects beside {tails} tail(s) for stores of {expected} chunks")


def _check_no_leases(url: str, report: CaseReport, request_id: str) -> None:
    leases = daemon_status(url).leases
    if leases:
        report.failures.append(f"{report.name}: {request_id}: {leases} leases left after the retrieve")


def daemon_seconds(metrics_port: int) -> dict[str, tuple[float, float]]:
    """The daemon's total seconds and count of STOREs and RETRIEVEs so far, from its metrics."""
    series = scrape(metrics_port)
    return {kind: (series[f'lmcache_mp_request_seconds_sum{{type="{kind}"}}'],
                   series[f'lmcache_mp_request_seconds_count{{type="{kind}"}}'])
            for kind in ("STORE", "RETRIEVE")}


def run_case(worker: Worker, scheduler: LMCacheMPSchedulerAdapter, url: str, rounds: int,
             baseline: tuple[float, float], metrics_port: int) -> CaseReport:
    """The ordering round (with skipped blocks), then `rounds` timed ones."""
    report = worker.report
    report.baseline_store_gbps, report.baseline_retrieve_gbps = baseline
    worker.register()
    # Every kernel the ordering round enqueues behind its long one, run once: CUDA loads a
    # kernel's module at its first launch, and the load waits for the device, long kernel included.
    worker.write(worker.random_pages())
    worker.fill_destination(0)
    worker.device.synchronize()
    report.ordering_checked = worker.device.name == "cuda"
    report.ordering_store_s, report.ordering_retrieve_s = _round(worker, scheduler, url, 0, ordering=True)
    if report.ordering_checked and not (report.ordering_store_pending and report.ordering_retrieve_pending):
        report.failures.append(f"{report.name}: the long kernel had finished before the ordering "
                               "round's STORE or RETRIEVE was sent, so its event ordered nothing "
                               "(raise --delay-cycles)")
    before = daemon_seconds(metrics_port)
    timed = [_round(worker, scheduler, url, r, ordering=False) for r in range(1, rounds + 1)]
    after = daemon_seconds(metrics_port)
    report.rounds = rounds + 1
    if timed:
        report.store_gbps = report.request_bytes / statistics.median(t[0] for t in timed) / 1e9
        report.retrieve_gbps = report.request_bytes / statistics.median(t[1] for t in timed) / 1e9
        report.store_ms_worker = statistics.fmean(t[0] for t in timed) * 1e3
        report.retrieve_ms_worker = statistics.fmean(t[1] for t in timed) * 1e3
        report.store_ms_daemon, report.retrieve_ms_daemon = (
            (after[kind][0] - before[kind][0]) / (after[kind][1] - before[kind][1]) * 1e3
            for kind in ("STORE", "RETRIEVE"))
    return report


def _round(worker: Worker, scheduler: LMCacheMPSchedulerAdapter, url: str, number: int,
           ordering: bool) -> tuple[float, float]:
    """Store fresh pages, look them up, retrieve them elsewhere, compare; (store s, retrieve s).
    Ordering: the writes and the clearing run behind a long kernel, the RETRIEVE skips blocks, and
    the request ends with a tail."""
    device, request_id = worker.device, f"{worker.case.name}-{number}"
    hashes, pages = worker.hashes(request_id), worker.random_pages()
    objects_before = daemon_status(url).objects
    if ordering:
        with device.behind_long_kernel():
            worker.write(pages)
            event = device.record_event()
    else:
        worker.write(pages)
        device.synchronize()
        event = device.record_event()
    if ordering:
        worker.report.ordering_store_pending = device.pending(event)
    store_s = worker.store(request_id, hashes, event, tail=ordering)
    _check_stored(url, objects_before, [worker], tails=int(ordering))
    lookup(scheduler, request_id, hashes, worker.chunks * worker.chunk_size, worker.report)
    ids = [-1 if ordering and i % SKIP_EVERY == 1 else b for i, b in enumerate(worker.dst_ids)]
    worker.fill_destination(0xFF)
    device.synchronize()
    if ordering:  # cleared after the RETRIEVE went out: the daemon must write after the clearing
        with device.behind_long_kernel():
            worker.fill_destination(0)
            event = device.record_event()
    else:
        event = device.record_event()
    if ordering:
        worker.report.ordering_retrieve_pending = device.pending(event)
    retrieve_s = worker.retrieve(request_id, hashes, ids, event, tail=ordering)
    worker.check_retrieved(request_id, pages, ids, 0 if ordering else 0xFF, tail=ordering)
    _check_no_leases(url, worker.report, request_id)
    return store_s, retrieve_s


def _events(device: Device, count: int, shared: bool) -> list[torch.cuda.Event | None]:
    """One event per worker, recorded now; or one event for all of them."""
    return [device.record_event()] * count if shared else [device.record_event() for _ in range(count)]


def run_together(workers: list[Worker], schedulers: list[LMCacheMPSchedulerAdapter], url: str,
                 shared_event: bool) -> list[CaseReport]:
    """The workers store at once, are looked up, and retrieve at once: ranks of one world (one
    scheduler; each rank its own event) or groups of one worker (a scheduler each; one event)."""
    for worker in workers:
        worker.register()
    device, request_id = workers[0].device, workers[0].case.name.split(" #")[0]
    hashes = workers[0].hashes(request_id)
    pages = [w.random_pages() for w in workers]
    for worker, p in zip(workers, pages, strict=True):
        worker.write(p)
    device.synchronize()
    events = _events(device, len(workers), shared_event)
    rids = [f"{request_id}#g{i}" if len(schedulers) > 1 else request_id for i in range(len(workers))]
    objects_before = daemon_status(url).objects
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda i: workers[i].store(rids[i], hashes, events[i]), range(len(workers))))
    _check_stored(url, objects_before, workers)
    expected = workers[0].chunks * workers[0].chunk_size
    for i, scheduler in enumerate(schedulers):
        lookup(scheduler, rids[i], hashes, expected, workers[i].report)
    for worker in workers[len(schedulers):]:  # ranks: one LOOKUP answers for every rank
        worker.report.chunks_hit = workers[0].report.chunks_hit
    for worker in workers:
        worker.fill_destination(0xFF)
    device.synchronize()
    events = _events(device, len(workers), shared_event)
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda i: workers[i].retrieve(rids[i], hashes, workers[i].dst_ids, events[i]),
                      range(len(workers))))
    for worker, rid, p in zip(workers, rids, pages, strict=True):
        worker.check_retrieved(rid, p, worker.dst_ids, 0xFF)
        worker.report.rounds = 1
    _check_no_leases(url, workers[0].report, request_id)
    return [w.report for w in workers]
