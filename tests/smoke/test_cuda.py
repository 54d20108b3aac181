"""`scripts/gpu/selftest.py`, end to end: the real daemon and worker processes storing and
retrieving KV allocated as vLLM 0.32 allocates it on a GPU (one buffer; LBNHC and LBHNC views,
4-D MLA, 80 layers of 2 KV heads, a kernel-block split), two ranks and two groups at once, and a
worker killed mid-STORE, every byte compared.

The CPU run exercises everything but the CUDA-specific lines (streams, interprocess events,
pinned copies, cudaHostRegister) on every machine; the tests marked `cuda` run the same script
on a GPU, where the first round checks that the daemon waits for the worker's event, and skip
without one. On a GPU machine: `pytest -m cuda tests/smoke/test_cuda.py`. `scripts/gpu/selftest_door.py`
does the same through the lmcache door, with caches registered as LMCache's connector registers
them (segments in /dev/shm on CPU, CUDA IPC descriptors on a GPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SELFTEST = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "selftest.py"
DOOR_SELFTEST = SELFTEST.with_name("selftest_door.py")
DOOR_CASES = ["FLASH_ATTN/LBNHC", "FLASH_ATTN/LBHNC", "MLA/LBNHC"]
CASES = ("FLASH_ATTN/LBNHC", "FLASH_ATTN/LBHNC", "TRITON_MLA", "80L-2KV", "FLASHINFER/split")
TOGETHER = ("2 ranks #0", "2 ranks #1", "2 groups, 1 event #0", "2 groups, 1 event #1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_selftest(tmp_path: Path, *args: str, timeout_s: float = 120, script: Path = SELFTEST
                 ) -> tuple[int, dict[str, Any], str]:
    """Run the self-test; (exit code, its JSON figures, its output)."""
    out = tmp_path / "selftest.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    assert out.exists(), output
    return proc.returncode, json.loads(out.read_text()), output


def assert_every_case_round_tripped(figures: dict[str, Any], output: str) -> None:
    """Every chunk of every round stored (one new pool object each), hit, retrieved and equal,
    with throughput and its baseline measured; the killed worker's registration dropped and the
    daemon serving on."""
    assert figures["ok"] and not figures["failures"], output
    geo = figures["geometry"]
    assert list(figures["cases"]) == [*CASES, *TOGETHER]
    for name, report in figures["cases"].items():
        rounds = geo["rounds"] + 1 if name in CASES else 1  # the ordering round, then the timed ones
        expected = rounds * geo["chunks"]
        assert report["rounds"] == rounds, name
        assert report["bit_exact"] is True, name
        assert report["chunks_expected"] == expected, name
        assert report["chunks_stored"] == expected, name
        assert report["chunks_hit"] == expected, name
        assert report["chunks_retrieved"] == expected, name
        assert report["tail_retrieved"] is (name in CASES), name  # the ordering round's short chunk
        if name in CASES:
            for figure in ("store_gbps", "retrieve_gbps", "baseline_store_gbps", "baseline_retrieve_gbps"):
                assert report[figure] > 0, (name, figure)
    killed = figures["killed_worker"]
    assert killed["ok"] and killed["child_said"] == "stored", killed


def test_selftest_on_cpu_round_trips_every_case_bit_exact(tmp_path: Path) -> None:
    code, figures, output = run_selftest(tmp_path, "--device", "cpu")
    assert code == 0, output
    assert figures["device"] == "cpu"
    assert_every_case_round_tripped(figures, output)
    shapes = {name: report["cache_shape"] for name, report in figures["cases"].items()}
    # vLLM 0.32's 4-D logical views: [blocks, heads, block_size, C]; MLA with one latent head;
    # the split case counts kernel blocks in dim 0 (twice vLLM's) of half the tokens.
    assert shapes["FLASH_ATTN/LBNHC"][1:] == shapes["FLASH_ATTN/LBHNC"][1:] == [2, 16, 128]
    assert shapes["TRITON_MLA"][1:] == [1, 16, 96]
    assert shapes["FLASHINFER/split"][1:] == [2, 8, 128]
    assert figures["killed_worker"]["outcome"] == "daemon served on"  # shared memory outlives its worker
    assert not any(report["ordering_checked"] for report in figures["cases"].values())
    assert all("skipped" in pin for pin in figures["pin"])  # pinning needs CUDA


@pytest.mark.cuda
@needs_cuda
def test_selftest_on_cuda_stores_what_the_event_guards_and_measures(tmp_path: Path) -> None:
    """The first round writes behind a long kernel and stores (and retrieves) at once with an
    interprocess event: bit-exact only if the daemon waits on it."""
    code, figures, output = run_selftest(tmp_path, "--device", "cuda", "--pin-gib", "1", timeout_s=300)
    assert code == 0, output
    assert figures["device"] == "cuda"
    assert_every_case_round_tripped(figures, output)
    for name in CASES:
        report = figures["cases"][name]
        assert report["ordering_checked"] is True, name
        # The events were still pending when the requests went out: the order was the daemon's doing.
        assert report["ordering_store_pending"] and report["ordering_retrieve_pending"], name
        # The store waited for the kernel; the timed rounds did not have one to wait for.
        assert report["ordering_store_s"] > report["request_bytes"] / report["store_gbps"] / 1e9, name
    (pin,) = figures["pin"]
    assert pin["gib"] == 1 and pin["seconds"] > 0, pin


def assert_door_cases_round_tripped(figures: dict[str, Any], output: str, *, ordered: bool) -> None:
    """Through the lmcache door, LMCache's registration of vLLM's caches (views reordered as its
    worker reorders them): every case's chunks stored, found, retrieved into other blocks, equal."""
    assert figures["ok"], output
    assert [case["case"] for case in figures["cases"]] == DOOR_CASES
    for case in figures["cases"]:
        assert case["bit_exact"] is True and not case["failures"], case
        # On CUDA the requests went out while the worker's writes still ran: the order was the daemon's.
        assert case["store_pending"] is ordered and case["retrieve_pending"] is ordered, case


def test_door_selftest_on_cpu_round_trips_lmcache_s_segments_bit_exact(tmp_path: Path) -> None:
    code, figures, output = run_selftest(tmp_path, "--device", "cpu", script=DOOR_SELFTEST)
    assert code == 0, output
    assert_door_cases_round_tripped(figures, output, ordered=False)


@pytest.mark.cuda
@needs_cuda
def test_door_selftest_on_cuda_round_trips_lmcache_s_ipc_handles_bit_exact(tmp_path: Path) -> None:
    code, figures, output = run_selftest(tmp_path, "--device", "cuda", script=DOOR_SELFTEST, timeout_s=300)
    assert code == 0, output
    assert_door_cases_round_tripped(figures, output, ordered=True)
