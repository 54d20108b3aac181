"""`scripts/bench/bench_lmcache.py --quick` as the suite's smoke run, its rows of LMCache's own
connector against LMCache's own `lmcache server`, in both of its transfer modes. What must hold is what the
benchmark measures: in every row a fresh engine loads every full chunk of every prompt from the
connector, with the outputs of vLLM's own prefix hit, and the run leaves no shared memory behind.
The speed targets are not judged here (a small model on a busy machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import LMCACHE_MISSING, run_benchmark

pytest.importorskip("vllm")
pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

# LMCache's own server's rows alone (and the floor): what no other test runs. The door's rows are
# tests/vllm/test_lmcache_door_vllm.py's, ours tests/vllm/test_vllm_connector.py's; all 11 engines of
# the full row set took 9 minutes here. 5 engines, one after another.
ROWS = {"lmcache-server/lmcache_driven", "lmcache-server/engine_driven"}
RUN_TIMEOUT_S = 1200


@pytest.mark.vllm
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_every_row_loads_every_chunk_from_its_connector_with_the_floor_s_outputs(tmp_path: Path) -> None:
    args = ["--quick", "--rows", ",".join(sorted(ROWS)), "--out", str(tmp_path)]
    output = run_benchmark("bench_lmcache.py", args, RUN_TIMEOUT_S)
    figures = json.loads((tmp_path / "lmcache.json").read_text())
    expected = figures["expected_hit_tokens"]
    assert expected == 512, output  # 3 prompts of 2 chunks and a token
    floor = figures["floor"]["prefix hit"]
    assert [r["num_cached_tokens"] for r in floor] == [expected] * 3, output
    assert set(figures["rows"]) == ROWS, output
    for name, row in figures["rows"].items():
        assert "error" not in row, (name, row.get("error"))
        # Engine 1 met an empty server: it computed everything and stored it.
        assert [r["num_cached_tokens"] for r in row["store"]] == [0] * 3, (name, row["store"])
        warm = row["warm"]
        assert [r["num_cached_tokens"] for r in warm] == [expected] * 3, (name, warm)
        assert [r["external_tokens"] for r in warm] == [expected] * 3, (name, warm)
        assert [r["token_ids"] for r in warm] == [r["token_ids"] for r in floor], (name, warm, floor)
    assert figures["rows"]["lmcache-server/engine_driven"]["transfer"] == "engine_driven, SHM"
    assert figures["shm_left"] == [], figures["shm_left"]
    assert all(figures["checks"].values()), figures["checks"]
