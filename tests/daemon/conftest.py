"""Fixtures of the daemon tests' own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.remote import NetworkTier


@pytest.fixture
def tier_at() -> Iterator[Callable[[str], NetworkTier]]:
    """tier_at(url): a network tier opened in this process, closed after the test."""
    opened: list[NetworkTier] = []

    def open_(url: str) -> NetworkTier:
        tier = open_tier(url)
        assert isinstance(tier, NetworkTier)
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close()
