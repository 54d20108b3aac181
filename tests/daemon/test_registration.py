"""Registrations. Instance ids are unique per registration and never taken over, a
permanent refusal is not retried, and a chunk the pool can't allocate is refused at REGISTER.

The real daemon, real shared memory and the real worker adapter, as in test_data_path.py.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from lmcache_mp.errors import KVExportError, LMCacheMPError, ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from lmcache_mp.transfer.attach_channel import AttachChannel
from lmcache_mp.transfer.shm import share_cpu_tensors
from tests.support.helpers import ADAPTER_LOG, register_requests, status
from vllm_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
SHAPE = [NUM_BLOCKS, 2, BLOCK, 64]
@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_registered_instance_id_is_refused_never_replaced(daemon: DaemonProcess, short_tmp: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Two workers with the same id (pids repeat across containers): the second REGISTER is
    refused, and a RETRIEVE under that id still writes into the first worker's cache only."""
    forced = 4242
    first = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, instance_id=forced)
    second = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, instance_id=forced)
    raw = MessageQueueClient(daemon.url, request_timeout_s=30)
    channel = None
    try:
        first_caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1)
        first.register_kv_caches(first_caches, "CPU_ATTN")
        hashes = block_hashes(list(range(2 * CHUNK)))
        first.submit_store_request("s", LoadStoreOp([0, 1, 2, 3], block_hashes=hashes), None)
        wait_done(first, "s", retrieve=False)

        # The daemon refuses the id outright, whatever the caches.
        other = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=2)
        handles, fds = share_cpu_tensors(list(other.values()))
        channel = AttachChannel.open(raw.handshake("tests").attach_socket, fds)
        registration = KVCacheRegistration("m", 1, 0, "CPU_ATTN", channel.token)
        with pytest.raises(ServerError) as info:
            raw.submit(RequestType.REGISTER_KV_CACHE, [forced, handles, registration]).result(10)
        assert info.value.code is ErrorCode.ALREADY_REGISTERED
        assert status(daemon.url).registered_instances == [forced]

        # The adapter, refused, registers under a fresh id of its own.
        second_caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=3)
        before = {name: t.clone() for name, t in second_caches.items()}
        with caplog.at_level(logging.WARNING, logger=ADAPTER_LOG):
            second.register_kv_caches(second_caches, "CPU_ATTN")
        assert second.instance_id != forced
        assert any("already registered" in r.getMessage() for r in caplog.records)
        assert status(daemon.url).registered_instances == sorted([forced, second.instance_id])

        # A RETRIEVE under the forced id lands in the first worker's cache, and only there.
        first.submit_retrieve_request("r", LoadStoreOp([10, 11, 12, 13], block_hashes=hashes), None)
        wait_done(first, "r", retrieve=True)
        assert first.take_failed_retrieves() == {}
        assert torch.equal(pages(first_caches, "CPU_ATTN", SHAPE, [10, 11, 12, 13]).view(torch.uint8),
                           pages(first_caches, "CPU_ATTN", SHAPE, [0, 1, 2, 3]).view(torch.uint8))
        for name, tensor in second_caches.items():
            assert torch.equal(tensor.view(torch.uint8), before[name].view(torch.uint8))
    finally:
        if channel is not None:
            channel.close()
        raw.close()
        second.shutdown()
        first.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_default_instance_ids_are_random_not_the_pid(daemon: DaemonProcess, worker_for) -> None:
    a, b = worker_for(daemon.url, seed=1), worker_for(daemon.url, seed=2)
    assert a.instance_id != b.instance_id
    assert os.getpid() not in (a.instance_id, b.instance_id)
    assert all(0 <= w.instance_id < 2**63 for w in (a, b))  # fits the wire's signed 64 bits
    assert status(daemon.url).registered_instances == sorted([a.instance_id, b.instance_id])


