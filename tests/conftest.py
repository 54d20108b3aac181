from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.testing.blocks import BLOCK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess, discard_pools, start_daemon
from vllm_adapter import LMCacheMPWorkerAdapter


@pytest.fixture(scope="session", autouse=True)
def no_pool_file_left() -> Iterator[None]:
    """The pool files the tests' daemons made and kept go when the session ends (the launcher's:
    those a live daemon holds stay), and only those: a pool file of a daemon the tests did not
    start, say one that crashed and waits for its restart, is never touched."""
    yield
    discard_pools()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory of this test's own under /tmp, removed after it: Unix socket paths are limited
    to ~107 bytes, and pytest's tmp_path can be longer."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool_dir() -> Iterator[Path]:
    """A pool file directory of this test's own (0700, on /dev/shm), removed with all it holds:
    what a daemon started here finds or removes in its directory is this test's alone."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="lmc-pools-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def daemon(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    marker = request.node.get_closest_marker("daemon_args")
    args = marker.args if marker else ()
    proc = start_daemon(short_tmp, *args)
    yield proc
    if proc.proc.poll() is None:
        proc.stop(signal.SIGTERM)
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[MessageQueueClient]:
    c = MessageQueueClient(daemon.url, request_timeout_s=30)
    c.handshake("tests")
    yield c
    c.close()


@pytest.fixture
def worker_for(request: pytest.FixtureRequest) -> Iterator:
    """worker_for(url, layout="CPU_ATTN", seed=1): a registered worker adapter, shut down after."""
    made: list[LMCacheMPWorkerAdapter] = []

    def make(url: str, layout: str = "CPU_ATTN", seed: int = 1) -> LMCacheMPWorkerAdapter:
        worker = LMCacheMPWorkerAdapter(url, None, "m", 1, 0, BLOCK)
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=seed), layout)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


@pytest.fixture
def daemons(short_tmp: Path) -> Iterator:
    """daemons(*args, **kw): start_daemon in short_tmp; any still running at the end is killed."""
    started: list[DaemonProcess] = []

    def start(*args: str, **kw) -> DaemonProcess:
        started.append(start_daemon(short_tmp, *args, **kw))
        return started[-1]

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.stop(signal.SIGKILL)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon_args(*args): extra `lmcache-mp serve` arguments")
