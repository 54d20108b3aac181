"""Tiers below the CPU pool, through the real daemon: write-behind, read-through,
restarts, corruption, a full disk, and prefix-aware eviction."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey, TierStats
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.protocol import ChunkOutcome, RequestType
from lmcache_mp.storage.tiers.disk import object_name
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import count_lookup, fmt, lookup, run_worker, status, store
from vllm_adapter import LMCacheMPSchedulerAdapter, LoadStoreOp

CHUNK_BYTES = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2  # 16 KiB


def disk_args(disk: Path, size_gb: float = 0.01, *extra: str) -> tuple[str, ...]:
    return ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--l2", f"disk://{disk}?size_gb={size_gb}",
            *extra)


def tier(url: str) -> TierStats:
    (only,) = status(url).tiers
    return only


def wait_written(url: str, objects: int, timeout: float = 20) -> TierStats:
    """Until the write-behind queue is empty and the tier holds `objects` chunks."""
    deadline = time.monotonic() + timeout
    while True:
        t = tier(url)
        if t.write_queue_chunks == 0 and t.objects == objects:
            return t
        assert time.monotonic() < deadline, t
        time.sleep(0.02)


def object_path(disk: Path, chunk_hash: bytes, chunk_format: ChunkFormat) -> Path:
    name = object_name(ChunkKey(chunk_hash, chunk_format))
    return disk / name[:2] / f"{name}.kv"


@pytest.fixture
def disk(short_tmp: Path) -> Iterator[Path]:
    path = short_tmp / "disk"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stop(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log(), daemon.log()


def test_chunks_survive_a_restart_on_disk_byte_for_byte(daemons, short_tmp: Path, disk: Path,
                                                        worker_for) -> None:
    tokens = list(range(5 * CHUNK + 7))  # 5 full chunks and a tail
    hashes = block_hashes(tokens)
    ids = [9, 3, 40, 41, 7, 12, 60, 2, 33, 34]
    daemon = daemons(*disk_args(disk))
    worker = worker_for(daemon.url)
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1)  # what worker_for filled
    worker.submit_store_request("s", LoadStoreOp(ids, block_hashes=hashes), None)
    wait_done(worker, "s", retrieve=False)
    written = wait_written(daemon.url, 5)
    assert written.writes_total == 5 and written.skipped_writes_total == 0
    worker.shutdown()
    _stop(daemon)
    assert not list((disk / "tmp").iterdir())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = daemons(*disk_args(disk, 0.01, "--metrics-port", str(port)))
    try:
        before = status(daemon.url)
        assert before.objects == 0 and before.tiers[0].objects == 5
        out = short_tmp / "pages.pt"
        run_worker({"url": daemon.url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
                    "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": "m",
                    "block_ids": list(range(20, 30)), "request_id": "reader", "out": str(out),
                    "block_hashes": [h.hex() for h in hashes]})
        got = torch.load(out)
        assert got["hit"] == 5 * CHUNK and got["failed"] == []
        expected = pages(caches, "CPU_ATTN", SHAPE, ids)
        assert torch.equal(got["pages"].view(torch.uint8), expected.view(torch.uint8))
        after = status(daemon.url)
        t = after.tiers[0]
        assert (after.objects, t.promotions_total, t.hits_total, t.corrupt_total) == (5, 5, 5, 0)
        assert after.leases == 0
        metrics = scrape(port)
        assert metrics[f'lmcache_mp_tier_promotions_total{{tier="disk://{disk}"}}'] == 5
        cli = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "status", "--url", daemon.url],
                             capture_output=True, text=True, timeout=30)
        row = re.search(rf"^  disk://{disk} +yes +5 +\S+ \S+ / \S+ \S+ +5 +0 +5 +0 ", cli.stdout, re.M)
        assert row, cli.stdout  # objects, used / capacity, hits, misses, promoted, errors
        # `lmcache-mp clear --tiers`: the pool and the disk emptied; the prompt is a miss again
        cleared = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "clear", "--tiers", "--url",
                                  daemon.url], capture_output=True, text=True, timeout=60)
        assert cleared.returncode == 0, cleared.stderr
        assert cleared.stdout.splitlines() == ["CPU pool: 5 chunks dropped",
                                               f"disk://{disk}: 5 chunks removed"]
        emptied = status(daemon.url)
        assert (emptied.objects, emptied.tiers[0].objects) == (0, 0)
        assert not list(disk.glob("*/*.kv"))
    finally:
        _stop(daemon)


def test_damaged_or_foreign_files_are_misses_and_deleted(daemons, disk: Path, worker_for) -> None:
    prompts = [block_hashes([p * 1000 + t for t in range(2 * CHUNK)])[1::2] for p in range(4)]
    daemon = daemons(*disk_args(disk))
    cpu = worker_for(daemon.url)
    for p, hashes in enumerate(prompts):
        assert store(cpu.mq_client, cpu.instance_id, hashes, f"p{p}") == [ChunkOutcome.STORED] * 2
    cpu.shutdown()  # the next registration from this process takes the same instance id
    flash = worker_for(daemon.url, "FLASH_ATTN", seed=2)  # same shape, another layout
    assert store(flash.mq_client, flash.instance_id, prompts[3], "f3") == [ChunkOutcome.STORED] * 2
    wait_written(daemon.url, 10)
    flash.shutdown()
    _stop(daemon)

    def path(p: int, c: int, layout: str = "CPU_ATTN") -> Path:
        return object_path(disk, prompts[p][c], fmt(layout))

    flipped, truncated, foreign, wrong_format = path(0, 0), path(1, 1), path(2, 0), path(3, 0)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    foreign.write_bytes(path(3, 1).read_bytes())  # another chunk's object under this name
    wrong_format.write_bytes(path(3, 0, "FLASH_ATTN").read_bytes())  # same hash, other layout

    daemon = daemons(*disk_args(disk))
    try:
        cpu = worker_for(daemon.url)
        assert [count_lookup(cpu.mq_client, hashes) for hashes in prompts] == [0, 1, 0, 0]
        for damaged in (flipped, truncated, foreign, wrong_format):
            assert not damaged.exists(), damaged
        t = tier(daemon.url)
        assert t.corrupt_total == 4 and t.objects == 6
        assert path(3, 0, "FLASH_ATTN").exists()  # the other layout's own object is untouched
    finally:
        _stop(daemon)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --user --mount to mount a small tmpfs")
def test_full_disk_skips_writes_and_the_daemon_serves_on(daemons, disk: Path, worker_for) -> None:
    """The tier directory is a 256 KiB tmpfs (in the daemon's own mount namespace): ENOSPC."""
    disk.mkdir()
    mount = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
             'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"', str(disk)]
    daemon = daemons(*disk_args(disk), command_prefix=mount)
    try:
        worker = worker_for(daemon.url)
        prompts = [block_hashes([p * 1000 + t for t in range(2 * CHUNK)])[1::2] for p in range(20)]
        for p, hashes in enumerate(prompts):  # 40 chunks of 16 KiB: 640 KiB
            assert store(worker.mq_client, worker.instance_id, hashes, f"p{p}") == [ChunkOutcome.STORED] * 2
        deadline = time.monotonic() + 20
        while (t := tier(daemon.url)).write_queue_chunks:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert t.write_errors_total > 0 and 0 < t.objects < 40
        assert t.writes_total + t.write_errors_total == 40
        assert all(count_lookup(worker.mq_client, hashes) == 2 for hashes in prompts)  # L1 serves on
        assert daemon.proc.poll() is None
        assert "No space left on device" in daemon.log()
    finally:
        _stop(daemon)


