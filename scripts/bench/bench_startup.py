"""Daemon start: time to the first PING, HELLO and STATUS answers, to a built engine and to a fully
prepared pool, per pool size, next to same-run baselines: a fresh interpreter's
`import zmq, msgspec` (the floor of any Python daemon on this stack) and `import torch` (what the
daemon used to wait for before it answered), and a memset of a freshly mapped region of the pool's
size (how fast memory can be prepared at all). Then the GIL probe: the longest wait of a thread
that sleeps 1 ms in a loop while another imports torch, plainly or after the daemon's preload of
torch's native libraries (`daemon.preload_torch_libraries`), next to a thread that only sleeps.

    python scripts/bench/bench_startup.py [--sizes-gb 1 8 16] [--repeats 1] [--gil-rounds 3]

Sizes that do not fit in the available memory (with 4 GiB to spare) are skipped, saying so.
Asserts what it measures: the first PING was answered while the engine was still being built, and
from 4 GiB up before the pool was ready. The target is a first PING within 2 s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import available_gib, memset_s, scratch

from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import PHASE_SERVING, PHASE_STARTING, RequestType

SPARE_GIB = 4
ASSERT_FROM_GB = 4  # pools this large must still be preparing at the first PING
TARGET_FIRST_PING_S = 2.0
PING_EVERY_S = 0.005  # while the engine is built: how long a PING waits behind the import




def python_s(code: str) -> float:
    """Seconds a fresh interpreter takes to run `code` and exit."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - start


# A thread imports torch (after `preload`, when given) while the main thread sleeps 1 ms in a loop;
# prints the main thread's longest wait, in seconds: how long a PING would wait behind the import.
_GIL_PROBE = """\
import sys, threading, time
from lmcache_mp.daemon.daemon import preload_torch_libraries
def load():
    if sys.argv[1] == "preloaded":
        preload_torch_libraries()
    if sys.argv[1] != "idle":
        import torch
    else:
        time.sleep(3)
worker = threading.Thread(target=load)
longest, last = 0.0, time.monotonic()
worker.start()
while worker.is_alive():
    time.sleep(0.001)
    now = time.monotonic()
    longest, last = max(longest, now - last), now
print(longest)
"""
GIL_MODES = ("idle", "plain", "preloaded")


def gil_waits(rounds: int) -> dict[str, list[float]]:
    """Per mode, the longest waits of `rounds` runs, the modes interleaved."""
    waits: dict[str, list[float]] = {mode: [] for mode in GIL_MODES}
    for _ in range(rounds):
        for mode in GIL_MODES:
            out = subprocess.run([sys.executable, "-c", _GIL_PROBE, mode], capture_output=True, text=True,
                                 check=True)
            waits[mode].append(float(out.stdout))
    return waits


@dataclass
class Start:
    """Seconds from the process start to each event."""

    ping: float
    hello: float
    status: float
    serving: float
    pool_ready: float
    slowest_ping: float  # the longest PING round trip while the engine was built
    prepared_gbps: float = 0.0  # the pool's preparation, as the daemon logs it


def _answer(client: MessageQueueClient, request_type: RequestType, payload: list) -> object:
    return client.submit(request_type, payload).result(30)


def measure(size_gb: float) -> Start:
    """One start, its pool file (kept by a stopped daemon, by design) in a directory of its own on
    /dev/shm, removed with the run's directory after it."""
    pools = Path(tempfile.mkdtemp(prefix="lmc-pools-", dir="/dev/shm"))
    try:
        with scratch("lmc-bench-") as tmp:
            return _measure(tmp, pools / "pool", size_gb)
    finally:
        shutil.rmtree(pools, ignore_errors=True)


