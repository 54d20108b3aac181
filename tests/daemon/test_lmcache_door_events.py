"""LMCache's KV event stream through the lmcache door: LMCache's OWN client subscribes
(`subscribe_kv_events`, as its connector does when vLLM's KV events are on) and reads the pool's stores
and evictions in LMCache's names for the chunks (its own BLAKE3 token hasher's), with their tokens and
parents; a second subscription of the instance ends the first and replays what the log holds."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import LMCACHE_MISSING

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.v1.multiprocess.token_hasher import TokenHasher

from tests.support.lmcache_peer import (
    CHUNK,
    MODEL,
    TIMEOUT_S,
    Caches,
    caches_fixture,  # noqa: F401 (a fixture)
    client_frames,
    key,
    lookup,
    raw_request,
    request_client,
)

INSTANCE = 41
# Chunks of 8 KiB (2 layers x 2 blocks x 2 heads x 16 tokens x 32 x bf16): the pool holds ~37 of
# them, so 20 prompts of 2 chunks each evict the first prompts'.
POOL_GB = "0.0003"
PROMPTS = [[1000 * (p + 1) + t for t in range(2 * CHUNK)] for p in range(20)]


class Follower:
    """Reads a subscription's batches on a thread of its own, as LMCache's connector does."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.batches: queue.Queue[Any] = queue.Queue()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.stream:
                self.batches.put(batch)
        finally:
            self.ended.set()

    def next(self) -> Any:
        return self.batches.get(timeout=TIMEOUT_S)

    def events_until(self, done: Callable[[list[Any]], bool], what: str) -> list[Any]:
        """Every event read until `done(events so far)`, within the deadline."""
        events: list[Any] = []
        deadline = time.monotonic() + TIMEOUT_S
        while not done(events):
            left = deadline - time.monotonic()
            assert left > 0, f"no {what} within {TIMEOUT_S} s: {events}"
            try:
                batch = self.batches.get(timeout=left)
            except queue.Empty:
                continue
            assert batch.enabled and not batch.lost, batch
            events.extend(batch.events)
        return events

    def close(self) -> None:
        self.stream.close()
        self._thread.join(TIMEOUT_S)


@pytest.fixture(name="door")
def small_pool_door(daemons: Callable[..., DaemonProcess], short_tmp: Path) -> Iterator[str]:
    url = f"ipc://{short_tmp / 'lmcache.sock'}"
    # In anonymous memory: a pool file's sealer pins each new chunk a while, which on a busy machine
    # changes which prompt the evictions take (tests/unit/test_pool_file.py); this test names prompt 0.
    daemon = daemons("--lmcache-listen", url, "--chunk-size", str(CHUNK), "--l1-size-gb", POOL_GB,
                     "--pool-file", "")
    yield url
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log(), daemon.log()


def _store(client: Any, prompt: int) -> None:
    request = f"p{prompt}"
    stored = client.store(key(request, 0, 0, 2 * CHUNK, PROMPTS[prompt]), INSTANCE, [[0, 1, 2, 3]], b"")
    assert stored.result(TIMEOUT_S) == (b"", True)
    client.end_session(request).result(TIMEOUT_S)


def _names(prompt: int) -> list[bytes]:
    """LMCache's own names for a prompt's two chunks: its server's and its connector's hasher."""
    hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3")
    return hasher.compute_chunk_hashes(PROMPTS[prompt])


def test_a_subscriber_reads_the_pool_s_stores_and_evictions_in_lmcache_s_names(door: str,
                                                                               caches: Caches) -> None:
    client = request_client(door)
    try:
        assert client.get_experimental().result(TIMEOUT_S) == ["kv_event_stream"]
        caches.register(client, INSTANCE)
        follower = Follower(client.subscribe_kv_events(INSTANCE, MODEL, 0, 64))
        first = follower.next()  # at once, as LMCache's server answers a subscription
        assert first.enabled and not first.events and isinstance(first.incarnation, int)

        caches.fill(slice(0, 4), seed=1)
        _store(client, 0)
        stored = follower.events_until(lambda events: len(events) >= 2, "stored records")
        h0, h1 = _names(0)
        assert [(e.kind, e.medium, e.model_name, e.block_hashes, e.parent_block_hash, e.token_ids)
                for e in stored] == [("stored", "CPU", MODEL, [h0], None, PROMPTS[0][:CHUNK]),
                                     ("stored", "CPU", MODEL, [h1], h0, PROMPTS[0][CHUNK:])]
        assert stored[0].seq < stored[1].seq

        for prompt in range(1, len(PROMPTS)):  # the pool fills: the oldest chunks are evicted
            _store(client, prompt)
        named = {h: p for p in range(len(PROMPTS)) for h in _names(p)}
        # Every store's records, and so every eviction before the last store's.
        events = follower.events_until(lambda got: _count(got, "stored") == 2 * (len(PROMPTS) - 1), "stores")
        assert {h0, h1} <= _removed(events)
        assert all(e.medium == "CPU" and e.block_hashes[0] in named for e in events)
        assert lookup(client, "again", 2 * CHUNK, PROMPTS[0]) == 0  # what the events said
        held = {h for e in stored + events if e.kind == "stored" for h in e.block_hashes} - _removed(events)
        # What the events say is held, the lookups find: each prompt's leading chunks still held.
        for prompt in range(len(PROMPTS)):
            leading = next((i for i, h in enumerate(_names(prompt)) if h not in held), 2)
            assert lookup(client, f"held{prompt}", 2 * CHUNK, PROMPTS[prompt]) == leading, prompt

        # The instance subscribes again (its connector reconnecting): the first stream ends, the new one
        # replays the log from its start, evictions and all.
        again = Follower(client.subscribe_kv_events(INSTANCE, MODEL, 0, 1024))
        assert follower.ended.wait(TIMEOUT_S)
        replayed = again.events_until(lambda got: {h0, h1} <= _removed(got), "the replay")
        assert [e.seq for e in replayed] == sorted(e.seq for e in replayed)
        assert {(e.kind, e.block_hashes[0]) for e in stored + events} <= {(e.kind, e.block_hashes[0])
                                                                         for e in replayed}
        again.close()
    finally:
        client.close()


def _count(events: list[Any], kind: str) -> int:
    return sum(e.kind == kind for e in events)


def _removed(events: list[Any]) -> set[bytes]:
    return {h for e in events if e.kind == "removed" for h in e.block_hashes}


def test_a_subscription_the_door_cannot_serve_ends_at_once(door: str) -> None:
    """A page size LMCache's server refuses too: the batch that ends a subscription (its connector
    then reports its own stores), never silence; a stray control frame is answered as failed."""
    reply = raw_request(door, client_frames("subscribe_kv_events", INSTANCE, MODEL, 0, 0))
    batch = msgspec.msgpack.decode(reply[2])
    assert batch["enabled"] is False and batch["events"] == []
    stray = raw_request(door, [msgspec.msgpack.encode(5), b"", b"ack"])
    assert stray[0] == msgspec.msgpack.encode(5)
    assert b"no ack or cancel of an open KV event stream" in stray[1]
