"""Daemon start: time to the first PING answer and to a fully prepared pool, per pool size, next to
a same-run baseline (memset of a freshly mapped region of the same size).

    python scripts/bench_startup.py [--sizes-gb 1 8]

Sizes that do not fit in the available memory (with 4 GiB to spare) are skipped, saying so.
Asserts what it measures: from 4 GiB up, the daemon answered PING before its pool was ready.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import signal
import tempfile
import time
from pathlib import Path

from lmcache_mp.launcher import daemon_status, start_daemon
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType

SPARE_GIB = 4
ASSERT_FROM_GB = 4  # pools this large must still be preparing at the first PING


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def memset_gbps(nbytes: int) -> float:
    """The baseline: fault in a fresh anonymous mapping by writing it (memset), GB/s."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    start = time.perf_counter()
    ctypes.memset(address, 0, nbytes)
    elapsed = time.perf_counter() - start
    del address
    mapping.close()
    return nbytes / elapsed / 1e9


def measure(size_gb: float) -> tuple[float, float]:
    """(seconds to the first PING answer, seconds to a ready pool), from the process start."""
    tmp = Path(tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp"))
    daemon = start_daemon(tmp, "--l1-size-gb", str(size_gb), pool_ready=False, ready_timeout=600)
    try:
        client = MessageQueueClient(daemon.url)
        try:
            assert client.submit(RequestType.PING, [1]).result(10) == 1
        finally:
            client.close()
        ping_s = time.monotonic() - daemon.started_at
        # A small pool may be ready by then (1 GiB takes ~0.2 s at memory speed); a large one never.
        assert size_gb < ASSERT_FROM_GB or not daemon_status(daemon.url).pool_ready, \
            "the pool was ready before PING was answered"
        while not daemon_status(daemon.url).pool_ready:
            time.sleep(0.01)
        return ping_s, time.monotonic() - daemon.started_at
    finally:
        daemon.stop(signal.SIGTERM, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 8], help="pool sizes in GiB")
    args = parser.parse_args()
    print("| pool | first PING | pool ready | prepared GB/s | memset baseline GB/s |")
    print("|---|---|---|---|---|")
    for size in args.sizes_gb:
        if size + SPARE_GIB > available_gib():
            print(f"| {size:g} GiB | skipped: {available_gib():.1f} GiB available, "
                  f"needs {size + SPARE_GIB:g} | | | |")
            continue
        ping_s, ready_s = measure(size)
        baseline = memset_gbps(int(size * 2**30))
        gbps = size * 2**30 / (ready_s - ping_s) / 1e9  # lower bound: preparing began before PING
        print(f"| {size:g} GiB | {ping_s:.2f} s | {ready_s:.2f} s | {gbps:.2f} | {baseline:.2f} |")


if __name__ == "__main__":
    main()
