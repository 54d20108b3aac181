"""What a force-killed vLLM engine leaves in /dev/shm, removed by the test or benchmark that killed it.

An engine that exits cleanly unlinks its shared memory itself; one killed with SIGKILL (a test that
fails, or gives up on it) leaves its TP communicator's segments (`vllm_dist_*`), torch's
(`psm_*`) and Python's semaphores (`sem.mp-*`). `ShmWatch` remembers what /dev/shm held when
its engine started and removes only what appeared since, has one of those names, and no live
process has mapped or open: an engine still running beside it keeps its own.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
VLLM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")


def _names() -> set[str]:
    try:
        return {entry.name for entry in SHM.iterdir()}
    except OSError:
        return set()


def _in_use() -> set[str]:
    """Names under /dev/shm that some process we can see maps or holds open."""
    used: set[str] = set()
    prefix = f"{SHM}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    used.add(path[len(prefix):].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:
            continue  # it exited, or is not ours to read
    return used


class ShmWatch:
    def __init__(self) -> None:
        self.before = _names()

    def remove_leftovers(self) -> list[str]:
        """Removes what appeared since this watch began, by vLLM's names, that nobody uses."""
        new = {name for name in _names() - self.before if name.startswith(VLLM_PREFIXES)}
        removed = []
        for name in sorted(new - _in_use()):
            try:
                (SHM / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
        return removed
