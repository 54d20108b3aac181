"""`scripts/gpu_selftest.py`, end to end: the real daemon and a worker process storing and
retrieving KV in vLLM's GPU layouts (FLASH_ATTN, FLASHINFER, MLA), every byte compared.

The CPU run exercises everything but the CUDA-specific lines (streams, interprocess events,
pinned copies, cudaHostRegister) on every machine; the tests marked `cuda` run the same script
on a GPU, where the first round checks that the daemon waits for the worker's event, and skip
without one. On a GPU machine: `pytest -m cuda tests/test_cuda.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SELFTEST = Path(__file__).resolve().parent.parent / "scripts" / "gpu_selftest.py"
LAYOUTS = ("FLASH_ATTN", "FLASHINFER", "MLA")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_selftest(tmp_path: Path, *args: str, timeout_s: float = 120) -> tuple[int, dict[str, Any], str]:
    """Run the self-test; (exit code, its JSON figures, its output)."""
    out = tmp_path / "selftest.json"
    proc = subprocess.run([sys.executable, str(SELFTEST), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    assert out.exists(), output
    return proc.returncode, json.loads(out.read_text()), output


def assert_every_layout_round_tripped(figures: dict[str, Any], output: str) -> None:
    """Every chunk of every round stored (one new pool object each), hit, retrieved and equal,
    with throughput and its baseline measured."""
    assert figures["ok"] and not figures["failures"], output
    geo = figures["geometry"]
    assert sorted(figures["layouts"]) == sorted(LAYOUTS)
    for layout, report in figures["layouts"].items():
        expected = report["rounds"] * geo["chunks"]
        assert report["rounds"] == geo["rounds"] + 1, layout  # the ordering round, then the timed ones
        assert report["bit_exact"] is True, layout
        assert report["chunks_expected"] == expected, layout
        assert report["chunks_stored"] == expected, layout
        assert report["chunks_hit"] == expected, layout
        assert report["chunks_retrieved"] == expected, layout
        for figure in ("store_gbps", "retrieve_gbps", "baseline_store_gbps", "baseline_retrieve_gbps"):
            assert report[figure] > 0, (layout, figure)


def test_selftest_on_cpu_round_trips_every_layout_bit_exact(tmp_path: Path) -> None:
    code, figures, output = run_selftest(tmp_path, "--device", "cpu")
    assert code == 0, output
    assert figures["device"] == "cpu"
    assert_every_layout_round_tripped(figures, output)
    shapes = {layout: report["cache_shape"][1:] for layout, report in figures["layouts"].items()}
    geo = figures["geometry"]
    assert shapes["FLASH_ATTN"] == shapes["FLASHINFER"] == [geo["kv_heads"], geo["block_size"],
                                                            2 * geo["head_size"]]
    assert shapes["MLA"] == [geo["block_size"], geo["latent_dim"]]
    assert not any(report["ordering_checked"] for report in figures["layouts"].values())
    assert all("skipped" in pin for pin in figures["pin"])  # pinning needs CUDA


@pytest.mark.cuda
@needs_cuda
def test_selftest_on_cuda_stores_what_the_event_guards_and_measures(tmp_path: Path) -> None:
    """The first round writes behind a long kernel and stores (and retrieves) at once with an
    interprocess event: bit-exact only if the daemon waits on it."""
    code, figures, output = run_selftest(tmp_path, "--device", "cuda", "--pin-gib", "1", timeout_s=300)
    assert code == 0, output
    assert figures["device"] == "cuda"
    assert_every_layout_round_tripped(figures, output)
    for layout, report in figures["layouts"].items():
        assert report["ordering_checked"] is True, layout
        # The store waited for the kernel; the timed rounds did not have one to wait for.
        assert report["ordering_store_s"] > report["request_bytes"] / report["store_gbps"] / 1e9, layout
    (pin,) = figures["pin"]
    assert pin["gib"] == 1 and pin["seconds"] > 0, pin
