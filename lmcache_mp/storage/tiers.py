"""Lower tiers by URL (`--l2 URL`), and URLs made safe to print.

A tier's URL scheme picks its class; the class parses the rest (its module's docstring
lists the forms and parameters). A tier's module is imported only when a URL names it.

    disk:///ABSOLUTE/PATH?size_gb=N                     a local directory (`disk.py`)
    redis://, rediss://, redis+cluster://, rediss+cluster://
                                                        Valkey/Redis (`redis_tier.py`)
    lmcache://HOST:PORT                                 a v1 remote server (`v1_tier.py`)

`redact_url` is what logs, STATUS and /metrics show of a URL: the same URL with any password
(in the user-info part or a `password` query parameter) replaced by `***`.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from lmcache_mp.storage.base import StorageTier


def _disk(url: str) -> StorageTier:
    from lmcache_mp.storage.disk import DiskTier
    return DiskTier.from_url(url)


def _redis(url: str) -> StorageTier:
    from lmcache_mp.storage.redis_tier import RedisTier
    return RedisTier.from_url(url)


def _v1_remote(url: str) -> StorageTier:
    from lmcache_mp.storage.v1_tier import V1RemoteTier
    return V1RemoteTier.from_url(url)


_OPENERS: dict[str, Callable[[str], StorageTier]] = {
    "disk": _disk,
    "redis": _redis, "rediss": _redis, "redis+cluster": _redis, "rediss+cluster": _redis,
    "lmcache": _v1_remote,
}
_SECRET_PARAMS = frozenset({"password"})
_MASK = "***"


def open_tier(url: str) -> StorageTier:
    """The tier that `url` names; ValueError on an unsupported scheme or a bad URL."""
    scheme = urlsplit(url).scheme
    opener = _OPENERS.get(scheme)
    if opener is None:
        supported = ", ".join(f"{s}://" for s in sorted(_OPENERS))
        raise ValueError(f"unsupported storage tier URL {redact_url(url)!r}: "
                         f"the supported schemes are {supported}")
    return opener(url)


def redact_url(url: str) -> str:
    """`url` without its password; a URL too malformed to parse is not shown at all."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{_MASK}@{host}"
    query = parts.query
    params = parse_qsl(query, keep_blank_values=True)
    if any(name in _SECRET_PARAMS for name, _ in params):
        query = urlencode([(name, _MASK if name in _SECRET_PARAMS else value) for name, value in params],
                          safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # unchanged (urlunsplit would also drop the "//" of an empty netloc)
    return urlunsplit(parts._replace(netloc=netloc, query=query))
