"""Hostile input on the lmcache door: 10,000 requests made from what LMCache's own client sends, then
mutated (bytes flipped, frames cut, dropped, added or swapped, other operations, values of the wrong
type, garbage), each answered while the daemon serves on and the chunks stored before stay exact; and
a pickled engine-driven payload, refused without being loaded."""

from __future__ import annotations

import pickle
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from lmcache_mp.lmcache_door import wire
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status
from tests.support.helpers import LMCACHE_MISSING

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import BlockAllocationRecord, RegisterEngineDrivenContextPayload
from lmcache.v1.multiprocess.group_view import EngineGroupInfo

from tests.support.lmcache_peer import (
    BLOCK,
    LAYERS,
    TIMEOUT_S,
    TOKENS,
    Caches,
    caches_fixture,  # noqa: F401 (a fixture)
    client_frames,
    door_fixture,  # noqa: F401 (a fixture)
    key,
    lmcache_client_fixture,  # noqa: F401 (a fixture)
    lookup,
)

REQUESTS = 10_000
INSTANCE = 41
ENGINE_DRIVEN = 9  # registered by the fuzz itself
STUB = b"stub_ipc_handle"  # a CPU worker's event handle


def _base_requests(caches: Caches) -> list[list[bytes]]:
    """One request of each kind LMCache's connector sends (and a few it may), as its client encodes
    them: the seeds the mutations start from."""
    other = [t + 7 for t in TOKENS]
    groups = [EngineGroupInfo(0, tuple(range(LAYERS)), BLOCK)]
    ours = key("e", 0, 0, 64)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("ping", (None,)), ("ping", (INSTANCE,)), ("get_chunk_size", ()), ("get_experimental", ()),
        ("noop", ()), ("lookup", (key("f", None, 0, 64), 1)), ("lookup", (key("g", None, 0, 64, other), 1)),
        ("query_prefetch_status", ("f",)), ("wait_prefetch_status", ("f", 0.01)),
        ("free_lookup_locks", (key("f", None, 32, 64), 1)), ("end_session", ("f",)),
        ("report_block_allocation", (99, "org/tiny", [BlockAllocationRecord("f", [3], [1, 2])])),
        ("store", (key("f", 0, 0, 64), INSTANCE, [[0, 1, 2, 3]], STUB)),
        ("store", (key("g", 0, 0, 64, other), INSTANCE, [[4, 5, 6, 7]], STUB)),
        ("retrieve", (key("f", 0, 0, 64), INSTANCE, [[8, 9, 10, 11]], STUB, 16)),
        ("unregister_kv_cache", (INSTANCE,)),
        ("register_kv_cache", (7, caches.wrappers, "org/tiny", 1, EngineType.VLLM, {}, groups)),
        ("commit_store", (key("f", 0, 0, 64), INSTANCE, b"\x80\x04N.")),
        ("prepare_store", (key("f", 0, 0, 64), INSTANCE)),
        ("prepare_retrieve", (key("f", 0, 0, 64), INSTANCE)),
        # An engine-driven registration of the fuzz's own connection, and its transfers.
        ("register_kv_cache_engine_driven_context", (RegisterEngineDrivenContextPayload(
            ENGINE_DRIVEN, "org/tiny", 1, BLOCK, LAYERS, 64, "bfloat16", True, 32),)),
        ("prepare_store", (ours, ENGINE_DRIVEN)), ("commit_store", (ours, ENGINE_DRIVEN, b"")),
        ("prepare_retrieve", (ours, ENGINE_DRIVEN)), ("commit_retrieve", (ours, ENGINE_DRIVEN)),
        ("unregister_kv_cache_engine_driven_context", (ENGINE_DRIVEN,)),
    ]
    return [client_frames(op, *args, uid=n) for n, (op, args) in enumerate(calls)]


