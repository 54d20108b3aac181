"""The request a handler is running for, as the handler sees it.

The server sets both around every handler call (`server.py`), on the thread that runs it, so
that the daemon's core can order and attribute work without a parameter on every handler:
- `ARRIVAL`: the request's position in the order the server read requests (from 1; 0, unset,
  is before everything). CANCEL_TRANSFERS orders operations by it (`cancellation.py`).
- `PEER`: the connection it came on (its ZeroMQ routing id; b"" outside a server, as in
  in-process use). A registration belongs to the connection that made it: only that connection
  may cancel its transfers or unregister it (`registry.py`).
"""

from __future__ import annotations

from contextvars import ContextVar

ARRIVAL: ContextVar[int] = ContextVar("lmcache_mp_request_arrival", default=0)
PEER: ContextVar[bytes] = ContextVar("lmcache_mp_request_peer", default=b"")
