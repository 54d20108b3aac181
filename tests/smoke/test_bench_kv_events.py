"""The KV events benchmark (`scripts/bench/bench_kv_events.py --quick`) as the suite's smoke run:
three real daemons (no events, a stalled subscriber, a live one) take STOREs through the worker
adapter while their pools evict; the run must exercise that path: every chunk stored, evictions,
every event published, the live subscriber receiving all of them and the stalled one none.
The speed target (>= 95% of the baseline) is not judged here (`--min-ratio 0`): the suite runs on
busy machines, and the quick run's two rounds are too few for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import run_benchmark

RUN_TIMEOUT_S = 240  # ~30 s on 2 quiet cores


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_kv_events_benchmark_stores_through_all_three_daemons_and_publishes_every_event(
        tmp_path: Path) -> None:
    output = run_benchmark("bench_kv_events.py", ["--quick", "--min-ratio", "0", "--out", str(tmp_path)],
                           RUN_TIMEOUT_S)
    figures = json.loads((tmp_path / "kv_events.json").read_text())
    assert figures["path_exercised"], output
    assert set(figures["results"]) == {"32x8", "32x1"}, output
    for name, result in figures["results"].items():
        daemons = result["daemons"]
        for config, daemon in daemons.items():
            assert daemon["chunks_stored"] == daemon["chunks_offered"] > 0, (name, config, daemon)
            assert daemon["evictions"] > 0, (name, config, daemon)
        baseline, stalled, live = daemons.values()
        assert baseline["kv_events_published_total"] == 0, (name, baseline)
        for daemon in (stalled, live):
            assert daemon["kv_events_published_total"] == daemon["kv_events_seq"] > daemon["chunks_offered"]
            assert daemon["kv_events_dropped_total"] == 0, (name, daemon)
        got = result["live_subscriber"]
        assert got["gaps"] == 0 and got["batches"] == live["kv_events_batches_total"], (name, got, live)
        assert (got["stored"], got["removed"]) == (live["chunks_stored"], live["evictions"]), (name, got)
        assert result["stalled_subscriber"]["backlog_batches"] > 0, (name, result["stalled_subscriber"])
        assert all(row["gbps"] > 0 for row in result["rows"].values()), (name, result["rows"])