WRONG_VALUES: list[Any] = [None, -1, 2**64 - 1, -(2**63), 1.5, "", "x" * 300, [], {}, [[]], [[-1, 2**40]],
                           {"model_name": 3}, b"\xff" * 40, True]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One mutation of `frames` (or none: the request as its client sends it)."""
    frames = list(frames)
    i = rng.randrange(len(frames))
    kind = rng.randrange(10)
    if kind == 0:
        pass
    elif kind == 1 and frames[i]:  # bytes flipped
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(data)
    elif kind == 2:  # a frame cut short
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    elif kind == 3 and len(frames) > 1:  # a frame dropped
        del frames[i]
    elif kind == 4:  # a frame added
        frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(24)))
    elif kind == 5 and len(frames) > 1:  # another operation, by id or by name
        frames[1] = msgspec.msgpack.encode(rng.choice([rng.randrange(-2, 70), 2**40, rng.randbytes(6).hex(),
                                                       rng.choice(sorted(wire.KNOWN_OPERATIONS))]))
    elif kind == 6:  # a value of the wrong type
        frames[i] = msgspec.msgpack.encode(rng.choice(WRONG_VALUES))
    elif kind == 7 and len(frames) > 3:  # two payload frames swapped
        a, b = rng.sample(range(2, len(frames)), 2)
        frames[a], frames[b] = frames[b], frames[a]
    elif kind == 8:  # garbage
        frames = [rng.randbytes(rng.randrange(40)) for _ in range(rng.randint(1, 6))]
    else:  # the request id
        frames[0] = rng.choice([b"", b"\xc1", msgspec.msgpack.encode(-5), rng.randbytes(9)])
    return frames


def _clears(frames: list[bytes]) -> bool:
    """Whether `frames` ask for CLEAR, which empties the pool by design: the fuzz sends none."""
    try:
        return len(frames) > 1 and wire.operation_name(frames[1]) == "clear"
    except ValueError:
        return False


def test_ten_thousand_hostile_requests_are_each_answered_and_stored_chunks_stay_exact(
        door: tuple[DaemonProcess, str], lmcache_client: Any, caches: Caches) -> None:
    daemon, url = door
    caches.register(lmcache_client, INSTANCE)
    caches.fill(slice(0, 4), seed=3)
    stored = [layer[0:4].clone() for layer in caches.layers]
    stores = lmcache_client.store(key("s", 0, 0, 64), INSTANCE, [[0, 1, 2, 3]], STUB)
    assert stores.result(TIMEOUT_S) == (b"", True)
    lmcache_client.end_session("s").result(TIMEOUT_S)

    rng = random.Random(41)
    seeds = _base_requests(caches)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    answered: Counter[str] = Counter()
    started = time.monotonic()
    try:
        sent = 0
        while sent < REQUESTS:
            frames = _mutate(rng, rng.choice(seeds))
            if _clears(frames):
                continue
            sock.send_multipart(frames)
            sent += 1
            assert sock.poll(TIMEOUT_S * 1000), f"request {sent} was not answered: {frames!r}"
            reply = sock.recv_multipart()
            assert reply[0] == frames[0], (frames, reply)  # its request id, echoed
            answered["failed" if _failed(frames, reply) else "served"] += 1
            assert sock.poll(0) == 0, f"request {sent} was answered twice: {frames!r}"
    finally:
        sock.close()
        context.term()
    elapsed = time.monotonic() - started

    assert daemon.proc.poll() is None
    assert sum(answered.values()) == REQUESTS, answered
    assert answered["served"] > 500 and answered["failed"] > 5000, answered
    assert lmcache_client.ping(INSTANCE).result(TIMEOUT_S) is True
    # What was stored before is read back exact, into blocks the fuzz never named.
    assert lookup(lmcache_client, "after", 64) == 2
    loaded = lmcache_client.retrieve(key("after", 0, 0, 64), INSTANCE, [[12, 13, 14, 15]], STUB, 0)
    assert loaded.result(TIMEOUT_S) == (b"", True)
    for layer, original in zip(caches.layers, stored, strict=True):
        assert torch.equal(layer[12:16], original)
    lmcache_client.end_session("after").result(TIMEOUT_S)
    report = daemon_status(daemon.url)
    assert report.pool_dropped_total == 0 and report.doors[1].requests_total >= REQUESTS
    print(f"{REQUESTS} hostile requests in {elapsed:.1f} s: {dict(answered)}; "
          f"{len(daemon.log().splitlines())} log lines")


def _failed(frames: list[bytes], reply: list[bytes]) -> bool:
    """Whether the reply reads as a failure to LMCache's client: another op frame, or a failure value."""
    if len(reply) < 2 or reply[1] != (frames[1] if len(frames) > 1 else b""):
        return True
    return len(reply) > 2 and msgspec.msgpack.decode(reply[2]) in ([b"", False], False, 0)


class _Marker:
    """A pickle that, if loaded, creates `path`: the proof that it was."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.path), "w")


def test_a_pickled_engine_driven_payload_is_refused_never_loaded(door: tuple[DaemonProcess, str],
                                                                 lmcache_client: Any, caches: Caches,
                                                                 tmp_path: Path) -> None:
    daemon, _ = door
    caches.register(lmcache_client, INSTANCE)
    marker = tmp_path / "unpickled"
    payload = pickle.dumps([_Marker(marker), torch.zeros(4)])
    committed = lmcache_client.commit_store(key("p", 0, 0, 64), INSTANCE, payload)
    assert committed.result(TIMEOUT_S) is False  # its failure value
    assert not marker.exists()
    assert "pickled tensors, which this daemon never loads" in daemon.log()
    assert lookup(lmcache_client, "p2", 64) == 0  # nothing of it stored
    assert daemon.proc.poll() is None
