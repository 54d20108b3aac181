from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_mp.launcher import DaemonProcess, start_daemon
from lmcache_mp.mq import MessageQueueClient


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon_args(*args): extra `lmcache-mp serve` arguments")
