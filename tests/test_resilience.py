"""Issue 10: a second daemon on a live daemon's socket, and replies at shutdown; real daemons."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from lmcache_mp.launcher import DaemonProcess
from tests.helpers import status

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
    assert len(errors) == 1 and "another lmcache-mp daemon is serving it" in errors[0], second.stdout
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
