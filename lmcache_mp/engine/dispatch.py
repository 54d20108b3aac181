"""The handler contract: what a request's handler may return, and what it knows of its request.

`Engine.handlers()` binds each request type to its handler; `protocol.PROTOCOL` says where each
runs (`HandlerKind`); `server.py` runs them. A handler is called with the request's decoded
payload arguments and returns one of:
- its reply value, sent at once;
- a `Future` of it (DEFERRED handlers): the reply goes out when it completes;
- a `ReplyThen` (socket-thread handlers): the reply at once, then bookkeeping before the next
  request is read.

The server sets two context variables around every handler call, on the thread that runs it,
so that the daemon's core can order and attribute work without a parameter on every handler:
- `ARRIVAL`: the request's position in the order the server read requests (from 1; 0, unset,
  is before everything). CANCEL_TRANSFERS orders operations by it (`engine/cancellation.py`); a
  RETRIEVE split over helper threads hands it to them (`transfer/threads.py`).
- `PEER`: the connection it came on (its ZeroMQ routing id; b"" outside a server, as in
  in-process use). A registration belongs to the connection that made it: only that connection
  may cancel its transfers or unregister it (`registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

ARRIVAL: ContextVar[int] = ContextVar("lmcache_mp_request_arrival", default=0)
PEER: ContextVar[bytes] = ContextVar("lmcache_mp_request_peer", default=b"")


@dataclass(frozen=True, slots=True)
class ReplyThen:
    """A socket-thread handler's answer, sent at once, and bookkeeping that the socket thread
    runs right after sending it, before it reads the next request (so every later request sees
    its effect). It takes work off the round trip the client waits on: a LOOKUP's leases are
    taken with its prefix walk, and only recorded here."""

    result: Any
    then: Callable[[], None]


# A request's handler: its payload arguments in, its reply (or a Future of it, or a ReplyThen) out.
Handler = Callable[..., Any | Future[Any] | ReplyThen]
