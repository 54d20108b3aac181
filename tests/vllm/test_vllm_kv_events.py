"""KV events through a real vLLM engine: with vLLM's `--kv-events-config` on, its
stream carries the daemon's stores of the engine's blocks (medium CPU) and their removal when
the daemon evicts them, and a toy router that scores the engine by the longest prefix the events
say its daemon holds agrees with the daemon's LOOKUP."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lmcache_mp.kv_events.log import STORED
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import wait_for, wait_for_status
from tests.support.kv_event_subscriber import Subscriber
from tests.support.vllm_engines import BLOCK, CHUNK, ENV, VllmEngine, engine_spec, make_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# The tiny model's chunk: 2 layers x K,V x 64 tokens x 2 KV heads x 32 x float32 = 64 KiB; the pool
# holds 4 of them, so the second and third prompts evict the first's.
POOL_GB = "0.0003"
_rng = random.Random(30)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


FIRST, SECOND, THIRD = _tokens(3 * CHUNK + 1), _tokens(3 * CHUNK + 1), _tokens(2 * CHUNK + 1)
FILLER = [_tokens(40)]  # shorter than a chunk: no store, only steps (which hand over the events)
FILLERS = 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("kv-events") / "tiny-llama-f32")


def block_chain(stored: list, tokens: list[int]) -> list[bytes]:
    """The router's view of a prompt: the hashes of its leading full blocks, known from the
    BlockStored events alone (any medium): each block is named by its parent and its tokens."""
    named: dict[tuple[bytes | None, tuple[int, ...]], bytes] = {}
    for event in stored:
        parent = event.parent_block_hash
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            named[(parent, tuple(event.token_ids[i * size:(i + 1) * size]))] = block_hash
            parent = block_hash
    chain: list[bytes] = []
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        block_hash = named.get((chain[-1] if chain else None, tuple(tokens[start:start + BLOCK])))
        if block_hash is None:
            break
        chain.append(block_hash)
    return chain


def router_score(held: set[bytes], chain: list[bytes]) -> int:
    """Tokens of the longest prefix whose blocks the events say the daemon holds."""
    blocks = 0
    while blocks < len(chain) and chain[blocks] in held:
        blocks += 1
    return blocks * BLOCK


def test_the_engine_stream_carries_the_daemon_stores_and_evictions(daemons, short_tmp: Path,
                                                                    tiny_model: Path) -> None:
    daemon: DaemonProcess = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", POOL_GB, "--max-workers", "1")
    barrier = short_tmp / "barrier"
    barrier.mkdir()
    pub, replay = f"ipc://{short_tmp / 'vllm-ev'}", f"ipc://{short_tmp / 'vllm-ev-replay'}"
    rounds = [[FIRST], [SECOND], [THIRD], *[FILLER] * FILLERS]
    spec = engine_spec(tiny_model, daemon, rounds, barrier_dir=str(barrier),
                       kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                                  "replay_endpoint": replay})
    env = dict(ENV, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="0")  # bytes: the daemon's keys, to LOOKUP
    engine = VllmEngine(spec, short_tmp / "engine.log", env)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    try:
        model = ""

        def stored_chunks() -> int:
            reply = client.submit(RequestType.KV_EVENTS, [0, [model], 8192]).result(10)
            return sum(event.kind == STORED for event in reply.events)

        for i, chunks in enumerate([3, 6, 8]):  # each prompt's stores land after it finished
            engine.round(i)
            if not model:
                registered = wait_for_status(daemon.url, lambda r: bool(r.instances), "the worker registered")
                model = registered.instances[0].model_name
            wait_for(lambda n=chunks: stored_chunks() >= n, f"round {i}'s chunks stored")
            (barrier / f"go-{i + 1}").touch()
        chunk_tokens = {tuple(p[i:i + CHUNK]) for p in (FIRST, SECOND, THIRD)
                        for i in range(0, len(p) - CHUNK + 1, CHUNK)}

        def agree() -> tuple[bool, str]:
            subscriber = Subscriber(pub, replay)
            try:
                subscriber.replay(0)
            finally:
                subscriber.close()
            events = subscriber.holdings
            cpu_stored = [e for e in events.stored if e.medium == "CPU"]
            cpu_removed = [e for e in events.removed if e.medium == "CPU"]
            assert all(tuple(e.token_ids) in chunk_tokens and len(e.block_hashes) == CHUNK // BLOCK
                       and e.block_size == BLOCK for e in cpu_stored)
            held = {h for h, _ in events.held[("CPU", None)]}
            scores = []
            for prompt in (FIRST, SECOND, THIRD):
                chain = block_chain(events.stored, prompt)
                chunk_hashes = chain[CHUNK // BLOCK - 1::CHUNK // BLOCK]
                hit = client.submit(RequestType.LOOKUP_CHUNKS, [model, 1, None, chunk_hashes]).result(10)
                scores.append((router_score(held, chain), hit * CHUNK))
            done = (len(cpu_stored) == 8 and len(cpu_removed) == 4 and len(held) == 4 * CHUNK // BLOCK
                    and all(router == daemon_hit for router, daemon_hit in scores))
            return done, f"router, LOOKUP {scores}; CPU: {len(cpu_stored)} stored, {len(cpu_removed)} removed"

        outcome = (False, "no filler round ran")
        for filler in range(FILLERS):  # each round's steps hand over the events of the evictions
            outcome = agree()
            if outcome[0]:
                break
            engine.round(3 + filler)
            (barrier / f"go-{4 + filler}").touch()
        assert outcome[0], outcome[1]
        for rest in range(4, 3 + FILLERS):
            (barrier / f"go-{rest}").touch()
        engine.finish()
    finally:
        client.close()
        engine.kill()
