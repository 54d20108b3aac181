"""Registering a CPU KV cache: it is moved into shared memory fast (a populated memfd swapped
into the storage in place), or found there already (allocated in shared memory, as the connector
makes vLLM do), or, where the memfd path is refused, shared by torch's share_memory_().

In every case the worker keeps its very tensors and views, they keep their bytes, and the daemon
sees what is written through them: checked with the real daemon, a STORE, a LOOKUP and a RETRIEVE.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.transfer import shm_move
from lmcache_mp.transfer.shm_move import AllocateInSharedMemory
from tests.support.helpers import status
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
MOVE_LOG = "lmcache_mp.transfer.shm_move"
STORED, RETRIEVED = [0, 1, 2, 3], [13, 12, 11, 10]  # two chunks, and where they are retrieved to


@pytest.fixture
def worker(daemon: DaemonProcess) -> Iterator[LMCacheMPWorkerAdapter]:
    w = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    yield w
    w.shutdown()


def storage_mapping(tensor: torch.Tensor) -> str:
    """The /proc/self/maps line of the mapping that holds `tensor`'s storage."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line
    raise AssertionError(f"no mapping holds {address:#x}")


def torch_shm_names() -> set[str]:
    """Names in /dev/shm this process could have left: torch's are torch_<pid>_..."""
    return {name for name in os.listdir("/dev/shm") if f"_{os.getpid()}_" in name or "lmcache" in name}