def test_a_full_write_queue_skips_chunks_without_blocking_store(daemons, disk: Path,
                                                                worker_for) -> None:
    daemon = daemons(*disk_args(disk, 0.01, "--l2-queue-gb", str(CHUNK_BYTES / 2 / 2**30)))
    try:
        worker = worker_for(daemon.url)
        hashes = block_hashes(list(range(2 * CHUNK)))[1::2]
        assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 2
        t = tier(daemon.url)
        assert (t.skipped_writes_total, t.objects, t.write_queue_chunks) == (2, 0, 0)
        assert count_lookup(worker.mq_client, hashes) == 2
    finally:
        _stop(daemon)


POOL_OBJECTS = 16
POOL_GB = str(POOL_OBJECTS * CHUNK_BYTES / 2**30)


def test_queued_chunks_are_never_evicted_before_written(daemons, disk: Path, worker_for) -> None:
    """A pool of 16 chunks, 60 stored as fast as they come: every chunk that STORE accepted is
    written to disk or counted as skipped; none is lost to an L1 eviction."""
    args = ("--chunk-size", str(CHUNK), "--l1-size-gb", POOL_GB,
            "--l2", f"disk://{disk}?size_gb=0.01", "--l2-queue-gb", str(8 * CHUNK_BYTES / 2**30))
    daemon = daemons(*args)
    try:
        worker = worker_for(daemon.url)
        client = worker.mq_client
        futures = []
        for p in range(30):
            keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=f"p{p}")
                    for h in block_hashes([p * 1000 + t for t in range(2 * CHUNK)])[1::2]]
            futures.append(client.submit(RequestType.STORE, [keys, worker.instance_id, list(range(4)), b""]))
        outcomes = [o for f in futures for o in f.result(30).outcomes]
        stored = outcomes.count(ChunkOutcome.STORED)
        assert stored >= POOL_OBJECTS
        deadline = time.monotonic() + 20
        while (t := tier(daemon.url)).write_queue_chunks:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert t.objects + t.skipped_writes_total == stored, (t, outcomes)
        assert t.write_errors_total == 0
    finally:
        _stop(daemon)


