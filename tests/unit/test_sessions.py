"""Sessions (`sessions.SessionTable`): what the daemon holds per request until END_SESSION or its TTL.

In process, with stand-in pool objects and a recording `unpin`: each test says what a request's
session holds (pins, last chunk, promotions in flight) after a sequence of calls, and which pins
went back to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmcache_mp.engine import sessions as sessions_module
from lmcache_mp.engine.sessions import SessionTable

TTL_S = 10.0


@dataclass(eq=False)
class Obj:
    """A pool object as the table sees one: its pool key."""

    key: tuple[bytes, bytes]


def obj(chunk: int, rank: int = 0) -> Obj:
    return Obj((bytes([chunk]), bytes([rank])))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(sessions_module, "time", clock)
    return clock


@pytest.fixture
def unpinned() -> list[Obj]:
    return []


@pytest.fixture
def table(unpinned: list[Obj], clock: Clock) -> SessionTable:
    return SessionTable(unpinned.extend, TTL_S)


def test_a_store_without_a_lease_is_remembered_for_the_next_store(table: SessionTable) -> None:
    table.remember("r", b"c1")
    assert table.last_chunk("r") == b"c1"
    assert table.counts() == (0, 0)  # not a lease session
    table.remember("r", b"c2")
    assert table.last_chunk("r") == b"c2"
    assert table.last_chunk("other") is None


def test_the_prefix_hint_expires_with_the_ttl_refreshed_by_each_lookup_and_store(
        table: SessionTable, clock: Clock) -> None:
    table.remember("r", b"c1")
    clock.now += TTL_S * 0.75
    table.lease("r", [obj(1)], b"c1")  # a LOOKUP refreshes it
    clock.now += TTL_S * 0.75
    table.remember("r", b"c2")  # a STORE too
    clock.now += TTL_S * 0.75
    assert table.expire() == 0
    assert table.last_chunk("r") == b"c2"
    clock.now += TTL_S * 0.5
    assert table.expire() == 1  # its lease goes with it
    assert table.last_chunk("r") is None
    assert table.counts() == (0, 0) and table.expired_total == 1


def test_end_session_forgets_everything_the_request_holds(table: SessionTable, unpinned: list[Obj]) -> None:
    held = [obj(1), obj(2)]
    table.lease("r", held, b"\x02")
    assert table.counts() == (1, 2)
    assert table.end("r") == 2
    assert unpinned == held
    assert table.last_chunk("r") is None and table.counts() == (0, 0)


def test_a_retrieve_spends_one_pin_per_occurrence_of_its_chunks(table: SessionTable,
                                                                unpinned: list[Obj]) -> None:
    """A replicated cache's ranks share one object, leased once per rank: each rank's RETRIEVE
    spends one pin."""
    shared = obj(1)
    table.lease("r", [shared, shared], b"\x01")
    assert table.release("r", [shared.key]) == 1
    assert table.counts() == (1, 1)
    assert table.release("r", [shared.key]) == 1
    assert unpinned == [shared, shared]
    assert table.counts() == (0, 0)
    assert table.last_chunk("r") == b"\x01"  # the hint outlives the leases


def test_release_chunks_drops_every_rank_and_release_all_keeps_the_hint(table: SessionTable) -> None:
    table.lease("r", [obj(1, 0), obj(1, 1), obj(2, 0), obj(2, 1)], b"\x02")
    assert table.release_chunks("r", [b"\x01"]) == 2
    assert table.counts() == (1, 2)
    assert table.release_all("r") == 2
    assert table.counts() == (0, 0)
    assert table.last_chunk("r") == b"\x02"


def test_a_promotion_leases_its_hits_unless_the_request_ended_meanwhile(table: SessionTable,
                                                                        unpinned: list[Obj]) -> None:
    hits = [obj(1), obj(2)]
    table.promoting("r")
    assert table.promoted("r", hits, b"\x02")
    assert table.counts() == (1, 2) and not unpinned

    late = [obj(3)]
    table.promoting("s")
    table.end("s")  # END_SESSION while its hits are read: nobody will retrieve them
    assert not table.promoted("s", late, b"\x03")
    assert unpinned == late
    assert table.counts() == (1, 2) and table.last_chunk("s") is None


def test_a_promotion_that_found_nothing_leaves_no_session(table: SessionTable) -> None:
    table.promoting("r")
    assert table.promoted("r", [], None)
    assert table.last_chunk("r") is None and table.counts() == (0, 0)
    table.promoting("r")
    assert table.end("r") == 0


def test_the_table_is_bounded_oldest_out(unpinned: list[Obj], clock: Clock) -> None:
    table = SessionTable(unpinned.extend, TTL_S, max_sessions=2)
    first = [obj(1)]
    table.lease("a", first, b"\x01")
    clock.now += 1
    table.remember("b", b"\x02")
    clock.now += 1
    table.lease("c", [obj(3)], b"\x03")
    assert unpinned == first
    assert table.last_chunk("a") is None
    assert table.last_chunk("b") == b"\x02" and table.counts() == (1, 1)
