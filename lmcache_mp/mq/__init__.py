"""ZeroMQ message queue: the daemon binds a ROUTER, every client connects a DEALER.

The daemon keeps one I/O thread that alone touches the ROUTER; handler threads hand it
replies through a deque and an eventfd doorbell. A client has no I/O thread: the thread
that waits for a reply drives the socket (see `MessageQueueClient`); a flusher thread only
sends what a client deferred (`submit_later`), when nothing else did soon enough.

    frames.py   the frames of a request and a reply, REQUEST_ID, `send_frames` / `recv_frames`
    codec.py    `Codec`: each request's payload and reply, typed by `protocol.PROTOCOL`
    client.py   `MessageQueueClient` and its `MessagingFuture` (what every client imports)
    server.py   `MessageQueueServer` (the daemon's)

The names below are re-exported, loaded on first use (PEP 562): a client that imports
`lmcache_mp.mq.client` loads frames, codec and client, never the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_mp.mq.client import (
        DEFAULT_REQUEST_TIMEOUT_S,
        LATER_FLUSH_S,
        MessageQueueClient,
        MessagingFuture,
    )
    from lmcache_mp.mq.codec import Codec
    from lmcache_mp.mq.frames import MAX_FRAME_BYTES, REQUEST_ID, recv_frames, send_frames
    from lmcache_mp.mq.server import MessageQueueServer

_HOME = {
    "REQUEST_ID": "frames", "MAX_FRAME_BYTES": "frames", "send_frames": "frames", "recv_frames": "frames",
    "Codec": "codec",
    "MessagingFuture": "client", "MessageQueueClient": "client", "LATER_FLUSH_S": "client",
    "DEFAULT_REQUEST_TIMEOUT_S": "client",
    "MessageQueueServer": "server",
}

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT_S", "LATER_FLUSH_S", "MAX_FRAME_BYTES", "REQUEST_ID", "Codec",
    "MessageQueueClient", "MessageQueueServer", "MessagingFuture", "recv_frames", "send_frames",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # looked up once
    return value
