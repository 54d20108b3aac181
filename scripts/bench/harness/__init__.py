"""What every benchmark shares: its command line (--out, --quick), the figure frame (a headless
matplotlib figure, laid out and saved), its ending (a MET/MISS line per target, its figures as JSON,
its plot as PNG), percentiles, and the memory baselines (the memory available; a fresh mapping
written by memset).

The benchmarks run as `python scripts/bench/bench_NAME.py`: Python puts scripts/bench/ first on
the module path, so `harness` and the benchmarks that others build on (bench_data_plane,
bench_serving) import by name; `lmcache_mp` and `vllm_adapter` come from the installed checkout
(scripts/setup.sh). The vLLM engines' children: `harness.engines`; vLLM's API server:
`harness.api_server`."""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache_mp.config import available_memory_bytes

REPO = Path(__file__).resolve().parents[3]


def parser(doc: str, quick: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's command line: described by its docstring's first paragraph, with --out (where
    its JSON, PNG and logs go) and, where `quick` says what the smoke run does, --quick.
    `kwargs`: more of `argparse.ArgumentParser`'s (a formatter class, an epilog)."""
    description = " ".join(doc.strip().split("\n\n")[0].split())
    command = argparse.ArgumentParser(description=description, **kwargs)
    command.add_argument("--out", type=Path, default=Path("bench-out"),
                         help="where to write the JSON, PNG and logs")
    if quick is not None:
        command.add_argument("--quick", action="store_true", help=quick)
    return command


def parse(command: argparse.ArgumentParser) -> argparse.Namespace:
    """The options, with --out made."""
    options = command.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    return options


@contextmanager
def figure(path: Path, rows: int = 1, cols: int = 1, *, title: str | None = None, dpi: int = 120,
           **subplots: Any) -> Iterator[Any]:
    """The axes of a headless figure of `rows` x `cols` (`subplots`: `plt.subplots`' keywords, a
    figsize, squeeze=False), drawn in the block; then titled, laid out and written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, **subplots)
    try:
        yield axes
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def finish(out: Path, stem: str, checks: dict[str, bool], figures: dict, draw: Callable[[Path], None],
           note: str = "") -> None:
    """Print the verdicts, write OUT/STEM.json (`figures`) and OUT/STEM.png (`draw(path)`)."""
    print()
    for name, ok in checks.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    (out / f"{stem}.json").write_text(json.dumps(figures, indent=2))
    draw(out / f"{stem}.png")
    print(f"\nwrote {out / f'{stem}.png'} and {out / f'{stem}.json'}{note}")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between the closest ranks."""
    if not values:
        return float("nan")
    ordered, pos = sorted(values), (len(values) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A directory of the run's own under /tmp (short: a Unix socket's path must stay under ~107
    bytes), removed with all it holds when the block ends, however it ends."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def available_gib() -> float:
    return (available_memory_bytes() or 0) / 2**30


def memset_s(nbytes: int) -> float:
    """The memory baseline: seconds to fault in a fresh anonymous mapping by writing it (memset)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    start = time.perf_counter()
    ctypes.memset(address, 0, nbytes)
    elapsed = time.perf_counter() - start
    del address
    mapping.close()
    return elapsed
