"""Smoke runs of the benchmarks that need no vLLM engine: each runs as docs/benchmarks.md says, on a
short setting, and its JSON shows that it exercised the path it measures. Three had stopped
running unseen (bench_tiers, bench_register, bench_remote) before benchmarks had smoke runs.
Targets are not judged here: the suite runs on busy machines, and these runs are too short for them.
(bench_tiers and bench_kv_events have their own smoke tests; the vLLM benchmarks take minutes.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import run_benchmark

RUN_TIMEOUT_S = 300  # each ~10-60 s on 2 quiet cores


def _data_plane(figures: dict[str, Any]) -> None:
    (geometry,) = figures.values()
    gbps = geometry["gbps"]
    for path in ("STORE, 1 thread", "RETRIEVE, 1 thread", "RETRIEVE, split", "STORE, anonymous pool"):
        assert gbps[path] > 0, (path, gbps)
    assert geometry["request_bytes"] > 0


def _remote(figures: dict[str, Any]) -> None:
    assert len(figures["checks"]) == 16, figures["checks"]  # SET and GET, 2 sizes, 4 tiers
    assert all(figures[part]["sizes"] for part in ("redis", "v1", "s3", "mooncake")), figures
    # e. Read-through by a daemon: LOOKUPs promoted from every tier (the script asserts each pass
    # promoted exactly its chunks), bytes verified, nothing corrupt.
    promotion = figures["promotion"]
    assert set(promotion["tiers"]) == {"disk", "redis", "s3", "mooncake"}, promotion
    for name, tier in promotion["tiers"].items():
        assert tier["verified_bytes"] == promotion["chunks"] * promotion["chunk_bytes"] > 0, (name, tier)
        assert tier["lookup_32"]["n"] > 0 and tier["lookup_1"]["n"] > 0, (name, tier)
        after = tier["tier_after"]
        assert after["corrupt_total"] == 0 and after["promotions_total"] > 0, (name, after)


def _register(figures: dict[str, Any]) -> None:
    (size,) = figures["results"].values()
    assert size["memfd"]["register_s"] > 0 and size["allocated"]["register_s"] > 0, size


def _warm_restart(figures: dict[str, Any]) -> None:
    (row,) = figures.values()
    assert row["empty serving_s"] > 0 and row["warm first_hit_s"] > 0, row


# script, its arguments besides --out, the JSON it writes, what that JSON must show
BENCHMARKS: dict[str, tuple[list[str], str, Callable[[dict[str, Any]], None]]] = {
    "bench_data_plane.py": (["--iterations", "2", "--geometry", "32x8"], "data_plane.json", _data_plane),
    "bench_remote.py": (["--quick"], "remote.json", _remote),
    "bench_register.py": (["--quick"], "register.json", _register),
    "bench_warm_restart.py": (["--sizes-gb", "1"], "warm_restart.json", _warm_restart),
}


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_benchmark_runs_and_measures_its_path(script: str, tmp_path: Path) -> None:
    args, json_name, check = BENCHMARKS[script]
    run_benchmark(script, [*args, "--out", str(tmp_path)], RUN_TIMEOUT_S)
    check(json.loads((tmp_path / json_name).read_text()))
