"""Returning turns recompute nothing they had, through a real vLLM engine: a
conversation's history seldom ends on a chunk boundary, and each finished turn stores its tail
(the KV past its last full chunk, `vllm_adapter.tails`), which the next turn loads. With vLLM's
own prefix cache off, every token a returning turn finds is the daemon's; with it on, vLLM holds
the full blocks and the daemon adds the rest. Either way each returning turn finds all of its
history but the last answer token (whose KV was never computed: vLLM's rule), and answers exactly
as an engine whose own prefix cache holds everything (the floor). A prompt of embeddings, whose
token ids are all 0, neither looks up nor stores a tail, and a LoRA adapter's tail is its own:
another adapter of the same name at another path does not take it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lmcache_mp.protocol import StatusReport
from tests.support.helpers import status, wait_for_status

# The engine runner, and the module-scoped fixtures `daemon` and `work_dir`.
from tests.support.vllm_engines import (
    CHUNK,
    MAX_TOKENS,
    DaemonUnderTest,
    VllmEngine,
    cached,
    daemon_fixture,  # noqa: F401
    engine_spec,
    held_engine,
    make_tiny_llama,
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
def floor(model: Path, work_dir: Path) -> Iterator[VllmEngine]:
    """An engine whose own prefix cache holds every turn (no connector). Started here, it runs while
    the first test's engine starts; its answers are read once it has exited."""
    engine = VllmEngine(engine_spec(model, None, ROUNDS, conversation=True), work_dir / "floor.log")
    yield engine
    engine.kill()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["daemon-only", "with-vllm-cache"])
def test_returning_turns_load_their_whole_history(model: Path, work_dir: Path, daemon: DaemonUnderTest,
                                                  floor: VllmEngine, prefix_caching: bool) -> None:
    daemon.proc.stop()
    daemon.start()  # empty: each case starts from nothing
    # The engine stays up before an extra last round, while the objects are counted: a tail is
    # freed with its model's formats, known while its ranks are registered.
    barrier = work_dir / f"barrier-{prefix_caching}"
    spec = engine_spec(model, daemon, [*ROUNDS, [[5], [5]]], prefix_caching=prefix_caching, conversation=True,
                       barrier_dir=str(barrier))
    spec["connector"]["lmcache.mp.tails"] = True
    engine = held_engine(spec, work_dir / f"tails-{prefix_caching}.log", barrier)
    try:
        floor_answers = [tokens(r) for r in engine.start_after(floor)]
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
        assert [tokens(r) for r in turns] == floor_answers
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


def make_lora(path: Path, seed: int) -> Path:
    """A LoRA adapter of the tiny model (rank 8 on q_proj and v_proj, random), in PEFT's layout."""
    path.mkdir()
    rows = torch.Generator().manual_seed(seed)
    rank, hidden, modules = 8, 128, {"q_proj": 128, "v_proj": 64}  # their output widths
    tensors = {}
    for layer in range(2):
        for module, width in modules.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=rows) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=rows) * 0.3
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(modules), "bias": "none"}))
    return path


# The one-token turns: an adapter's history and two returning turns, under two adapters of one name
# at two paths (a name re-pointed at another adapter); then a prompt of token ids 0 and one of
# embeddings. One engine with prompt embeddings and LoRA on answers them all, one token each.
HISTORY = _tokens(20)  # shorter than a block: its tail is found after token 0
RETURNS = [_tokens(5), _tokens(5)]
# vLLM gives each position of a prompt of embeddings the token id 0: these token ids are what the
# embeddings' prompt holds in its first 20 positions.
ZEROS = [0] * 20
EMBEDDINGS = {"embeds_seed": 39, "length": 25}
ONE_TOKEN = {"max_tokens": 1, "prompt_embeds": True, "max_lora_rank": 8, "logprobs": True}
# The daemon's (objects, tails noted) once the adapters' turns have landed: each turn noted its tail;
# the first adapter's second turn loaded its first's and superseded it (freed). Then the token
# prompt's tail, and no more.
ADAPTERS_LANDED = (2, 3)
ZEROS_LANDED = (3, 4)


