"""A request's own limits (`kv_transfer_params`: `lmcache.mp.max_offload_tokens`,
`lmcache.mp.max_load_tokens`, and vLLM's native `max_load_tokens`) on a real vLLM engine with the
real daemon: one engine, its own prefix cache off so that every hit is the daemon's, one prompt of
four chunks and a bit sent again each round; every answer equals the first, computed whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.helpers import wait_for_status
from tests.support.vllm_engines import (
    CHUNK,
    ENGINE_TIMEOUT_S,
    DaemonUnderTest,
    cached,
    daemon_fixture,  # noqa: F401 (a fixture)
    engine_spec,
    held_engine,
    make_tiny_llama,
    tokens,
    work_dir_fixture,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2 * ENGINE_TIMEOUT_S)]

PROMPT = [random.Random(44).randrange(3, 1000) for _ in range(4 * CHUNK + 10)]


def sent(params: dict[str, int]) -> dict[str, object]:
    return {"tokens": PROMPT, "kv_transfer_params": params}


def test_a_requests_limits_bound_what_it_stores_and_loads(work_dir: Path, daemon: DaemonUnderTest) -> None:
    model = make_tiny_llama(work_dir / "tiny-llama")
    barrier = work_dir / "barrier"
    rounds = [[sent({"lmcache.mp.max_offload_tokens": 2 * CHUNK + 5})],  # stores 2 chunks, not 4
              [sent({"lmcache.mp.max_load_tokens": CHUNK, "lmcache.mp.skip_save": True})],  # loads 1
              [PROMPT],  # loads both, stores the 2 the daemon lacks
              [PROMPT, sent({"max_load_tokens": 3 * CHUNK}), sent({"lmcache.mp.max_load_tokens": 0})]]
    spec = engine_spec(model, daemon, rounds, prefix_caching=False, barrier_dir=str(barrier))
    engine = held_engine(spec, work_dir / "engine.log", barrier)
    try:
        engine.go()
        outputs = [engine.round(0)]
        wait_for_status(daemon.url, lambda r: r.objects >= 2, "round 0's chunks stored")
        (barrier / "go-1").touch()
        outputs.append(engine.round(1))
        stored_by_round_0 = daemon.objects()  # round 0's stores long landed; round 1 stores nothing
        (barrier / "go-2").touch()
        outputs.append(engine.round(2))
        # Its prompt and answer make 4 whole chunks (the answer's last token has no KV).
        wait_for_status(daemon.url, lambda r: r.objects >= 4, "round 2's chunks stored")
        (barrier / "go-3").touch()
        outputs.append(engine.round(3))
        engine.finish()
    finally:
        engine.kill()
    assert stored_by_round_0 == 2
    assert [cached(o) for o in outputs] == [[0], [CHUNK], [2 * CHUNK], [4 * CHUNK, 3 * CHUNK, 0]]
    assert [t for o in outputs[1:] for t in tokens(o)] == tokens(outputs[0]) * 5
    assert daemon.objects() == 4
