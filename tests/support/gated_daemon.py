"""The real daemon, whose copies can be held in the middle of a STORE or a RETRIEVE: while the file
`store` (resp. `load`) exists in the folder named first on the command line, each chunk's gather
(resp. scatter) waits before it copies (polled every 5 ms, at most 120 s). A test then holds a
transfer copying for as long as it needs, instead of betting that a large copy outlasts what it
sends meanwhile, which a loaded machine can lose. Everything else is the daemon's own.

    python -m tests.support.gated_daemon GATES PYTHON -m lmcache_mp.cli serve ARGS...

(the command `launcher.start_daemon` runs, under `command_prefix`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_mp.cli import main as cli
from lmcache_mp.transfer.context import Copies

HOLD_AT_MOST_S = 120.0


def _held(gate: Path, copy: Callable[..., None]) -> Callable[..., None]:
    def held(self: Copies, *args: Any) -> None:
        deadline = time.monotonic() + HOLD_AT_MOST_S
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        copy(self, *args)
    return held


if __name__ == "__main__":
    gates = Path(sys.argv[1])
    Copies.gather = _held(gates / "store", Copies.gather)  # type: ignore[method-assign]
    Copies.scatter = _held(gates / "load", Copies.scatter)  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[sys.argv.index("lmcache_mp.cli") + 1:]))