@dataclass
class OneTokenTurns:
    floor: list[list[dict]]  # per round, the answers of an engine without the connector
    outputs: list[list[dict]]  # and those of the engine with it
    zeros_landed: StatusReport  # once the token prompt's tail was stored and noted
    end: StatusReport  # after the embeddings' turn, the engine exited


@pytest.fixture(scope="module")
def one_token_turns(model: Path, work_dir: Path, daemon: DaemonUnderTest) -> OneTokenTurns:
    """The one-token turns through an engine with the connector and tails, on an empty daemon, each
    round once the last one's tails have landed (counted exactly); and through an engine without
    it (the floor), which runs while the other starts."""
    daemon.proc.stop()
    daemon.start()  # empty
    here, there = (str(make_lora(work_dir / f"lora-{seed}", seed)) for seed in (1, 2))
    rounds = [[{"tokens": HISTORY, "lora": ["adapter", 1, here]}],
              [{"tokens": HISTORY + RETURNS[0], "lora": ["adapter", 2, there]}],
              [{"tokens": HISTORY + RETURNS[1], "lora": ["adapter", 1, here]}],
              [ZEROS], [EMBEDDINGS]]
    floor = VllmEngine(engine_spec(model, None, rounds, **ONE_TOKEN), work_dir / "one-token-floor.log")
    barrier = work_dir / "barrier-one-token"
    spec = engine_spec(model, daemon, rounds, barrier_dir=str(barrier), **ONE_TOKEN)
    spec["connector"]["lmcache.mp.tails"] = True
    engine = held_engine(spec, work_dir / "one-token.log", barrier)

    def landed(want: tuple[int, int], what: str) -> StatusReport:
        return wait_for_status(daemon.url, lambda r: (r.objects, r.tails_noted_total) == want, what,
                               timeout_s=120, daemon=daemon.proc)

    try:
        floor_outputs = engine.start_after(floor)
        outputs = [engine.round(0)]
        landed((1, 1), "the first adapter's tail stored and noted")
        for i in (1, 2):
            (barrier / f"go-{i}").touch()
        outputs += [engine.round(1), engine.round(2)]
        landed(ADAPTERS_LANDED, "the adapters' tails stored and noted, the superseded one freed")
        (barrier / "go-3").touch()
        outputs.append(engine.round(3))
        zeros_landed = landed(ZEROS_LANDED, "the token prompt's tail stored and noted")
        (barrier / "go-4").touch()
        outputs.append(engine.round(4))
        engine.finish()
    finally:
        engine.kill()
        floor.kill()
    return OneTokenTurns(floor_outputs, outputs, zeros_landed, status(daemon.url))


def test_a_prompt_of_embeddings_never_takes_a_tail(one_token_turns: OneTokenTurns) -> None:
    """A prompt of 20 token ids 0 leaves its tail (shorter than a block: indexed after token 0).
    A prompt of 25 embeddings then finds no tail offered (it asks for none), loads nothing, and
    answers as an engine without the connector does; nor does it leave a tail of its own."""
    turns = one_token_turns
    embedded = turns.outputs[4]
    assert cached(embedded) == [0]
    assert embedded == turns.floor[4]  # the same token and the same logprob: no other prompt's KV
    assert turns.end.tails_offered_total == turns.zeros_landed.tails_offered_total  # it looked up no tail
    assert (turns.end.objects, turns.end.tails_noted_total) == ZEROS_LANDED  # and stored none


def test_a_lora_adapters_tail_is_its_own(one_token_turns: OneTokenTurns) -> None:
    """Two adapters of one name at two paths: the second does not take the first's tail of the
    same tokens, and answers as an engine without the connector does; the first, back, takes its
    own."""
    floor, (_, other, own, *_) = one_token_turns.floor, one_token_turns.outputs
    assert cached(other) == [0] and other == floor[1]
    assert cached(own) == [20] and tokens(own) == tokens(floor[2])
