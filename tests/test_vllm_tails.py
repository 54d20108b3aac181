"""Returning turns recompute nothing they had (issue 31), through a real vLLM engine: a
conversation's history seldom ends on a chunk boundary, and each finished turn stores its tail
(the KV past its last full chunk, `vllm_adapter.tails`), which the next turn loads. With vLLM's
own prefix cache off, every token a returning turn finds is the daemon's; with it on, vLLM holds
the full blocks and the daemon adds the rest. Either way each returning turn finds all of its
history but the last answer token (whose KV was never computed: vLLM's rule), and answers exactly
as an engine whose own prefix cache holds everything (the floor)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers import wait_for_status

# The engine runner, and the module-scoped fixtures `daemon` and `work_dir`.
from tests.vllm_engines import (
    CHUNK,
    MAX_TOKENS,
    DaemonUnderTest,
    VllmEngine,
    cached,
    daemon_fixture,  # noqa: F401
    engine_spec,
    make_tiny_llama,
    run_engine,
    tokens,
    work_dir_fixture,  # noqa: F401
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_rng = random.Random(31)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


# Two users: a context of a chunk and a bit, and one shorter than a chunk; three turns each.
ROUNDS = [[_tokens(CHUNK + 36), _tokens(40)], [_tokens(20), _tokens(30)], [_tokens(25), _tokens(9)]]


def _histories() -> list[list[int]]:
    """Each turn's prompt length, per round (the answers have MAX_TOKENS tokens)."""
    lengths, history = [], [0, 0]
    for messages in ROUNDS:
        prompts = [h + len(m) for h, m in zip(history, messages, strict=True)]
        lengths.append(prompts)
        history = [p + MAX_TOKENS for p in prompts]
    return lengths


def _after_round(i: int) -> tuple[int, int]:
    """(the daemon's objects, the tails noted since start) once round i's stores and notes have
    landed: each conversation's full chunks through its last computed token (all but the answer's
    last), and its latest tail, the older ones freed as superseded; a tail noted per turn that did
    not end on a chunk boundary."""
    ends = [[p + MAX_TOKENS - 1 for p in prompts] for prompts in _histories()[:i + 1]]
    objects = sum(end // CHUNK + (end % CHUNK > 0) for end in ends[-1])
    return objects, sum(end % CHUNK > 0 for round_ends in ends for end in round_ends)


@pytest.fixture(scope="module")
def model(work_dir: Path) -> Path:
    return make_tiny_llama(work_dir / "tiny-llama-f32")


@pytest.fixture(scope="module")
def floor(model: Path, work_dir: Path) -> list[list[list[int]]]:
    """The answers of an engine whose own prefix cache holds every turn (no connector)."""
    rounds = run_engine(engine_spec(model, None, ROUNDS, conversation=True), work_dir / "floor.log")
    return [tokens(r) for r in rounds]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["daemon-only", "with-vllm-cache"])
def test_returning_turns_load_their_whole_history(model: Path, work_dir: Path, daemon: DaemonUnderTest,
                                                  floor: list[list[list[int]]], prefix_caching: bool) -> None:
    daemon.proc.stop()
    daemon.start()  # empty: each case starts from nothing
    # The engine stays up before an extra last round, while the objects are counted: a tail is
    # freed with its model's formats, known while its ranks are registered.
    barrier = work_dir / f"barrier-{prefix_caching}"
    barrier.mkdir()
    spec = engine_spec(model, daemon, [*ROUNDS, [[5], [5]]], prefix_caching=prefix_caching, conversation=True,
                       barrier_dir=str(barrier))
    spec["connector"]["lmcache.mp.tails"] = True
    engine = VllmEngine(spec, work_dir / f"tails-{prefix_caching}.log")
    try:
        turns = []
        for i in range(len(ROUNDS)):
            turns.append(engine.round(i))
            # The next turn once this one's tails are noted and stored: a finished request's tail
            # is stored with the engine's next step, and a LOOKUP_PREFIX offers only tails the
            # pool holds (a turn sent before that finds the chunks alone: a slower user's would not).
            landed = _after_round(i)
            wait_for_status(daemon.url, lambda r, want=landed: (r.objects, r.tails_noted_total) == want,
                            f"round {i}: (objects, tails noted) {landed}", timeout_s=120,
                            daemon=daemon.proc)
            (barrier / f"go-{i + 1}").touch()
        assert [tokens(r) for r in turns] == floor
        prompts = _histories()
        previous = [[p + MAX_TOKENS for p in round_prompts] for round_prompts in prompts]
        assert cached(turns[0]) == [0, 0]
        for i in range(1, len(ROUNDS)):
            # All of the history but its last token, the last answer's, whose KV was never computed.
            assert cached(turns[i]) == [h - 1 for h in previous[i - 1]], f"round {i}"
        # What stayed (while the engine is up, at the barrier before its extra round): each
        # conversation's full chunks and only its latest tail (each turn's NOTE_TAILS superseded
        # the tail it loaded: freed), which the waits above counted.
        engine.round(len(ROUNDS))
        engine.finish()
    finally:
        engine.kill()
