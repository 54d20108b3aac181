"""The capacity advisor (`engine/capacity_advisor.py`): its predicted hit rates against an LRU cache
simulated access by access, exactly while it samples every chunk and within a few points once it
samples, with its memory bounded however many chunks it sees."""

from __future__ import annotations

import hashlib
import random
import threading
import tracemalloc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.cli.status_text import render_status
from lmcache_mp.engine.capacity_advisor import MAX_SAMPLED_PER_LOOKUP, MAX_TRACKED, SCALES, CapacityAdvisor
from lmcache_mp.protocol import CapacityPoint, StatusReport
from tests.support.helpers import conversation_trace


def lru_hit_rate(lookups: list[list[bytes]], capacity: int) -> float:
    """Chunks hit over chunks looked up by an LRU cache of `capacity` chunks, as the daemon's pool
    runs one: a LOOKUP finds the chunks there, then every chunk it asked for is there (vLLM stores
    the missing ones), the first the most recently used, the last the least."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for chain in lookups:
        total += len(chain)
        hits += sum(chunk in cache for chunk in chain)
        for chunk in reversed(chain):
            cache[chunk] = None
            cache.move_to_end(chunk)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / total


def recorded(lookups: list[list[bytes]], max_tracked: int = MAX_TRACKED,
             per_lookup: float | None = None) -> CapacityAdvisor:
    """An advisor that saw `lookups`: by default bound by its memory alone (exact until it tracks
    `max_tracked` chunks), not by the time a LOOKUP may take (`per_lookup`)."""
    advisor = CapacityAdvisor(max_tracked, max_sampled_per_lookup=per_lookup)
    for chain in lookups:
        advisor.record(chain, 1)
    return advisor


def chain(tokens: list[int]) -> list[bytes]:
    """The chunk hashes of a prompt of these chunk "tokens": each names its whole prefix, so two
    prompts share exactly the chunks of their common prefix."""
    return [hashlib.blake2b(bytes(tokens[: i + 1]), digest_size=32).digest() for i in range(len(tokens))]


def test_exact_while_every_chunk_is_sampled() -> None:
    lookups = [chain(t) for t in ([1, 2], [1, 3], [1, 2], [4], [1, 2, 5], [1, 3])]
    advisor = recorded(lookups)
    assert advisor.rate == 1.0 and advisor.sampled == 12
    for capacity in range(0, 8):
        assert advisor.hit_rate(capacity) == pytest.approx(lru_hit_rate(lookups, capacity)), capacity
    # One chunk: [1], but not right after [4]; two: [1] each time but the first; three: [1, 2]
    # too, as the prefix of [1, 2, 5]; five: every chunk but at its first LOOKUP.
    assert [advisor.hit_rate(c) for c in (1, 2, 3, 5)] == [3 / 12, 4 / 12, 6 / 12, 7 / 12]


def test_exact_on_a_conversation_trace() -> None:
    lookups = conversation_trace(30, 400, seed=3)
    advisor = recorded(lookups)
    assert advisor.rate == 1.0
    for capacity in (1, 5, 20, 50, 100, 127):
        assert advisor.hit_rate(capacity) == pytest.approx(lru_hit_rate(lookups, capacity)), capacity
    # Above 128 chunks a bucket spans several distances: within a point.
    for capacity in (150, 300, 600):
        assert advisor.hit_rate(capacity) == pytest.approx(lru_hit_rate(lookups, capacity), abs=0.01)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=40),
       st.integers(1, 60))
def test_exact_on_any_small_trace(prompts: list[list[int]], capacity: int) -> None:
    lookups = [chain(tokens) for tokens in prompts]
    assert recorded(lookups).hit_rate(capacity) == pytest.approx(lru_hit_rate(lookups, capacity))


@pytest.mark.parametrize("max_tracked", [MAX_TRACKED, 2048])
def test_sampled_within_a_few_points_of_exact(max_tracked: int) -> None:
    lookups = conversation_trace(8000, 6000, seed=7, turn_chunks=4, max_chunks=16, zipf=0.6)
    accesses = sum(map(len, lookups))
    distinct = len({chunk for chain in lookups for chunk in chain})
    assert 45_000 < accesses < 60_000 and distinct > 2.5 * MAX_TRACKED, (accesses, distinct)
    sampled = recorded(lookups, max_tracked)
    assert sampled.rate < 0.4 and sampled.tracked == max_tracked
    for capacity in (500, 2000, 5000, 10_000, 20_000):
        exact = lru_hit_rate(lookups, capacity)
        assert sampled.hit_rate(capacity) == pytest.approx(exact, abs=0.03), capacity


def test_long_lookups_sample_a_few_chunks_each_and_stay_within_a_point() -> None:
    """The daemon's default: about MAX_SAMPLED_PER_LOOKUP chunks of a LOOKUP are sampled however
    long it is (its time on the socket thread), yet the curve stays within a point of exact."""
    lookups = conversation_trace(300, 3000, seed=9, turn_chunks=16, max_chunks=128, zipf=0.8)
    accesses = sum(map(len, lookups))
    advisor = recorded(lookups, per_lookup=MAX_SAMPLED_PER_LOOKUP)
    assert accesses / len(lookups) > 50 and advisor.sampled < 1.5 * MAX_SAMPLED_PER_LOOKUP * len(lookups)
    distinct = len({chunk for chain in lookups for chunk in chain})
    for capacity in (distinct // 16, distinct // 4, distinct):
        assert advisor.hit_rate(capacity) == pytest.approx(lru_hit_rate(lookups, capacity), abs=0.015)


def test_memory_stays_bounded_under_a_million_distinct_chunks() -> None:
    rng = random.Random(5)
    tracemalloc.start()
    try:
        advisor = CapacityAdvisor(max_sampled_per_lookup=None)  # the memory bound alone
        for _ in range(1_000_000 // 50):
            advisor.record([rng.randbytes(32) for _ in range(50)], 1)
            assert advisor.tracked <= MAX_TRACKED
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 3 << 20, f"{held} bytes held after 1M distinct chunks"  # about 2 MiB
    # The rate fell to what the sampled set holds of the distinct chunks seen, no lower.
    assert advisor.rate * 1_000_000 == pytest.approx(MAX_TRACKED, rel=0.05)
    assert advisor.hit_rate(10**9) < 0.01  # every access was a first one


def test_curve_converts_bytes_to_chunks_with_the_lookups_chunk_bytes() -> None:
    lookups = conversation_trace(30, 400, seed=3)
    advisor = CapacityAdvisor()
    assert advisor.curve(1 << 20) == [CapacityPoint(s, round(s * (1 << 20)), 0.0) for s in SCALES]
    for chain in lookups:
        advisor.record(chain, 4096)  # e.g. two ranks of 2 KiB
    curve = advisor.curve(40 * 4096)  # a pool of 40 such chunks
    assert [p.pool_scale for p in curve] == list(SCALES)
    assert [p.pool_bytes for p in curve] == [20 * 4096, 40 * 4096, 80 * 4096, 160 * 4096, 320 * 4096]
    for point in curve:
        assert point.hit_rate == pytest.approx(advisor.hit_rate(point.pool_bytes // 4096))
    assert curve[0].hit_rate < curve[1].hit_rate < curve[2].hit_rate


def test_lookups_recorded_while_the_curve_is_read() -> None:
    lookups = conversation_trace(200, 2000, seed=11)
    advisor = CapacityAdvisor(max_tracked=256)  # lowering the rate while the curve is read
    halves = [lookups[0::2], lookups[1::2]]
    recorders = [threading.Thread(target=lambda part=part: [advisor.record(c, 1) for c in part])
                 for part in halves]
    for thread in recorders:
        thread.start()
    while any(thread.is_alive() for thread in recorders):
        rates = [p.hit_rate for p in advisor.curve(1000)]
        assert rates == sorted(rates) and rates[0] >= 0 and rates[-1] <= 1
    for thread in recorders:
        thread.join()
    assert advisor.sampled >= 256 and advisor.tracked <= 256


def test_status_shows_the_curve_on_one_line() -> None:
    base = StatusReport("0.1.0", 3, 1.5, 256, ["ipc:///x"])
    assert "capacity  no lookups yet" in render_status("ipc:///x", base)
    curve = [CapacityPoint(s, int(s * 2**30), r) for s, r in zip(SCALES, (0.12, 0.4, 0.61, 0.7, 0.7),
                                                                 strict=True)]
    shown = render_status("ipc:///x", StatusReport("0.1.0", 3, 1.5, 256, ["ipc:///x"], capacity_curve=curve,
                                                   capacity_sampled_chunks=1234))
    assert ("capacity  predicted pool hit rate at 0.5x 12% | 1x 40% | 2x 61% | 4x 70% | 8x 70% "
            "(1,234 chunk lookups sampled)") in shown, shown