def _measure(tmp: Path, pool_file: Path, size_gb: float) -> Start:
    sock = tmp / "daemon.sock"
    started = time.monotonic()
    with open(tmp / "daemon.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen", f"ipc://{sock}",
                                 "--l1-size-gb", str(size_gb), "--pool-file", str(pool_file)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, LMCACHE_MP_RUNTIME_DIR=str(tmp)))
    try:
        # Connect once the socket exists: a client connecting earlier retries only every 100 ms.
        while not sock.exists():
            assert proc.poll() is None, (tmp / "daemon.log").read_text()
            time.sleep(0.001)
        client = MessageQueueClient(f"ipc://{sock}")
        try:
            start = _follow(client, size_gb, started)
        finally:
            client.close()
        start.prepared_gbps = _logged_gbps(tmp / "daemon.log")
        return start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _follow(client: MessageQueueClient, size_gb: float, started: float) -> Start:
    assert _answer(client, RequestType.PING, [1]) == 1
    ping = time.monotonic() - started
    _answer(client, RequestType.HELLO, [1, "bench"])
    hello = time.monotonic() - started
    report = _answer(client, RequestType.STATUS, [])
    status = time.monotonic() - started
    assert report.phase == PHASE_STARTING, "the engine was built before the first PING was answered"
    slowest = 0.0
    while report.phase != PHASE_SERVING:
        sent = time.monotonic()
        _answer(client, RequestType.PING, [2])
        slowest = max(slowest, time.monotonic() - sent)
        time.sleep(PING_EVERY_S)
        report = _answer(client, RequestType.STATUS, [])
    serving = time.monotonic() - started
    # A small pool may be ready by then (1 GiB takes ~0.2 s at memory speed); a large one never.
    assert size_gb < ASSERT_FROM_GB or not report.pool_ready, "the pool was ready when the engine was built"
    while not report.pool_ready:
        time.sleep(0.01)
        report = _answer(client, RequestType.STATUS, [])
    return Start(ping, hello, status, serving, time.monotonic() - started, slowest)


def _logged_gbps(log: Path, timeout: float = 10.0) -> float:
    """The rate in the daemon's "pool ready: ... (N GB/s)" line (written just after the pool is)."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(r"pool ready: .* \(([\d.]+) GB/s\)", log.read_text())):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    return float(found.group(1))


def row(size: float, starts: list[Start]) -> str:
    """One table row: the medians of `starts`, and the memset baseline measured now."""
    med = {name: statistics.median(getattr(s, name) for s in starts) for name in Start.__dataclass_fields__}
    baseline = size * 2**30 / memset_s(int(size * 2**30)) / 1e9
    return (f"| {size:g} GiB | {med['ping']:.2f} s | {med['hello']:.2f} s | {med['status']:.2f} s "
            f"| {med['serving']:.2f} s | {med['pool_ready']:.2f} s | {med['prepared_gbps']:.2f} "
            f"| {baseline:.2f} | {med['slowest_ping'] * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 8, 16], help="pool sizes in GiB")
    parser.add_argument("--repeats", type=int, default=1, help="starts per size (medians are shown)")
    parser.add_argument("--gil-rounds", type=int, default=3,
                        help="rounds of the GIL probe (a thread importing torch: plain, after the daemon's "
                             "preload, or only sleeping), 0 to skip")
    args = parser.parse_args()
    floors: list[float] = []
    torches: list[float] = []
    print("| pool | first PING | HELLO | STATUS | engine built | pool ready | prepared GB/s | memset GB/s "
          "| slowest PING while built |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes_gb:
        if size + SPARE_GIB > available_gib():
            print(f"| {size:g} GiB | skipped: {available_gib():.1f} GiB available, "
                  f"needs {size + SPARE_GIB:g} | | | | | | | |")
            continue
        starts = []
        for _ in range(args.repeats):  # the baselines interleaved with the daemon's starts
            floors.append(python_s("import zmq, msgspec"))
            torches.append(python_s("import torch"))
            starts.append(measure(size))
        print(row(size, starts))
    if floors:
        floor, torch_s = statistics.median(floors), statistics.median(torches)
        print(f"\nsame-run baselines (median of {len(floors)}): python -c 'import zmq, msgspec' "
              f"{floor:.2f} s; python -c 'import torch' {torch_s:.2f} s; "
              f"target: first PING <= {TARGET_FIRST_PING_S:g} s")
    if args.gil_rounds:
        waits = gil_waits(args.gil_rounds)
        ranges = "; ".join(f"{mode} {min(w) * 1e3:.0f}-{max(w) * 1e3:.0f} ms" for mode, w in waits.items())
        print(f"\nlongest wait of a sleeping thread while another imports torch "
              f"({args.gil_rounds} rounds): {ranges}")


if __name__ == "__main__":
    main()
