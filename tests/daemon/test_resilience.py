"""A second daemon on a live daemon's socket, and replies at shutdown; real daemons."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode, RequestType, StatusReport, StoreResult
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import status
from vllm_adapter import LMCacheMPWorkerAdapter

SMALL_POOL = ("--l1-size-gb", "0.05")


def _serve(tmp: Path, url: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `lmcache-mp serve` to its exit (it must exit on its own within `timeout`)."""
    env = dict(os.environ, LMCACHE_MP_RUNTIME_DIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen", url, *SMALL_POOL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"a second daemon on {url} kept running:\n{out}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_socket_second_daemon_refuses_a_live_daemons_path(short_tmp: Path, daemons: Callable,
                                                          worker_for: Callable) -> None:
    first: DaemonProcess = daemons(*SMALL_POOL)
    sock, attach = first.socket_path, first.socket_path.with_name(first.socket_path.name + ".attach")
    inodes = (sock.stat().st_ino, attach.stat().st_ino)

    second = _serve(short_tmp, first.url)
    assert second.returncode != 0, second.stdout
    errors = [line for line in second.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "another lmcache-mp daemon is serving" in errors[0], second.stdout
    assert str(sock) in errors[0] and "Traceback" not in second.stdout

    # The first daemon keeps both sockets, answers, and still takes registrations.
    assert (sock.stat().st_ino, attach.stat().st_ino) == inodes
    assert status(first.url).endpoints == [first.url]
    worker_for(first.url)
    assert len(status(first.url).registered_instances) == 1
    assert "Traceback" not in first.log(), first.log()


def test_socket_stale_paths_of_a_killed_daemon_are_replaced(daemons: Callable, worker_for: Callable) -> None:
    first: DaemonProcess = daemons(*SMALL_POOL)
    first.stop(signal.SIGKILL)
    sock = first.socket_path
    attach = sock.with_name(sock.name + ".attach")
    assert sock.exists() and attach.exists()  # left behind: nothing removed them

    second: DaemonProcess = daemons(*SMALL_POOL, url=first.url)
    assert status(second.url).endpoints == [first.url]
    worker_for(second.url)  # the attach socket is the new daemon's
    assert len(status(second.url).registered_instances) == 1
    assert second.stop() == 0
    assert not sock.exists() and not attach.exists()


def test_socket_claimed_path_is_refused_before_any_socket_exists(short_tmp: Path) -> None:
    # A daemon that is starting holds the path's lock file before its socket exists: a second
    # one started at that moment must not pass the (socket) liveness probe and bind too.
    sock = short_tmp / "starting.sock"
    with open(f"{sock}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second = _serve(short_tmp, f"ipc://{sock}")
    assert second.returncode != 0, second.stdout
    assert "another lmcache-mp daemon is serving" in second.stdout, second.stdout
    assert not sock.exists()


def test_shutdown_answers_every_request_in_flight_or_queued(daemons: Callable) -> None:
    # One worker thread and 128 MiB STOREs (each keeps it busy for tens of ms, the pool evicts
    # to make room): at SIGTERM one STORE is running and the rest wait in the queue.
    daemon: DaemonProcess = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", "0.3", "--max-workers", "1")
    blocks = 1024
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches([blocks, 8, BLOCK, 256], torch.bfloat16, LAYERS, seed=3),
                                  "CPU_ATTN")
        c = worker.mq_client
        futures = []
        for i in range(8):
            hashes = block_hashes([i * 10**6 + t for t in range(blocks * BLOCK)])
            keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h) for h in hashes[1::2]]
            futures.append(c.submit(RequestType.STORE, [keys, worker.instance_id, list(range(blocks)), b""]))
            futures.append(c.submit(RequestType.UNREGISTER_KV_CACHE, [10**6 + i]))
        # Same connection, so it is read after every request above.
        report: StatusReport = c.submit(RequestType.STATUS, []).result(10)
        assert report.requests_in_flight > 1, report  # some run, the rest are queued
        daemon.proc.send_signal(signal.SIGTERM)

        answered = []
        for f in futures:
            assert f.wait(30), f"{f.request_type.name} got no reply"  # none times out
            err = f.exception()
            if err is None:
                answered.append(f.result())
            else:
                assert isinstance(err, ServerError) and err.code is ErrorCode.SHUTTING_DOWN, err
        assert any(isinstance(r, StoreResult) for r in answered)  # the running STORE finished
        assert len(answered) < len(futures)  # and the queued ones were refused
        assert daemon.proc.wait(30) == 0
    finally:
        worker.shutdown()
    log = daemon.log()
    assert "Traceback" not in log and "stopped" in log, log