def test_a_second_daemon_on_the_same_directory_is_refused(daemons, short_tmp: Path, disk: Path) -> None:
    first = daemons(*disk_args(disk))
    try:
        with pytest.raises(RuntimeError, match="in use by another lmcache-mp daemon"):
            daemons(*disk_args(disk), url=f"ipc://{short_tmp / 'second.sock'}")
        assert first.proc.poll() is None
    finally:
        _stop(first)


def test_an_unusable_tier_directory_is_a_clear_error_at_start(short_tmp: Path) -> None:
    blocker = short_tmp / "file"
    blocker.write_text("not a directory")
    for url, message in [(f"disk://{blocker}/sub?size_gb=1", "cannot"),
                         ("disk://relative?size_gb=1", "absolute"),
                         (f"disk://{short_tmp}/d", "size_gb"),
                         ("nfs://host/x", "unsupported storage tier")]:
        out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen",
                              f"ipc://{short_tmp / 'x.sock'}", "--l1-size-gb", "0.01", "--l2", url],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


# In anonymous memory: a pool file's sealer pins each new chunk while it checksums it, and one it
# still holds when the last STOREs evict its parent stays, first in line for the next eviction
# (tests/unit/test_pool_file.py), where this test counts what is resident.
@pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", POOL_GB, "--pool-file", "")
def test_eviction_keeps_every_prefix_usable(daemon: DaemonProcess, worker_for) -> None:
    """Prompts of 4 chunks, each stored in two STOREs (chunked prefill), 24 chunks into a pool
    of 16: what stays of each prompt is a prefix, so every resident chunk can still be hit."""
    worker = worker_for(daemon.url)
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        prompts = [block_hashes([p * 1000 + t for t in range(4 * CHUNK)]) for p in range(6)]
        chunks = [hashes[1::2] for hashes in prompts]
        for p in range(6):
            if p == 4:  # a lookup of prompt 1 (then its end) makes it the most recently used
                assert lookup(scheduler, "hot", block_hashes=prompts[1]) == 4 * CHUNK
                scheduler.end_session("hot")
            for half in (0, 1):
                outcomes = store(worker.mq_client, worker.instance_id, chunks[p][2 * half:2 * half + 2],
                                 f"p{p}", first_block=4 * half)
                assert outcomes == [ChunkOutcome.STORED] * 2
        resident = [[count_lookup(worker.mq_client, [h]) for h in hashes] for hashes in chunks]
        assert sum(map(sum, resident)) == POOL_OBJECTS
        for p, flags in enumerate(resident):
            kept = sum(flags)
            assert flags == [1] * kept + [0] * (4 - kept), (p, resident)
            assert count_lookup(worker.mq_client, chunks[p]) == kept
        assert resident[1] == [1, 1, 1, 1]  # looked up recently: kept whole
    finally:
        scheduler.shutdown()


def test_sigkilled_daemon_leaves_no_damage(daemons, disk: Path, worker_for) -> None:
    """Killed mid-life: whatever reached the disk is served after a restart; nothing half-written is."""
    daemon = daemons(*disk_args(disk))
    worker = worker_for(daemon.url)
    hashes = block_hashes(list(range(4 * CHUNK)))[1::2]
    assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 4
    wait_written(daemon.url, 4)
    daemon.stop(signal.SIGKILL)
    (disk / "tmp" / "leftover.tmp").write_bytes(b"half a chunk")
    daemon = daemons(*disk_args(disk))
    try:
        worker2 = worker_for(daemon.url)
        assert count_lookup(worker2.mq_client, hashes) == 4
        assert not (disk / "tmp" / "leftover.tmp").exists()
    finally:
        _stop(daemon)


def test_tiers_in_order_write_to_all_and_read_from_the_first_that_has_it(daemons, short_tmp: Path,
                                                                         worker_for) -> None:
    near, far = short_tmp / "near", short_tmp / "far"
    args = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
            "--l2", f"disk://{near}?size_gb=0.01", "--l2", f"disk://{far}?size_gb=0.01")
    daemon = daemons(*args)
    worker = worker_for(daemon.url)
    hashes = block_hashes(list(range(3 * CHUNK)))[1::2]
    assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 3
    deadline = time.monotonic() + 20
    while [(t.objects, t.write_queue_chunks) for t in status(daemon.url).tiers] != [(3, 0), (3, 0)]:
        assert time.monotonic() < deadline, status(daemon.url).tiers
        time.sleep(0.02)
    worker.shutdown()
    _stop(daemon)
    object_path(near, hashes[1], fmt()).unlink()  # the near tier lost chunk 1: the far one has it

    daemon = daemons(*args)
    try:
        worker = worker_for(daemon.url)
        assert count_lookup(worker.mq_client, hashes) == 3
        near_stats, far_stats = status(daemon.url).tiers
        assert (near_stats.promotions_total, far_stats.promotions_total) == (2, 1)
        assert near_stats.name == f"disk://{near}" and far_stats.name == f"disk://{far}"
    finally:
        _stop(daemon)
