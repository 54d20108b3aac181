"""The pool file against its neighbours, through real daemons: a second daemon never removes or
replaces a live daemon's file (whatever its flags), and the checksum child never imports from the
daemon's working directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.testing.blocks import CHUNK
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import chunk_hashes, count_lookup, status, store, wait_for_status

ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


def test_a_second_daemon_never_removes_a_live_daemons_pool_file(daemons, worker_for, pool_dir: Path,
                                                                 short_tmp: Path) -> None:
    path = pool_dir / "pool"
    first: DaemonProcess = daemons(*ARGS, "--pool-file", str(path))
    worker = worker_for(first.url)
    hashes = chunk_hashes(list(range(3 * CHUNK)))
    assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 3
    inode = path.stat().st_ino
    for name, extra in (("fresh", ("--fresh-pool",)), ("bigger", ("--l1-size-gb", "0.06"))):
        # It fails to start, naming the daemon that holds the file.
        with pytest.raises(RuntimeError, match=rf"in use by another daemon, pid {first.proc.pid} "):
            daemons(*ARGS, "--pool-file", str(path), *extra, url=f"ipc://{short_tmp / name}.sock")
        assert path.stat().st_ino == inode, f"a second daemon ({name}) replaced the live daemon's file"
        assert count_lookup(worker.mq_client, hashes) == 3
    # The file still holds the chunks: the next daemon started on it serves every one.
    assert first.stop(keep_pool=True) == 0
    again: DaemonProcess = daemons(*ARGS, "--pool-file", str(path))
    report = wait_for_status(again.url, lambda r: r.pool_unverified == 0, "adopted chunks verified")
    assert (report.pool_adopted_chunks, report.pool_dropped_total) == (3, 0)


# Imported by a process that starts in the directory holding it, instead of the real xxhash.
PLANTED_XXHASH = """
from pathlib import Path
Path({marker!r}).write_text("imported from the daemon's working directory")
raise ImportError("a planted module")
"""

# The daemon, with no directory of its own choosing on its path but its installation's (`-P`: not
# the working directory, as `python -m` would have it); the launcher's command line follows.
SAFE_PATH_DAEMON = ("import sys; from lmcache_mp.cli.main import main; "
                    "sys.exit(main(sys.argv[sys.argv.index('lmcache_mp.cli') + 1:]))")


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_checksum_child_imports_nothing_from_the_daemons_working_directory(
        daemons, worker_for, pool_dir: Path, short_tmp: Path) -> None:
    """A daemon started in a directory another user could write in (/tmp): an `xxhash.py` there
    is never run while the daemon seals chunks in its checksum child."""
    planted = short_tmp / "cwd"
    planted.mkdir()
    marker = short_tmp / "planted-module-ran"
    (planted / "xxhash.py").write_text(PLANTED_XXHASH.format(marker=str(marker)))
    daemon: DaemonProcess = daemons(*ARGS, "--pool-file", str(pool_dir / "pool"), cwd=planted,
                                    command_prefix=[sys.executable, "-P", "-c", SAFE_PATH_DAEMON])
    worker = worker_for(daemon.url)
    hashes = chunk_hashes(list(range(4 * CHUNK)))
    assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 4
    wait_for_status(daemon.url, lambda r: r.pool_unsealed == 0, "every chunk sealed")
    assert not marker.exists(), "the checksum child imported xxhash from the daemon's working directory"
    # ... and the child that sealed them is alive: it hashed them, not the daemon's own thread.
    sealers = [pid for pid in _children(daemon.proc.pid) if "seal_child" in _cmdline(pid)]
    assert len(sealers) == 1, [_cmdline(pid) for pid in _children(daemon.proc.pid)]
    assert "sealing in the daemon's own thread" not in daemon.log(), daemon.log()
    assert status(daemon.url).pool_unsealed == 0
