"""Pool files of stopped daemons give their memory back, through real daemons: a start removes the
stale ones of its directory (pool_file_ttl_s), never a held, a recent or a foreign file; a start
refused for memory names them; `lmcache-mp pools` lists and removes them; the launcher removes
only the files its own daemons made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lmcache_mp.storage.pool.location import default_pool_file
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.servers import command
from tests.support.helpers import wait_for

ARGS = ("--l1-size-gb", "0.05")
HOUR = 3600.0


def _backdate(path: Path, seconds: float) -> None:
    """As if no daemon used the file for `seconds`."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def _start(daemons, path: Path, *args: str) -> DaemonProcess:
    """A daemon whose pool file is `path`, on an endpoint named after it (several run at once)."""
    return daemons(*ARGS, "--pool-file", str(path), *args, url=f"ipc://{path}.sock")


def _stopped(daemons, path: Path) -> None:
    """A daemon's pool file at `path`, left behind as a stopped daemon leaves it."""
    assert _start(daemons, path).stop(keep_pool=True) == 0 and path.exists()


def test_a_start_removes_the_stale_pool_files_of_stopped_daemons_and_no_other(daemons,
                                                                             pool_dir: Path) -> None:
    stale, fresh, held = pool_dir / "stale", pool_dir / "fresh", pool_dir / "held"
    holder = _start(daemons, held)
    _stopped(daemons, stale)
    _stopped(daemons, fresh)
    _backdate(stale, 2 * HOUR)  # each start removes the stale files of its directory: last
    _backdate(held, 2 * HOUR)  # held: never removed, however old
    other = pool_dir / "notes"  # not a pool file: never removed
    other.write_bytes(b"x" * 4096)
    _backdate(other, 2 * HOUR)

    started = _start(daemons, pool_dir / "next", "--pool-file-ttl-s", "600")
    assert not stale.exists()
    assert fresh.exists() and held.exists() and other.exists()
    assert f"pool file {stale} of a stopped daemon removed" in started.log(), started.log()

    # With a TTL of 0, every stopped daemon's file goes; the held one stays, and its daemon serves.
    started = _start(daemons, pool_dir / "last", "--pool-file-ttl-s", "0")
    assert not fresh.exists() and held.exists() and other.exists()
    assert holder.proc.poll() is None and f"pool file {fresh} of a stopped daemon removed" in started.log()


def test_a_start_refused_for_memory_names_the_stopped_daemons_pool_files(daemons, pool_dir: Path,
                                                                       short_tmp: Path) -> None:
    left = pool_dir / "left"
    _stopped(daemons, left)
    out = subprocess.run([*command(), "serve", "--listen", f"ipc://{short_tmp / 'big.sock'}",
                          "--pool-file", str(pool_dir / "big"), "--l1-size-gb", "100000"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "the machine has only" in out.stderr and f"{left} (0.05 GiB" in out.stderr, out.stderr
    assert f"lmcache-mp pools --dir {pool_dir} --remove-stopped" in out.stderr, out.stderr
    assert left.exists() and not (pool_dir / "big").exists()


def _pools(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*command(), "pools", *args], capture_output=True, text=True, timeout=60)


def test_pools_lists_the_pool_files_with_their_holders_and_removes_the_stopped_ones(
        daemons, pool_dir: Path) -> None:
    stopped, held = pool_dir / "stopped", pool_dir / "held"
    holder = _start(daemons, held)
    _stopped(daemons, stopped)
    _backdate(stopped, 2 * HOUR)
    listed = _pools("--dir", str(pool_dir))
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert set(lines) == {"held", "stopped"}, listed.stdout
    assert f"pid {holder.proc.pid} " in lines["held"] and "0.05 GiB" in lines["held"], listed.stdout
    assert "stopped" in lines["stopped"] and "unused 2.0 h" in lines["stopped"], listed.stdout

    removed = _pools("--dir", str(pool_dir), "--remove-stopped")
    assert removed.returncode == 0 and f"removed {stopped}" in removed.stdout, removed
    assert not stopped.exists() and held.exists() and holder.proc.poll() is None


def test_the_launcher_removes_only_the_pool_files_its_daemons_made(daemons, pool_dir: Path,
                                                                   short_tmp: Path) -> None:
    # A daemon the launcher did not start made this one, and crashed: its restart adopts it.
    theirs = pool_dir / "theirs"
    log = short_tmp / "theirs.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen",
                                 f"ipc://{short_tmp / 'theirs.sock'}", "--pool-file", str(theirs), *ARGS],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "ready (node-local)" in log.read_text() or proc.poll() is not None, "it served")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert theirs.exists(), log.read_text()
    restart: DaemonProcess = daemons(*ARGS, "--pool-file", str(theirs))
    assert restart.stop() == 0 and theirs.exists()
    restart.discard_pool()
    assert theirs.exists()

    ours: DaemonProcess = daemons(*ARGS)
    assert ours.pool_path is not None and ours.pool_path.exists()
    # Not among the files of the daemons the user runs (whose pool_file_ttl_s a test must not apply).
    assert ours.pool_path.parent != default_pool_file([]).parent
    assert ours.stop() == 0 and not ours.pool_path.exists()
