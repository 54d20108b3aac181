"""Looking at a running daemon from outside: its /metrics series, and freezing its process (every
thread stopped) to play a daemon that hangs. Loads no torch."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def scrape(port: int) -> dict[str, float]:
    """The daemon's lmcache_mp_ series at http://127.0.0.1:PORT/metrics, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(lmcache_mp_[^\s]+)\s+([-+0-9.eE]+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def freeze(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGSTOP `proc` and wait until every one of its threads has stopped: a thread running on
    another core when the signal is sent can still answer a request or two before it stops."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{proc.pid}/task")
    while not all(_thread_state(task) in "tT" for task in tasks.iterdir()):
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.001)


def _thread_state(task: Path) -> str:
    # /proc/PID/task/TID/stat: "tid (comm) STATE ..."; comm may hold spaces and parentheses.
    return (task / "stat").read_text().rpartition(")")[2].split()[0]
