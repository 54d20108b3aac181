"""A request's own connector settings, from its `kv_transfer_params`.

The OpenAI API's completion and chat requests carry `kv_transfer_params` (offline:
`SamplingParams(extra_args={"kv_transfer_params": ...})`). The keys below are declared once:
`RequestParams.of` reads them and docs/vllm.md's table of them is generated from the same
declaration (`lmcache_mp.settings.markdown_table(RequestParams, "lmcache.mp.")`).

A request is one user's: a bad value must not fail it, nor the engine. It is ignored, with one
warning naming the request, the key and the value, and the default applies.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_mp.settings import setting

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PREFIX = "lmcache.mp."
# vLLM's native offloading (OffloadingConnector) reads the limits under these bare names: a request
# written for it keeps its limits here. Our own, prefixed name wins where both are given.
NATIVE_NAMES = frozenset({"max_load_tokens", "max_offload_tokens"})


@dataclass(frozen=True)
class RequestParams:
    skip_load: bool = setting(False, "true: neither look this request up nor load it")
    skip_save: bool = setting(
        False, "true: store nothing of this request (a one-off prompt that would only churn the cache)")
    max_load_tokens: int | None = setting(
        None, "a load covers at most this many tokens past vLLM's own prefix hit (rounded down to whole "
        "chunks; also read as `max_load_tokens`, vLLM's native offloading's name); 0 loads nothing")
    max_offload_tokens: int | None = setting(
        None, "stores cover at most the request's first this many tokens (whole chunks, and its tail "
        "up to that token; also read as `max_offload_tokens`); 0 stores nothing")

    @classmethod
    def of(cls, request: Request) -> RequestParams:
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return cls()
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            key = PREFIX + field.name
            if key not in params and field.name in NATIVE_NAMES:
                key = field.name
            if params.get(key) is None:
                continue
            value = params[key]
            if _valid(field.default, value):
                values[field.name] = value
            else:
                logger.warning("request %s: kv_transfer_params %s=%r is not %s; ignored", request.request_id,
                               key, value, "true or false" if field.default is False else "an integer >= 0")
        return cls(**values)


def _valid(default: Any, value: Any) -> bool:
    if default is False:
        return isinstance(value, bool)
    return type(value) is int and value >= 0  # bool is an int subclass: refused
