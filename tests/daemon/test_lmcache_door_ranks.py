"""Tensor parallelism through the lmcache door: LMCache's registration does not say which rank a worker
is, its transfers' keys do. Two workers of a two-rank world, each on a client of its own (as each rank
of an engine is a process of its own), register with LMCache's own client; each chunk is stored once
per rank, with that rank's bytes, and loaded back into the same rank only; a LOOKUP finds a chunk only
once every rank holds it; a fresh engine's ranks find the chunks its predecessor's stored once they
have named their ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import LMCACHE_MISSING

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from tests.support.lmcache_peer import (
    TIMEOUT_S,
    Caches,
    door_fixture,  # noqa: F401 (a fixture)
    key,
    lookup,
    request_client,
)

WORLD = 2
BLOCKS = [[0, 1, 2, 3]]  # the prompt's 64 tokens: 2 chunks of 32


class Rank:
    """One worker of the world: its client (its process's), its caches, its instance."""

    def __init__(self, url: str, instance_id: int, rank: int):
        self.client = request_client(url)
        self.caches = Caches()
        self.instance_id, self.rank = instance_id, rank
        self.caches.register(self.client, instance_id, WORLD)

    def store(self, request_id: str, rank: int | None = None) -> tuple[bytes, bool]:
        worker = self.rank if rank is None else rank
        stored = self.client.store(key(request_id, worker, 0, 64, world_size=WORLD), self.instance_id,
                                   BLOCKS, b"")
        return stored.result(TIMEOUT_S)

    def retrieve(self, request_id: str, blocks: list[int]) -> tuple[bytes, bool]:
        loaded = self.client.retrieve(key(request_id, self.rank, 0, 64, world_size=WORLD), self.instance_id,
                                      [blocks], b"", 0)
        return loaded.result(TIMEOUT_S)

    def close(self) -> None:
        self.client.close()
        self.caches.close()


def _world(url: str, first_instance: int) -> list[Rank]:
    return [Rank(url, first_instance + rank, rank) for rank in range(WORLD)]


@pytest.fixture(name="ranks")
def ranks_fixture(door: tuple[DaemonProcess, str]) -> Iterator[list[Rank]]:
    made = _world(door[1], 51)
    yield made
    for rank in made:
        rank.close()


def _lookup(ranks: list[Rank], request_id: str) -> int:
    """The scheduler's lookup (rank 0's client: LMCache's scheduler sends its own)."""
    count = lookup(ranks[0].client, request_id, 64, world_size=WORLD)
    ranks[0].client.end_session(request_id).result(TIMEOUT_S)
    return count


def test_each_rank_stores_and_loads_its_own_bytes(door: tuple[DaemonProcess, str], ranks: list[Rank]) -> None:
    daemon, url = door
    for rank in ranks:
        rank.caches.fill(slice(0, 4), seed=10 + rank.rank)
    assert _lookup(ranks, "cold") == 0

    assert ranks[0].store("first") == (b"", True)
    assert _lookup(ranks, "half") == 0  # rank 1 holds nothing yet: no rank could load it all
    assert ranks[1].store("first") == (b"", True)
    assert _lookup(ranks, "both") == 2

    for rank in ranks:
        assert rank.retrieve("load", [8, 9, 10, 11]) == (b"", True)
        assert all(torch.equal(layer[8:12], layer[0:4]) for layer in rank.caches.layers)
    assert not torch.equal(ranks[0].caches.layers[0][8:12], ranks[1].caches.layers[0][8:12])

    # A transfer naming another rank than the one its instance was bound to: refused, nothing stored.
    assert ranks[0].store("wrong", rank=1) == (b"", False)
    assert "keys of worker 1 sent to the instance of worker 0" in daemon.log()

    # The engine goes; a fresh one (new instances): its ranks are bound by their first transfers, after
    # which the chunks its predecessor's ranks stored are its hits, each rank's own bytes.
    for rank in ranks:
        rank.client.unregister_kv_cache(rank.instance_id).result(TIMEOUT_S)
    fresh = _world(url, 61)
    try:
        assert _lookup(fresh, "unbound") == 0  # its ranks not named yet: a miss, never a guess
        for rank in fresh:
            assert rank.store("first") == (b"", True)  # present already: binds, stores nothing again
        assert _lookup(fresh, "fresh") == 2
        for old, new in zip(ranks, fresh, strict=True):
            assert new.retrieve("fresh-load", [4, 5, 6, 7]) == (b"", True)
            assert all(torch.equal(n[4:8], o[0:4]) for n, o in zip(new.caches.layers, old.caches.layers,
                                                                    strict=True))
    finally:
        for rank in fresh:
            rank.close()


def test_a_transfer_that_names_no_rank_is_refused(door: tuple[DaemonProcess, str], ranks: list[Rank]) -> None:
    """A rank is named by a transfer's key, within its world; until then the instance stays unbound."""
    for request_id, worker in (("none", None), ("beyond", WORLD + 3)):
        refused = ranks[1].client.store(key(request_id, worker, 0, 64, world_size=WORLD),
                                        ranks[1].instance_id, BLOCKS, b"")
        assert refused.result(TIMEOUT_S) == (b"", False)
    assert "its rank must be named, and within its world" in door[0].log()
    assert ranks[1].store("after") == (b"", True)  # bound now, as rank 1
