"""Errors a client sees. A handler raises `ServerError` to answer with that code."""

from __future__ import annotations

import contextlib

from lmcache_mp.protocol import ErrorCode


class LMCacheMPError(Exception):
    """Base class of every error this package raises at a client."""


class ServerError(LMCacheMPError):
    """The daemon answered with an error reply."""

    def __init__(self, code: ErrorCode | int, message: str):
        with contextlib.suppress(ValueError):
            code = ErrorCode(code)
        self.code = code
        self.message = message
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"{name}: {message}")


class RequestTimeoutError(LMCacheMPError, TimeoutError):
    """No reply arrived in time (the daemon may be down, busy, or restarting)."""


class ClientClosedError(LMCacheMPError):
    """The client was closed while the request was pending."""


class ProtocolMismatchError(LMCacheMPError):
    """The daemon speaks another protocol version than this client."""


class FatalError(Exception):
    """The daemon cannot serve on: a device's copies failed with a CUDA error (sticky: every later
    copy on that device fails too) or never completed. The server answers the request that met it,
    refuses every later one, and the daemon exits non-zero, for its supervisor to restart it (a new
    process has a new CUDA context). Never sent to a client as such."""


class KVExportError(LMCacheMPError):
    """A worker's KV caches cannot be shared with the daemon (an allocation CUDA IPC cannot export,
    a dtype the daemon does not know, shared memory that cannot be had): KV offload stays off."""
