"""Lower tiers by URL (`--l2 URL`).

A tier's URL scheme picks its class; the class parses the rest (its module's docstring
lists the forms and parameters). A tier's module is imported only when a URL names it.

    disk:///ABSOLUTE/PATH?size_gb=N                     a local directory (`disk.py`)
    redis://, rediss://, redis+cluster://, rediss+cluster://
                                                        Valkey/Redis (`tiers/redis.py`)
    lmcache://HOST:PORT                                 a v1 remote server (`tiers/v1.py`)
    s3://BUCKET[/PREFIX]?endpoint_url=...               an S3-compatible bucket (`tiers/s3.py`,
                                                        the [s3] extra)
    mooncake://MASTER_HOST:PORT[/PREFIX]?protocol=tcp   a Mooncake Store cluster (`tiers/mooncake.py`,
                                                        the [mooncake] extra)

A tier whose client is an extra (boto3, mooncake) imports it only when its URL is given; without the extra,
the URL is one clear error at start.

What logs, STATUS and /metrics show of a URL is `urls.redact_url`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from lmcache_mp.storage.tiers.base import StorageTier
from lmcache_mp.storage.tiers.urls import redact_url


def _disk(url: str) -> StorageTier:
    from lmcache_mp.storage.tiers.disk import DiskTier
    return DiskTier.from_url(url)


def _redis(url: str) -> StorageTier:
    from lmcache_mp.storage.tiers.redis import RedisTier
    return RedisTier.from_url(url)


def _v1_remote(url: str) -> StorageTier:
    from lmcache_mp.storage.tiers.v1 import V1RemoteTier
    return V1RemoteTier.from_url(url)


def _s3(url: str) -> StorageTier:
    with _extra("s3", url):
        from lmcache_mp.storage.tiers.s3 import S3Tier
    return S3Tier.from_url(url)


def _mooncake(url: str) -> StorageTier:
    with _extra("mooncake", url):
        from lmcache_mp.storage.tiers.mooncake import MooncakeTier
    return MooncakeTier.from_url(url)


@contextmanager
def _extra(extra: str, url: str) -> Iterator[None]:
    """Turn the import of a tier whose client is missing into one clear ValueError."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.startswith("lmcache_mp"):
            raise
        raise ValueError(f"{redact_url(url)!r} needs the [{extra}] extra ({e.name} is not installed): "
                         f"pip install 'lmcache-mp[{extra}]'") from None
    except ImportError as e:  # installed, but a system library it loads is not (libibverbs1)
        raise ValueError(f"{redact_url(url)!r}: the [{extra}] extra's client does not load ({e})") from None


_OPENERS: dict[str, Callable[[str], StorageTier]] = {
    "disk": _disk,
    "redis": _redis, "rediss": _redis, "redis+cluster": _redis, "rediss+cluster": _redis,
    "lmcache": _v1_remote,
    "s3": _s3,
    "mooncake": _mooncake,
}


def open_tier(url: str) -> StorageTier:
    """The tier that `url` names; ValueError on an unsupported scheme or a bad URL."""
    scheme = urlsplit(url).scheme
    opener = _OPENERS.get(scheme)
    if opener is None:
        supported = ", ".join(f"{s}://" for s in sorted(_OPENERS))
        raise ValueError(f"unsupported storage tier URL {redact_url(url)!r}: "
                         f"the supported schemes are {supported}")
    return opener(url)
