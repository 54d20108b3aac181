"""The KV data path on CPU, with the real daemon and the real adapters."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey, SharedMemoryTensor
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, KVCacheRegistration, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess, launched_pool_directory
from lmcache_mp.transfer.attach_channel import AttachChannel
from lmcache_mp.transfer.shm import share_cpu_tensors
from tests.support.helpers import lookup, run_worker, status
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")

LAYOUTS = {
    "cpu_attn": ("CPU_ATTN", [NUM_BLOCKS, 2, BLOCK, 64]),
    "flash_attn_0.32": ("FLASH_ATTN", [NUM_BLOCKS, 2, BLOCK, 64]),
    "flashinfer_0.32": ("FLASHINFER", [NUM_BLOCKS, 2, BLOCK, 64]),
    "kv_planes": ("FLASH_ATTN", [2, NUM_BLOCKS, BLOCK, 2, 32]),
    "mla": ("TRITON_MLA", [NUM_BLOCKS, BLOCK, 96]),
    "by_shape": ("", [NUM_BLOCKS, 2, BLOCK, 64]),
}


def _our_shm_names() -> set[str]:
    # torch names its shared segments torch_*; other programs (vLLM's queues) are not ours. The
    # launcher's directory of pool files stays while a daemon started here (the session's) runs.
    launched = launched_pool_directory().name
    return {n for n in os.listdir("/dev/shm") if n.startswith(("torch_", "lmcache")) and n != launched}


@pytest.fixture(scope="module", autouse=True)
def no_dev_shm_residue():
    before = _our_shm_names()
    yield
    assert _our_shm_names() <= before


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize("mode", ["hash", "token"])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_store_lookup_retrieve_every_layout(daemon: DaemonProcess, short_tmp: Path, case: str,
                                           mode: str) -> None:
    layout, shape = LAYOUTS[case]
    rng = random.Random(f"{case}-{mode}")
    model = f"model-{case}"
    caches = make_caches(shape, torch.bfloat16, LAYERS, seed=rng.randrange(1 << 30))
    worker = LMCacheMPWorkerAdapter(daemon.url, None, model, 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, model, 1, 0, BLOCK)
    try:
        worker.register_kv_caches(caches, layout or None)
        tokens = [rng.randrange(1000) for _ in range(5 * CHUNK + 7)]  # 5 full chunks + a tail
        hashes = block_hashes(tokens)
        a_ids = rng.sample(range(NUM_BLOCKS), 11)

        def op(ids: list[int], toks: list[int]) -> LoadStoreOp:
            if mode == "hash":
                return LoadStoreOp(ids[: len(toks) // BLOCK], block_hashes=block_hashes(toks))
            return LoadStoreOp(ids, token_ids=toks, start=0, end=len(toks))

        def lookup_kw(toks: list[int]) -> dict:
            return {"block_hashes": block_hashes(toks)} if mode == "hash" else {"token_ids": toks}

        worker.submit_store_request("store-1", op(a_ids, tokens), None)
        wait_done(worker, "store-1", retrieve=False)
        diverged = tokens[: 3 * CHUNK] + [t + 1 for t in tokens[3 * CHUNK:]]
        other = [t + 7 for t in tokens]
        assert lookup(scheduler, "full", **lookup_kw(tokens)) == 5 * CHUNK
        assert lookup(scheduler, "prefix", **lookup_kw(diverged)) == 3 * CHUNK
        assert lookup(scheduler, "none", **lookup_kw(other)) == 0
        assert lookup(scheduler, "short", **lookup_kw(tokens[: CHUNK - 1])) == 0
        for rid in ("full", "prefix", "none", "short"):
            scheduler.end_session(rid)

        # Worker B, in another process, retrieves into other blocks: same bytes as A's.
        b_ids = rng.sample(range(NUM_BLOCKS), 10)
        out = short_tmp / f"pages-{case}-{mode}.pt"
        spec = {"url": daemon.url, "layout": layout, "shape": shape, "dtype": "bfloat16",
                "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": model,
                "block_ids": b_ids, "request_id": "reader", "out": str(out)}
        if mode == "hash":
            spec["block_hashes"] = [h.hex() for h in hashes]
        else:
            spec.update(token_ids=tokens[: 5 * CHUNK], start=0, end=5 * CHUNK)
        run_worker(spec)
        got = torch.load(out)
        assert got["hit"] == 5 * CHUNK and got["failed"] == []
        expected = pages(caches, layout, shape, a_ids[:10])
        assert torch.equal(got["pages"].view(torch.uint8), expected.view(torch.uint8))
        assert status(daemon.url).leases == 0  # the retrieve spent its leases
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_other_layout_is_a_miss_never_wrong_bytes(daemon: DaemonProcess, short_tmp: Path) -> None:
    """Same model and keys, another layout name: the chunk is not served."""
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    caches = make_caches(shape, torch.bfloat16, LAYERS, seed=1)
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(caches, "CPU_ATTN")
        hashes = block_hashes(list(range(2 * CHUNK)))
        worker.submit_store_request("s", LoadStoreOp(list(range(4)), block_hashes=hashes), None)
        wait_done(worker, "s", retrieve=False)
    finally:
        worker.shutdown()  # only a FLASH_ATTN cache is registered from now on
    out = short_tmp / "pages.pt"
    run_worker({"url": daemon.url, "layout": "FLASH_ATTN", "shape": shape, "dtype": "bfloat16",
                "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": "m",
                "block_ids": [10, 11, 12, 13], "block_hashes": [h.hex() for h in hashes],
                "request_id": "r", "out": str(out)})
    got = torch.load(out)
    assert got["hit"] == 0 and got["failed"] == ["r"]
    assert not got["pages"].any()  # nothing was written into the other cache


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_world_size_two_missing_rank_stops_the_prefix(daemon: DaemonProcess) -> None:
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    tokens = list(range(4 * CHUNK))
    hashes = block_hashes(tokens)
    workers = []
    try:
        for rank in range(2):
            w = LMCacheMPWorkerAdapter(daemon.url, None, "tp2", 2, rank, BLOCK)
            w.register_kv_caches(make_caches(shape, torch.bfloat16, LAYERS, seed=rank), "CPU_ATTN")
            workers.append(w)
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "tp2", 2, 0, BLOCK)
        assert lookup(scheduler, "before", block_hashes=hashes) == 0
        workers[0].submit_store_request("r0", LoadStoreOp(list(range(8)), block_hashes=hashes), None)
        wait_done(workers[0], "r0", retrieve=False)
        assert lookup(scheduler, "rank0-only", block_hashes=hashes) == 0  # rank 1 has nothing
        for name, blocks in (("c01", slice(0, 4)), ("c3", slice(6, 8))):  # rank 1 misses chunk 2
            workers[1].submit_store_request(name, LoadStoreOp(list(range(8))[blocks],
                                                              block_hashes=hashes[blocks]), None)
            wait_done(workers[1], name, retrieve=False)
        assert lookup(scheduler, "tp", block_hashes=hashes) == 2 * CHUNK
        assert lookup(scheduler, "from-c2", block_hashes=hashes[4:]) == 0
        scheduler.end_session("tp")
        scheduler.shutdown()
    finally:
        for w in workers:
            w.shutdown()


@pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--lease-ttl-s", "1.5")
def test_end_session_and_ttl_free_leases(daemon: DaemonProcess) -> None:
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(shape, torch.bfloat16, LAYERS, seed=3), "CPU_ATTN")
        hashes = block_hashes(list(range(3 * CHUNK)))
        worker.submit_store_request("s", LoadStoreOp(list(range(6)), block_hashes=hashes), None)
        wait_done(worker, "s", retrieve=False)
        assert lookup(scheduler, "a", block_hashes=hashes) == 3 * CHUNK
        st = status(daemon.url)
        assert (st.sessions, st.leases, st.objects) == (1, 3, 3)
        scheduler.end_session("a")
        deadline = time.monotonic() + 5
        while status(daemon.url).leases:
            assert time.monotonic() < deadline
        assert lookup(scheduler, "b", block_hashes=hashes) == 3 * CHUNK
        assert status(daemon.url).leases == 3
        time.sleep(3.0)  # TTL 1.5 s, checked every second
        st = status(daemon.url)
        assert (st.sessions, st.leases) == (0, 0)
        assert st.registered_instances == [worker.instance_id]
    finally:
        worker.shutdown()
        scheduler.shutdown()


OBJECT_BYTES = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2  # 16 KiB per chunk
POOL_OBJECTS = 16


@pytest.mark.daemon_args("--chunk-size", str(CHUNK),
                         "--l1-size-gb", str(POOL_OBJECTS * OBJECT_BYTES / 2**30))
def test_full_pool_evicts_lru_never_leased(daemon: DaemonProcess) -> None:
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    prompts = [block_hashes([p * 1000 + t for t in range(2 * CHUNK)]) for p in range(12)]
    raw = worker.mq_client

    def store(p: int) -> list[ChunkOutcome]:
        keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=f"s{p}") for h in prompts[p][1::2]]
        reply = raw.submit(RequestType.STORE, [keys, worker.instance_id, list(range(4)), b""]).result(10)
        return reply.outcomes

    try:
        worker.register_kv_caches(make_caches(shape, torch.bfloat16, LAYERS, seed=4), "CPU_ATTN")
        for p in range(8):
            assert store(p) == [ChunkOutcome.STORED] * 2
        assert status(daemon.url).objects == POOL_OBJECTS
        assert store(0) == [ChunkOutcome.ALREADY_PRESENT] * 2
        assert lookup(scheduler, "keep", block_hashes=prompts[0]) == 2 * CHUNK  # leased
        assert lookup(scheduler, "touch", block_hashes=prompts[1]) == 2 * CHUNK
        scheduler.end_session("touch")  # prompt 1 is now recently used, not leased
        for p in (8, 9):
            assert store(p) == [ChunkOutcome.STORED] * 2
        hits = [lookup(scheduler, f"check{p}", block_hashes=prompts[p]) // CHUNK for p in range(10)]
        for p in range(10):
            scheduler.end_session(f"check{p}")
        assert hits == [2, 2, 0, 0, 2, 2, 2, 2, 2, 2]  # prompts 2 and 3 were least recently used
        # Lease everything: nothing is evictable, so a store gets an honest NO_SPACE.
        for p in (0, 1, 4, 5, 6, 7, 8, 9):
            lookup(scheduler, f"pin{p}", block_hashes=prompts[p])
        assert store(10) == [ChunkOutcome.NO_SPACE] * 2
        assert lookup(scheduler, "after", block_hashes=prompts[0]) == 2 * CHUNK
        st = status(daemon.url)
        assert st.objects == POOL_OBJECTS and st.pool_used_bytes <= st.pool_bytes
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_sigkilled_worker_is_dropped_and_leaves_no_mapping(daemon: DaemonProcess) -> None:
    spec = {"url": daemon.url, "layout": "CPU_ATTN", "shape": [NUM_BLOCKS, 2, BLOCK, 64],
            "dtype": "bfloat16", "num_layers": LAYERS, "block_size": BLOCK, "action": "hold",
            "block_ids": [0, 1], "block_hashes": [], "model": "m"}
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.testing.kv_worker", json.dumps(spec)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, instance_id = proc.stdout.readline().split()
        assert ready == "READY" and int(instance_id) != proc.pid
        assert status(daemon.url).registered_instances == [int(instance_id)]
        maps = Path(f"/proc/{daemon.proc.pid}/maps")
        assert "(deleted)" in maps.read_text()  # the worker's cache, mapped by the daemon
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while status(daemon.url).registered_instances:
            assert time.monotonic() < deadline, "daemon kept a dead worker's registration"
            time.sleep(0.05)
        while "(deleted)" in maps.read_text():
            assert time.monotonic() < deadline, "daemon still maps a dead worker's memory"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert daemon.proc.poll() is None


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_bad_data_requests_get_typed_errors(daemon: DaemonProcess) -> None:
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(shape, torch.bfloat16, LAYERS, seed=5), "CPU_ATTN")
        c, iid = worker.mq_client, worker.instance_id
        key = IPCCacheEngineKey("m", 1, 0, chunk_hash=b"x" * 32, request_id="r")
        cases = [
            (RequestType.STORE, [[key], iid + 12345, [0, 1], b""], ErrorCode.UNKNOWN_INSTANCE),
            (RequestType.STORE, [[key], iid, [0], b""], ErrorCode.INVALID_ARGUMENT),  # too few ids
            (RequestType.STORE, [[key], iid, [0, NUM_BLOCKS], b""], ErrorCode.INVALID_ARGUMENT),
            (RequestType.STORE, [[key], iid, [0, 1], b"event"], ErrorCode.INVALID_ARGUMENT),
            (RequestType.RETRIEVE, [[IPCCacheEngineKey("other", 1, 0, chunk_hash=b"x")], iid, [0, 1], b""],
             ErrorCode.INVALID_ARGUMENT),
            (RequestType.STORE, [[IPCCacheEngineKey("m", 1, 0, token_ids=(1, 2), start=5, end=64)],
                                 iid, [0, 1], b""], ErrorCode.INVALID_ARGUMENT),
            (RequestType.REGISTER_KV_CACHE, [1, [], KVCacheRegistration("m", 1, 0, "CPU_ATTN")],
             ErrorCode.INVALID_ARGUMENT),
            (RequestType.REGISTER_KV_CACHE, [1, [], KVCacheRegistration("m", 1, 3)],
             ErrorCode.INVALID_ARGUMENT),
        ]
        # A shared-memory handle whose view overruns the memory actually handed over.
        tensor = torch.zeros(4, 64)
        (handle,), fds = share_cpu_tensors([tensor])
        channel = AttachChannel.open(str(Path(daemon.url.removeprefix("ipc://")).with_suffix(".sock.attach")),
                                     fds)
        bogus = SharedMemoryTensor(state=msgspec.structs.replace(handle.state, shape=(8, 64)))
        cases.append((RequestType.REGISTER_KV_CACHE,
                      [7, [bogus], KVCacheRegistration("m", 1, 0, "", channel.token)],
                      ErrorCode.INVALID_ARGUMENT))
        for request_type, payload, code in cases:
            with pytest.raises(ServerError) as info:
                c.submit(request_type, payload).result(10)
            assert info.value.code is code, (request_type, payload, info.value)
        channel.close()
        assert c.submit(RequestType.PING, [3]).result(5) == 3
        assert status(daemon.url).registered_instances == [iid]
    finally:
        worker.shutdown()


@pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", "0.2", "--max-workers", "1",
                         "--queue-deadline-s", "0.001")
def test_requests_queued_past_their_deadline_are_refused_not_run(daemon: DaemonProcess) -> None:
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        # A 128 MiB store keeps the only worker thread busy for ~10 ms.
        caches = make_caches([1024, 8, BLOCK, 256], torch.bfloat16, LAYERS, seed=6)
        for attempt in range(5):  # on a busy machine the REGISTER itself may miss the 1 ms deadline
            try:
                worker.register_kv_caches(caches, "CPU_ATTN")
                break
            except ServerError as err:
                assert err.code is ErrorCode.OVERLOADED and attempt < 4, err
        hashes = block_hashes(list(range(1024 * BLOCK)))
        keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h) for h in hashes[1::2]]
        c = worker.mq_client
        for _ in range(5):  # the deadline is 1 ms: on a busy machine the STORE itself may miss it
            slow = c.submit(RequestType.STORE, [keys, worker.instance_id, list(range(1024)), b""])
            queued = [c.submit(RequestType.UNREGISTER_KV_CACHE, [10**6 + i]) for i in range(20)]
            slow.wait(30)
            if slow.exception() is None:
                break
            for f in queued:
                f.wait(30)
        assert slow.exception() is None, slow.exception()
        refused = 0
        for f in queued:
            assert f.wait(30)
            err = f.exception()
            if err is not None:
                assert isinstance(err, ServerError) and err.code is ErrorCode.OVERLOADED
                assert "not started" in err.message
                refused += 1
            else:
                assert f.result() is False  # ran: nothing was registered under that id
        assert refused > 0
        assert c.submit(RequestType.PING, [4]).result(5) == 4
    finally:
        worker.shutdown()


SPLIT_BLOCKS = 2048  # half of it: 512 chunks, milliseconds of copying, long enough to be split


@pytest.mark.daemon_args(*DAEMON_ARGS)  # two worker threads, the default: a RETRIEVE is split
def test_a_large_retrieve_is_split_byte_exact_and_all_or_nothing(daemon: DaemonProcess) -> None:
    """A RETRIEVE of many chunks is copied by two threads at once (STATUS counts the
    chunks the helper copied). Every page lands where one thread would put it, blocks named -1
    are left alone, and a RETRIEVE that names a chunk the daemon lacks still writes nothing."""
    half = SPLIT_BLOCKS // 2
    bpc = CHUNK // BLOCK
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches([SPLIT_BLOCKS, 2, BLOCK, 64], torch.bfloat16, LAYERS, seed=7),
                                  "CPU_ATTN")
        caches = list(worker.kv_caches.values())
        client, iid = worker.mq_client, worker.instance_id
        hashes = block_hashes(list(range(half * BLOCK)))[bpc - 1::bpc]
        keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id="r") for h in hashes]
        outcomes = client.submit(RequestType.STORE, [keys, iid, list(range(half)), b""]).result(30).outcomes
        assert set(outcomes) == {ChunkOutcome.STORED}
        for cache in caches:
            cache[half:] = -3.0
        target = [-1 if b % 7 == 3 else half + b for b in range(half)]  # some blocks vLLM holds already
        before = status(daemon.url).split_chunks

        missing = [*keys[:-1], IPCCacheEngineKey("m", 1, 0, chunk_hash=b"never stored", request_id="r")]
        refused = client.submit(RequestType.RETRIEVE, [missing, iid, target, b""]).result(30)
        assert not refused.ok and "no longer stored" in refused.reason
        assert all(bool((cache[half:] == -3.0).all()) for cache in caches)  # not a page written

        assert client.submit(RequestType.RETRIEVE, [keys, iid, target, b""]).result(30).ok
        for layer, cache in enumerate(caches):
            for pos, block in enumerate(target):
                expected = cache[pos] if block >= 0 else torch.full_like(cache[pos], -3.0)
                assert torch.equal(cache[half + pos], expected), (layer, pos)
        report = status(daemon.url)
        assert report.split_chunks > before, "the RETRIEVE was copied by one thread only"
        assert report.leases == 0 and report.transfers_running == 0
    finally:
        worker.shutdown()


@pytest.mark.daemon_args("--chunk-size", str(CHUNK))
def test_two_engines_storing_the_same_chunks_at_once_copy_each_chunk_once(daemon: DaemonProcess) -> None:
    """Two engines of one model (two registered instances, as two vLLM servers) store the same
    prompt's chunks at the same moment, round after round: each chunk is copied by exactly one of
    them (STORED), the other finds it present, even while it is still being written (ALREADY_PRESENT:
    no copy, no wait), and the pool gains exactly one object per chunk."""
    shape = [NUM_BLOCKS, 2, BLOCK, 64]
    copied_once = sorted([ChunkOutcome.STORED, ChunkOutcome.ALREADY_PRESENT])
    workers = [LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK) for _ in range(2)]
    try:
        for seed, worker in enumerate(workers):
            worker.register_kv_caches(make_caches(shape, torch.bfloat16, LAYERS, seed=seed), "CPU_ATTN")
        chunks = 4
        for round_no in range(20):
            hashes = block_hashes([round_no * 10_000 + t for t in range(chunks * CHUNK)])[1::2]
            before = status(daemon.url).objects

            def store(worker: LMCacheMPWorkerAdapter, hashes: list[bytes] = hashes,
                      round_no: int = round_no) -> list[ChunkOutcome]:
                keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=f"r{round_no}") for h in hashes]
                request = [keys, worker.instance_id, list(range(2 * chunks)), b""]
                return worker.mq_client.submit(RequestType.STORE, request).result(10).outcomes

            with ThreadPoolExecutor(2) as pool:
                outcomes = list(pool.map(store, workers))
            for chunk in range(chunks):
                assert sorted(o[chunk] for o in outcomes) == copied_once
            assert status(daemon.url).objects == before + chunks
    finally:
        for worker in workers:
            worker.shutdown()
