"""Tier URLs made safe to print, and their parameters checked.

`redact_url` is what logs, STATUS and /metrics show of a URL: the same URL with any password (in
the user-info part, or a `password` or secret key query parameter) replaced by `***`. A leaf: the
tiers' modules and the opener (`tiers.py`) import it, and it imports none of them. `query_params`
is a URL's query as a dict, refused when it names a parameter its tier does not take.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# Secrets a URL should never carry (an S3 URL refuses them) and must never show when it does.
_SECRET_PARAMS = frozenset({"password", "aws_secret_access_key", "secret_access_key", "secret_key",
                            "aws_session_token", "session_token"})
_MASK = "***"


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


def query_params(url: str, known: frozenset[str], what: str) -> dict[str, str]:
    """`url`'s query parameters; ValueError (with the URL redacted) naming those not in `known`.
    `what`: the URL's kind as the message names it ("an S3 URL")."""
    params = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{redact_url(url)!r}: unknown parameter(s) {', '.join(unknown)} "
                         f"({what} takes {', '.join(sorted(known))})")
    return params

