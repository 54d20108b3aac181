"""Warm restart through the real daemon: the pool file outlives a SIGTERM or a SIGKILL,
the next daemon adopts it and serves its chunks bit-exact, a worker carries on under a new
instance id, and --fresh-pool / `clear --pool-file` discard it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import count_lookup, refusal, run_worker, status, store, wait_for, wait_for_status
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


def retrieved(url: str, out: Path, hashes: list[bytes], chunks: int) -> torch.Tensor:
    """What a fresh worker reads back of `hashes`, asserting it hit `chunks` chunks."""
    run_worker({"url": url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16", "num_layers": LAYERS,
                "block_size": BLOCK, "action": "retrieve", "model": "m", "block_ids": list(range(20, 30)),
                "request_id": "reader", "out": str(out), "block_hashes": [h.hex() for h in hashes]})
    got = torch.load(out)
    assert got["hit"] == chunks * CHUNK and got["failed"] == []
    return got["pages"][:, : chunks * (CHUNK // BLOCK)]  # pages are (layer, block, ...)


def test_sigterm_then_a_new_daemon_serves_every_chunk_bit_exact(daemons, short_tmp: Path,
                                                                worker_for) -> None:
    tokens = list(range(5 * CHUNK + 7))
    hashes = block_hashes(tokens)
    ids = [9, 3, 40, 41, 7, 12, 60, 2, 33, 34]
    daemon: DaemonProcess = daemons(*ARGS)
    worker = worker_for(daemon.url)
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1)  # what worker_for filled
    worker.submit_store_request("s", LoadStoreOp(ids, block_hashes=hashes), None)
    wait_done(worker, "s", retrieve=False)
    first_epoch = status(daemon.url).epoch
    old_id = worker.instance_id
    assert daemon.stop(keep_pool=True) == 0
    assert daemon.pool_path is not None and daemon.pool_path.exists()
    assert os.stat(daemon.pool_path).st_mode & 0o777 == 0o600

    again: DaemonProcess = daemons(*ARGS)
    report = status(again.url)
    assert report.epoch != first_epoch and report.pool_file == str(daemon.pool_path)
    assert (report.pool_adopted_chunks, report.objects) == (5, 5)
    # A clean stop sealed every chunk: each is verified before readers see it.
    report = wait_for_status(again.url, lambda r: r.pool_unverified == 0, "adopted chunks verified")
    assert (report.pool_adopted_unsealed, report.pool_verified_total, report.pool_dropped_total) == (0, 5, 0)
    got = retrieved(again.url, short_tmp / "pages.pt", hashes, 5)
    assert torch.equal(got.view(torch.uint8), pages(caches, "CPU_ATTN", SHAPE, ids).view(torch.uint8))
    # The worker registers again by itself, under a new id: requests of the last daemon's time
    # that reach this one name an id it never knew.
    wait_for(worker.registration.ensure_registered, "the worker registered again")  # as each step does
    assert status(again.url).registered_instances == [worker.instance_id] != [old_id]
    stale = [IPCCacheEngineKey("m", 1, 0, chunk_hash=hashes[1], request_id="s")]
    refused = refusal(worker.mq_client, RequestType.STORE, [stale, old_id, [9, 3], b""])
    assert refused.code is ErrorCode.UNKNOWN_INSTANCE  # what a request of the old daemon's time gets
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "status", "--url", again.url],
                         capture_output=True, text=True, timeout=30)
    assert f"pool file {daemon.pool_path}: adopted 5 chunks" in out.stdout, out.stdout
    # --fresh-pool discards it; `clear --pool-file` removes it once the daemon is stopped.
    assert again.stop(keep_pool=True) == 0
    fresh: DaemonProcess = daemons(*ARGS, "--fresh-pool")
    assert (status(fresh.url).objects, status(fresh.url).pool_adopted_chunks) == (0, 0)
    assert fresh.stop(keep_pool=True) == 0
    cleared = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "clear", "--pool-file",
                              str(daemon.pool_path)], capture_output=True, text=True, timeout=60)
    assert cleared.returncode == 0 and "removed" in cleared.stdout, cleared
    assert not daemon.pool_path.exists()


def _chunk(trial: int, n: int) -> list[bytes]:
    """The block hashes of one chunk of its own: its chunk hash is the last."""
    return block_hashes([trial * 10**6 + n * CHUNK + t for t in range(CHUNK)])


def test_sigkill_during_a_stream_of_stores_adopts_every_answered_chunk(daemons, short_tmp: Path) -> None:
    """A client streams single-chunk STOREs; the daemon is SIGKILLed after a random number of
    answers, while later STOREs run, three times over. Each next daemon holds every chunk
    answered OK, drops none, and the last one answered reads back bit-exact."""
    rng = random.Random(7)
    daemon: DaemonProcess = daemons(*ARGS)
    for trial in range(3):
        caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=trial + 1)
        worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, timeout_s=5)
        worker.register_kv_caches(caches, "CPU_ATTN")
        kill_after = rng.randrange(5, 40)
        enough = threading.Event()

        def kill(proc: subprocess.Popen = daemon.proc, enough: threading.Event = enough) -> None:
            enough.wait(60)
            proc.send_signal(signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        answered = 0
        try:
            while True:
                outcome = store(worker.mq_client, worker.instance_id, _chunk(trial, answered)[-1:], "s")
                assert outcome == [ChunkOutcome.STORED]
                answered += 1
                if answered == kill_after:
                    enough.set()  # the kill lands while the next STOREs run
        except LMCacheMPError:
            pass
        assert daemon.proc.wait(30) == -signal.SIGKILL
        worker.shutdown()
        daemon = daemons(*ARGS)
        report = wait_for_status(daemon.url, lambda r: r.pool_unverified == 0, "adopted chunks verified")
        assert report.pool_dropped_total == 0 and report.pool_adopted_chunks >= answered
        # A LOOKUP asks for the formats of the caches registered: a reader's, like the writer's.
        reader = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, timeout_s=5)
        try:
            reader.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=99), "CPU_ATTN")
            client = reader.mq_client
            missing = [n for n in range(answered) if count_lookup(client, _chunk(trial, n)[-1:]) != 1]
        finally:
            reader.shutdown()
        assert not missing, f"trial {trial}: answered chunks {missing} were not adopted"
        got = retrieved(daemon.url, short_tmp / f"pages-{trial}.pt", _chunk(trial, answered - 1), 1)
        blocks = list(range(CHUNK // BLOCK))
        assert torch.equal(got.view(torch.uint8), pages(caches, "CPU_ATTN", SHAPE, blocks).view(torch.uint8))
