"""The checksum child itself (`pool/seal_process.py` starts it and says why it exists).

Run as a script, by its absolute path, in isolated mode: `python -I pool/seal_child.py FD IMPORT_ROOT`.
Its import path is then the interpreter's own (not the daemon's working directory, nor this
file's), plus IMPORT_ROOT, the directory the daemon's xxhash came from; it imports nothing else
but the standard library. So nothing here imports from the project: the daemon's side takes the
wire format from here.

    request  u64 file offset, u64 length, u32 head length, then the head
    answer   u64 xxh3_64 of the head followed by the file's bytes [offset, offset + length):
             `chunk_format.checksum(head, payload)`
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

REQUEST = struct.Struct("<QQI")  # file offset, length, head length
ANSWER = struct.Struct("<Q")


def serve(fd: int, stdin: IO[bytes], stdout: IO[bytes], xxh3_64: Callable[[bytes], Any]) -> int:
    """Answer requests about the file open on `fd` until the end of `stdin`."""
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapping:
        view = memoryview(mapping)
        try:
            while True:
                request = stdin.read(REQUEST.size)
                if len(request) < REQUEST.size:
                    return 0  # the daemon closed its end, or died
                offset, length, head_len = REQUEST.unpack(request)
                head = stdin.read(head_len)
                if len(head) < head_len or offset + length > size:
                    return 1  # malformed: the daemon sees the child gone and checksums itself
                digest = xxh3_64(head)
                digest.update(view[offset:offset + length])  # xxhash lets go of the GIL
                stdout.write(ANSWER.pack(digest.intdigest()))
                stdout.flush()
        except BrokenPipeError:
            return 0
        finally:
            view.release()


def main(argv: list[str]) -> int:
    sys.path.insert(0, argv[2])
    import xxhash

    return serve(int(argv[1]), sys.stdin.buffer, sys.stdout.buffer, xxhash.xxh3_64)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
