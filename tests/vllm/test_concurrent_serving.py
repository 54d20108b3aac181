"""Concurrent serving end to end: `scripts/bench/bench_concurrent.py --quick` as the suite's
smoke run. Two real vLLM OpenAI API servers with the connector share one real daemon, two more
serve without it; multi-turn sessions arrive at once and each turn goes to either engine at
random, so requests are batched, loads and stores run beside other requests' forward passes, and
returning turns load what the other engine stored. Every answer must equal the baseline's, no
request may fail, the daemon must be left with no lease, session or transfer, and the returning
turns that crossed engines must have found their history in the daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
# Four API servers start in 40-100 s on 2 quiet cores, minutes under load; the quick run's turns
# take about a minute.
RUN_TIMEOUT_S = 1500


@pytest.mark.vllm
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_two_engines_serve_concurrent_sessions_through_one_daemon(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_concurrent.py"), "--quick",
                          "--no-saturate", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, output
    figures = json.loads((tmp_path / "concurrent.json").read_text())
    lock_step = figures["figures"]
    assert lock_step["errors"] == 0 and lock_step["answered"] == lock_step["expected"], output
    assert lock_step["mismatches"] == [], output
    daemon = figures["daemon"]
    assert (daemon["leases"], daemon["sessions"], daemon["transfers_running"]) == (0, 0, 0), daemon
    cross = lock_step["cross_engine"]
    assert cross["n"] > 0 and cross["connector_hit"] == cross["n"], cross
    assert all(checked for name, checked in figures["checks"].items()
               if "answered" in name or "equal" in name or "left in the daemon" in name), figures["checks"]
