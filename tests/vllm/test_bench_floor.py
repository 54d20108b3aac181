"""`scripts/bench/bench_floor.py --quick` as the suite's smoke run: vLLM's own serving benchmark
(`vllm.benchmarks.serve`, its prefix-repetition data set) against three real API servers, one
with the connector and a real daemon. Targets are not judged here (a busy machine, a short run);
what must hold is what the benchmark exercises: every request answered, the same text from all
three servers, the connector serving the returning prefixes the small cache lost, the floor
holding what the small cache could not, and the daemon left with nothing in flight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import run_benchmark

pytest.importorskip("vllm")

# Three API servers start in 1-3 minutes on 2 loaded cores; the quick run's requests take 1-2 more.
RUN_TIMEOUT_S = 1500


@pytest.mark.vllm
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_floor_benchmark_serves_returning_prefixes_through_the_connector(tmp_path: Path) -> None:
    output = run_benchmark("bench_floor.py", ["--quick", "--out", str(tmp_path)], RUN_TIMEOUT_S)
    figures = json.loads((tmp_path / "floor.json").read_text())
    correctness = [name for name in figures["checks"] if not name.startswith("c=")]
    assert len(correctness) == 4 and all(figures["checks"][name] for name in correctness), figures["checks"]
    for level, row in figures["figures"].items():
        small, floor, connector = (row["servers"][name] for name in ("small", "floor", "connector"))
        assert small["failed"] == floor["failed"] == connector["failed"] == 0, (level, output)
        assert small["requests"] == floor["requests"] == connector["requests"] > 0, (level, output)
        # The floor's cache kept the prefixes the small one lost, and the connector brought them back.
        assert floor["tokens_local"] > small["tokens_local"], (level, row)
        assert connector["tokens_connector"] > 0, (level, row)
        assert row["recovered"]["connector"] > 0.5, (level, row["recovered"])
    settled = figures["daemon_settled"]
    assert all(not (s["leases"] or s["sessions"] or s["transfers_running"]) for s in settled), settled
