"""The real daemon, whose STOREs meet the FatalError that a GPU copy raises when CUDA fails (a
sticky error, or copies that never complete): no CPU can make that happen, so the store lane's
operation raises it here, where `transfer/cuda.py` would. Everything around it is the daemon's own.

    python -m tests.support.fatal_daemon PYTHON -m lmcache_mp.cli serve ARGS...

(the command `launcher.start_daemon` runs, under `command_prefix`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from lmcache_mp.cli import main as cli
from lmcache_mp.errors import FatalError
from lmcache_mp.transfer.context import Copies, Lane, TransferContext

MESSAGE = "a copy on cuda:0 failed: CUDA error: an illegal memory access was encountered"
_operation = TransferContext.operation


def _failing(self: TransferContext, block_ids: list[int], event_handle: bytes, lane: Lane,
             chunk_blocks: list[int] | None = None) -> Iterator[Copies]:
    if lane is Lane.STORE:
        raise FatalError(MESSAGE)
    return _operation(self, block_ids, event_handle, lane, chunk_blocks)


if __name__ == "__main__":
    TransferContext.operation = _failing  # type: ignore[method-assign,assignment]
    sys.exit(cli.main(sys.argv[sys.argv.index("lmcache_mp.cli") + 1:]))
