from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.launcher import DaemonProcess, start_daemon
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.pool_location import PoolFileError, default_pool_file, discard_pool_file
from tests.helpers import BLOCK, LAYERS, SHAPE
from tests.kv_worker import make_caches
from vllm_adapter import LMCacheMPWorkerAdapter


@pytest.fixture(scope="session", autouse=True)
def no_pool_file_left() -> Iterator[None]:
    """Daemons started outside the launcher (`lmcache-mp serve` run directly) keep their pool
    files, as a restart needs: the ones made during the session go when it ends (those a live
    daemon holds stay)."""
    directory = default_pool_file([]).parent
    before = set(directory.glob("pool-*"))
    yield
    for path in set(directory.glob("pool-*")) - before:
        with contextlib.suppress(PoolFileError):
            discard_pool_file(path)


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    import tempfile

    return Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))


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