def test_worker_registers_again_with_a_restarted_daemon(daemons) -> None:
    """The worker registers with the new daemon by itself, under a new instance id: a
    request sent to the old daemon that reaches the new one names an id the new one never knew."""
    first = daemons(*DAEMON_ARGS)
    worker = LMCacheMPWorkerAdapter(first.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        instance_id = worker.instance_id
        assert first.stop() == 0
        second = daemons(*DAEMON_ARGS)
        deadline = time.monotonic() + 15
        while not worker.ensure_registered():
            assert time.monotonic() < deadline, "the worker did not register with the new daemon"
            time.sleep(0.02)
        assert worker.instance_id != instance_id
        assert status(second.url).registered_instances == [worker.instance_id]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("case", ["refused", "unexportable"])
def test_permanent_refusal_is_not_retried(daemons, caplog: pytest.LogCaptureFixture, case: str) -> None:
    """A layout the daemon can't read, or caches the worker can't share (here a dtype the daemon
    does not know; on GPUs e.g. a cuMem allocation CUDA IPC can't export): at most one REGISTER,
    one ERROR, then the worker serves without the cache (its operations never raise: before, an
    export error crashed vLLM's worker) instead of registering again every 0.25 s."""
    port = free_port()
    daemon = daemons(*DAEMON_ARGS, "--metrics-port", str(port))
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    # "refused": an MLA backend's name on caches of two heads (MLA has one), which the daemon can't read.
    dtype, layout = ((torch.bfloat16, "TRITON_MLA") if case == "refused"
                     else (torch.float8_e4m3fnuz, "CPU_ATTN"))
    try:
        with caplog.at_level(logging.WARNING, logger=ADAPTER_LOG):
            with pytest.raises(LMCacheMPError) as info:
                worker.register_kv_caches(make_caches(SHAPE, dtype, LAYERS, seed=1), layout)
            if case == "refused":
                assert isinstance(info.value, ServerError) and info.value.code is ErrorCode.INVALID_ARGUMENT
            else:
                assert isinstance(info.value, KVExportError) and "float8_e4m3fnuz" in str(info.value)
            hashes = block_hashes(list(range(2 * CHUNK)))
            deadline = time.monotonic() + 3
            step = 0
            while time.monotonic() < deadline:  # a few seconds of engine steps
                assert not worker.ensure_registered()
                worker.submit_store_request(f"s{step}", LoadStoreOp([0, 1, 2, 3], block_hashes=hashes), None)
                worker.submit_retrieve_request(f"r{step}", LoadStoreOp([4, 5, 6, 7], block_hashes=hashes),
                                               None)
                worker.get_finished({f"s{step}"})
                step += 1
                time.sleep(0.05)
            worker.get_finished(set())
        assert register_requests(port) == (1 if case == "refused" else 0)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1
        assert ("TRITON_MLA" if case == "refused" else "float8_e4m3fnuz") in errors[0].getMessage()
        # Skipped stores are no failures; a retrieve (nothing could be loaded) is reported failed.
        assert not any("store for request" in r.getMessage() for r in caplog.records)
        assert set(worker.take_failed_retrieves()) == {f"r{i}" for i in range(step)}
        assert status(daemon.url).registered_instances == []
    finally:
        worker.shutdown()


def test_transient_refusal_is_retried_with_backoff(daemons, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that answers every REGISTER with OVERLOADED (its queue deadline can't be met):
    retried, but 0.25 s doubling, not every 0.25 s; a warning per attempt, never an ERROR."""
    port = free_port()
    daemon = daemons(*DAEMON_ARGS, "--queue-deadline-s", "0.000001", "--metrics-port", str(port))
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger=ADAPTER_LOG):
            with pytest.raises(ServerError) as info:
                worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
            assert info.value.code is ErrorCode.OVERLOADED
            deadline = time.monotonic() + 3.5  # tries at about 0, 0.25, 0.75, 1.75 (and 3.75) s
            while time.monotonic() < deadline:
                assert not worker.ensure_registered()
                time.sleep(0.02)
        attempts = register_requests(port)
        assert 3 <= attempts <= 5, attempts  # every 0.25 s would be about 14
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert sum("retrying in" in r.getMessage() for r in caplog.records) == attempts
    finally:
        worker.shutdown()


# A pool whose tail doesn't fill a slab: once a 16 KiB chunk has fixed the slab size (9 chunks,
# 144 KiB), the pool can allocate 7 slabs in one piece, 1008 KiB, less than its capacity.
POOL_BYTES = 1124 * 1024
SMALL_CHUNK = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2
CONTIGUOUS = 7 * 9 * SMALL_CHUNK
BIG_HEADS = 132  # a chunk of 1056 KiB: less than the pool, more than it can allocate in one piece
BIG_CHUNK = LAYERS * (CHUNK // BLOCK) * BIG_HEADS * BLOCK * 64 * 2


@pytest.mark.daemon_args("--chunk-size", str(CHUNK), "--l1-size-gb", repr(POOL_BYTES / 2**30))
def test_chunk_larger_than_the_pool_can_allocate_is_refused_at_register(daemon: DaemonProcess,
                                                                       worker_for) -> None:
    assert CONTIGUOUS < BIG_CHUNK < POOL_BYTES
    small = worker_for(daemon.url, seed=1)
    hashes = block_hashes(list(range(2 * CHUNK)))
    small.submit_store_request("s", LoadStoreOp([0, 1, 2, 3], block_hashes=hashes), None)
    wait_done(small, "s", retrieve=False)
    big = LMCacheMPWorkerAdapter(daemon.url, None, "m-big", 1, 0, BLOCK)
    try:
        with pytest.raises(ServerError) as info:
            big.register_kv_caches(make_caches([4, BIG_HEADS, BLOCK, 64], torch.bfloat16, LAYERS, seed=2),
                                   "CPU_ATTN")
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert str(BIG_CHUNK) in info.value.message and str(CONTIGUOUS) in info.value.message
        # Nothing else broke: the other worker is registered and stores, the daemon answers.
        assert status(daemon.url).registered_instances == [small.instance_id]
        more = block_hashes(list(range(1000, 1000 + 2 * CHUNK)))
        small.submit_store_request("s2", LoadStoreOp([4, 5, 6, 7], block_hashes=more), None)
        wait_done(small, "s2", retrieve=False)
        assert status(daemon.url).objects == 4
    finally:
        big.shutdown()


def test_refusal_lasts_as_long_as_the_daemon_that_gave_it(daemons) -> None:
    """Refused by a daemon whose pool is too small; restarted with a larger one, the daemon gets
    one more try, and the worker registers without a restart of its own."""
    tiny = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", repr(BIG_CHUNK / 2 / 2**30))
    worker = LMCacheMPWorkerAdapter(tiny.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    try:
        with pytest.raises(ServerError) as info:
            worker.register_kv_caches(make_caches([4, BIG_HEADS, BLOCK, 64], torch.bfloat16, LAYERS, seed=1),
                                      "CPU_ATTN")
        assert info.value.code is ErrorCode.INVALID_ARGUMENT and str(BIG_CHUNK) in info.value.message
        assert not worker.ensure_registered()
        assert tiny.stop() == 0
        larger = daemons(*DAEMON_ARGS)
        deadline = time.monotonic() + 15
        while not worker.ensure_registered():
            assert time.monotonic() < deadline, "the worker never tried the restarted daemon"
            time.sleep(0.02)
        assert status(larger.url).registered_instances == [worker.instance_id]
    finally:
        worker.shutdown()