def round_trip(url: str, worker: LMCacheMPWorkerAdapter, caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """STORE the STORED blocks, LOOKUP, RETRIEVE them into the RETRIEVED blocks; the pages there."""
    hashes = block_hashes(list(range(len(STORED) * BLOCK)))
    worker.submit_store_request("s", LoadStoreOp(STORED, block_hashes=hashes), None)
    wait_done(worker, "s", retrieve=False)
    scheduler = LMCacheMPSchedulerAdapter(url, None, "m", 1, 0, BLOCK)
    try:
        scheduler.maybe_submit_lookup_request("r", block_hashes=hashes)
        while scheduler.check_lookup_result("r") is None:
            pass
        worker.submit_retrieve_request("r", LoadStoreOp(RETRIEVED, block_hashes=hashes), None)
        wait_done(worker, "r", retrieve=True)
        assert worker.take_failed_retrieves() == {}
    finally:
        scheduler.shutdown()
    return pages(caches, "CPU_ATTN", SHAPE, RETRIEVED)


def register_and_check(daemon: DaemonProcess, worker: LMCacheMPWorkerAdapter,
                       caches: dict[str, torch.Tensor]) -> None:
    """Register; the tensors, a view made before, and their bytes survive; a write through that
    view after registering reaches the daemon, and the daemon's RETRIEVE reaches the tensors."""
    tensors = dict(caches)
    before = {name: t.clone() for name, t in caches.items()}
    first = next(iter(caches.values()))
    old_view = first[STORED[0]:STORED[-1] + 1]  # a view made before registration
    names_before = torch_shm_names()

    worker.register_kv_caches(caches, "CPU_ATTN")

    assert status(daemon.url).registered_instances == [worker.instance_id]
    assert all(caches[name] is tensors[name] for name in tensors)  # the very same objects
    assert all(t.untyped_storage().is_shared() for t in caches.values())
    for name, t in caches.items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name
    assert old_view.data_ptr() == first.data_ptr()  # still a view of the cache, not of old memory
    # A write through the old view, after registration, is what the daemon stores.
    pattern = torch.randn(old_view.shape, generator=torch.Generator().manual_seed(9)).to(old_view.dtype)
    old_view.copy_(pattern)
    retrieved = round_trip(daemon.url, worker, caches)
    stored = pages(caches, "CPU_ATTN", SHAPE, STORED)
    assert torch.equal(retrieved.view(torch.uint8), stored.view(torch.uint8))
    assert torch.equal(retrieved[0].view(torch.uint8), pattern.view(torch.uint8))
    assert torch_shm_names() == names_before  # nothing named left in /dev/shm


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_registration_moves_the_cache_into_a_memfd_in_place(daemon: DaemonProcess,
                                                             worker: LMCacheMPWorkerAdapter,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1)
    with caplog.at_level(logging.INFO, logger=MOVE_LOG):
        register_and_check(daemon, worker, caches)
    # The memfd path ran (torch's would map /dev/shm/torch_...): one line with size and time.
    assert "/memfd:lmcache-mp-kv (deleted)" in storage_mapping(next(iter(caches.values())))
    moved = [r.getMessage() for r in caplog.records if "moved into shared memory" in r.getMessage()]
    assert len(moved) == 1 and moved[0].endswith(f"{shm_move.FAST_PATH})"), moved


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize("refused", ["memfd_create", "madvise midway"])
def test_fallback_to_torch_when_the_memfd_path_is_refused(daemon: DaemonProcess,
                                                          worker: LMCacheMPWorkerAdapter,
                                                          caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          refused: str) -> None:
    """The kernel refuses (ENOSYS from memfd_create, as under a seccomp filter; or ENOMEM
    halfway through the move, after steps were copied and released from the old memory): the
    storage is left as it was, torch moves it (vLLM's tensors keep their bytes), and the reason
    is logged once. The daemon refuses that memory, which its worker could shrink under it: the
    worker serves without the cache."""
    real_madvise = shm_move._madvise
    populates, releases = [], []

    def madvise(address: int, nbytes: int, advice: int) -> None:
        if advice == shm_move.MADV_POPULATE_WRITE:
            populates.append(address)
            if len(populates) > 4:
                raise OSError(errno.ENOMEM, "refused by the test")
        else:
            releases.append(address)
        real_madvise(address, nbytes, advice)

    def no_memfd(*_args: object) -> None:
        raise OSError(errno.ENOSYS, "refused by the test")

    if refused == "memfd_create":
        monkeypatch.setattr(os, "memfd_create", no_memfd)
    else:
        monkeypatch.setattr(shm_move, "_madvise", madvise)
        monkeypatch.setattr(shm_move, "STEP_BYTES", 64 << 10)  # 8 steps for these 512 KiB
    monkeypatch.setattr(shm_move, "_fallback_logged", False)
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=2)
    before = {name: t.clone() for name, t in caches.items()}
    with caplog.at_level(logging.INFO, logger=MOVE_LOG), pytest.raises(ServerError) as refusal:
        worker.register_kv_caches(caches, "CPU_ATTN")
    assert refusal.value.code is ErrorCode.INVALID_ARGUMENT and "can shrink" in refusal.value.message
    assert status(daemon.url).registered_instances == []
    assert all(t.untyped_storage().is_shared() for t in caches.values())
    assert all(torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)) for name, t in caches.items())
    assert "/memfd:" not in storage_mapping(next(iter(caches.values())))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("memfd path is unavailable" in m and "refused by the test" in m for m in messages) == 1
    assert sum(m.endswith(f"{shm_move.TORCH_PATH})") for m in messages) == 1
    if refused == "madvise midway":
        assert releases, "no step was released before the failure: the case tests nothing"


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_kernel_without_populate_still_moves_into_a_sealed_memfd(daemon: DaemonProcess,
                                                                   worker: LMCacheMPWorkerAdapter,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14, MADV_POPULATE_WRITE is EINVAL: the move faults pages in as it writes."""
    real_madvise = shm_move._madvise

    def madvise(address: int, nbytes: int, advice: int) -> None:
        if advice == shm_move.MADV_POPULATE_WRITE:
            raise OSError(errno.EINVAL, "refused by the test")
        real_madvise(address, nbytes, advice)

    monkeypatch.setattr(shm_move, "_madvise", madvise)
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=3)
    register_and_check(daemon, worker, caches)
    assert "/memfd:lmcache-mp-kv (deleted)" in storage_mapping(next(iter(caches.values())))


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_registered_cache_cannot_shrink_under_the_daemon(daemon: DaemonProcess,
                                                           worker: LMCacheMPWorkerAdapter) -> None:
    """A worker that cut its shared-memory file short (one ftruncate) then sent a
    STORE killed the daemon with SIGBUS. The memfd is sealed against shrinking: the ftruncate
    fails, and the daemon serves on."""
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=4)
    worker.register_kv_caches(caches, "CPU_ATTN")
    fd, _ = next(iter(caches.values())).untyped_storage()._share_fd_cpu_()
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    retrieved = round_trip(daemon.url, worker, caches)
    stored = pages(caches, "CPU_ATTN", SHAPE, STORED)
    assert torch.equal(retrieved.view(torch.uint8), stored.view(torch.uint8))
    assert daemon.proc.poll() is None


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_cache_allocated_in_shared_memory_registers_without_moving(daemon: DaemonProcess,
                                                                   worker: LMCacheMPWorkerAdapter,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """What the connector makes vLLM do: one `torch.zeros` inside AllocateInSharedMemory, the layers
    views of it. Registering then hands over the memfd: the memory stays where it is."""
    with caplog.at_level(logging.INFO, logger=MOVE_LOG):
        with AllocateInSharedMemory():
            buffer = torch.zeros(LAYERS * NUM_BLOCKS * 2 * BLOCK * 64 * 2, dtype=torch.int8,
                                 device=torch.device("cpu"))
            other = torch.ones(4)  # not a torch.zeros: allocated as usual
        assert buffer.untyped_storage().is_shared() and not other.untyped_storage().is_shared()
        assert not buffer.any()
        layers = buffer.view(torch.bfloat16).view(LAYERS, *SHAPE)
        layers.copy_(torch.randn(layers.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
        caches = {f"model.layers.{i}.self_attn.attn": layers[i] for i in range(LAYERS)}
        address = buffer.data_ptr()
        register_and_check(daemon, worker, caches)
    assert buffer.data_ptr() == address  # nothing moved
    assert "/memfd:lmcache-mp-kv (deleted)" in storage_mapping(buffer)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("allocated in shared memory" in m for m in messages) == 1
    assert not any("moved into shared memory" in m for m in messages)


def test_allocation_mode_passes_other_zeros_through() -> None:
    """Only plain CPU `torch.zeros` are allocated in shared memory; an empty one, or one with
    arguments the mode does not handle, is torch's as usual."""
    with AllocateInSharedMemory():
        shaped = torch.zeros((2, 3), dtype=torch.float16)
        empty = torch.zeros(0)
        with_grad = torch.zeros(5, requires_grad=True)
    assert shaped.shape == (2, 3) and shaped.dtype == torch.float16 and shaped.untyped_storage().is_shared()
    assert not empty.untyped_storage().is_shared() and not with_grad.untyped_storage().is_shared()
    assert with_grad.requires_grad



def test_large_move_logs_progress(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Caches from PROGRESS_FROM_BYTES up say how far they are while they move (made small here)."""
    monkeypatch.setattr(shm_move, "STEP_BYTES", 64 << 10)
    monkeypatch.setattr(shm_move, "PROGRESS_FROM_BYTES", 1 << 20)
    monkeypatch.setattr(shm_move, "PROGRESS_EVERY_S", 0.0)
    data = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    before = data.clone()
    with caplog.at_level(logging.INFO, logger=MOVE_LOG):
        assert shm_move.move_to_shared_memory(data.untyped_storage()) == shm_move.FAST_PATH
    assert torch.equal(data, before)
    progress = [r.getMessage() for r in caplog.records if "GiB in shared memory" in r.getMessage()]
    assert len(progress) == 15, progress  # after each of 16 steps but the last
