"""A low-level client for the v1 remote protocol: one blocking TCP connection.

`V1Connection` talks to LMCache's `lmcache_server` or to our `RemoteServer` (see `protocol.py` for
the format). Batches are pipelined: up to `PIPELINE_WINDOW` requests are sent ahead of the replies
read, which hides round trips without letting either side's socket buffers fill up and deadlock
(headers are small; the window keeps what is in flight well under any receive buffer).

Failure model: any socket error, timeout, short read or malformed server header raises
`V1ConnectionError` (a `ConnectionError`, hence `OSError`) and closes the connection for good, since
the byte stream can no longer be trusted to be in step; the caller opens a new one. Argument errors
(bad keys, unusable buffers) raise `ValueError`/`ProtocolError` before anything is sent and leave the
connection usable. Not thread-safe: one connection per thread.

Servers close idle connections (ours after `--idle-timeout-s`). A pooled connection may have been
closed that way: `peer_closed()` tells it cheaply before use, and `V1PeerClosedError` (with
`replies`) tells a caller that an operation failed because the server had closed the connection,
which it may then retry once on a new one.

What comes back is untrusted bytes (the protocol has no checksum or authentication): check it, e.g.
with a checksum inside the payload, before use.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from lmcache_mp.v1remote.protocol import (
    HEALTH_KEY,
    SERVER_HEADER_SIZE,
    Buffer,
    ClientCommand,
    ClientMetaMessage,
    MemoryFormat,
    ProtocolError,
    ServerMetaMessage,
    ServerReturnCode,
    WireDtype,
    byte_view,
    recv_exact_into,
    send_all,
)

PIPELINE_WINDOW = 64  # requests in flight at most (64 x 186 header bytes = 12 KiB)
_DRAIN_CHUNK = 1 << 20


class V1ConnectionError(ConnectionError):
    """The connection failed or the server broke the protocol; the connection is closed."""


class V1PeerClosedError(V1ConnectionError):
    """The server had closed (or reset) the connection: end of stream, or a broken pipe or reset.
    Not a timeout, nor a protocol error. If `replies` did not move during the operation, the server
    answered none of it: typically a connection it closed while it sat idle."""


class V1Connection:
    """One TCP connection to a v1 remote server; every operation times out after `timeout_s`."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as err:
            raise V1ConnectionError(f"cannot connect to {self.peer}: {err}") from err
        self._sock: socket.socket | None = sock
        self._reply = bytearray(SERVER_HEADER_SIZE)
        self.replies = 0  # reply headers received so far (see V1PeerClosedError)

    # --- requests -------------------------------------------------------------------------------

    def health(self) -> bool:
        """True if the server answers HEALTH with SUCCESS."""
        header = ClientMetaMessage(ClientCommand.HEALTH, HEALTH_KEY).serialize()
        with self._io("HEALTH") as sock:
            sock.sendall(header)
            return self._read_reply(sock).code is ServerReturnCode.SUCCESS

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the server holds each key (pipelined EXISTs)."""
        headers = [ClientMetaMessage(ClientCommand.EXIST, key).serialize() for key in keys]
        found: list[bool] = []
        with self._io("EXIST") as sock:
            for _ in self._pipelined(sock, headers):
                found.append(self._read_reply(sock).code is ServerReturnCode.SUCCESS)
        return found

    def get_into_many(self, keys: Sequence[str], buffers: Sequence[Sequence[Buffer]],
                      on_received: Callable[[int], None] | None = None) -> list[int | None]:
        """Pipelined GETs; each hit's payload lands directly (recv_into) in its key's buffers, in
        order, if its length equals their total size. Per key: None for a miss, else the hit's
        length; a hit of another length than its buffers' is drained, never written (fail closed):
        the caller tells it by the length. `on_received(i)` runs as soon as key i's payload has
        landed, while the server sends the next ones (e.g. to checksum it while it is in cache).

        If this raises, some buffers may hold part of a payload: treat them all as garbage."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists")
        views = [[_writable(b) for b in bufs] for bufs in buffers]
        sizes = [sum(len(v) for v in vs) for vs in views]
        headers = [ClientMetaMessage(ClientCommand.GET, key).serialize() for key in keys]
        lengths: list[int | None] = []
        with self._io("GET") as sock:
            for i in self._pipelined(sock, headers):
                reply = self._read_reply(sock)
                if reply.code is not ServerReturnCode.SUCCESS:
                    lengths.append(None)
                elif reply.length != sizes[i]:
                    _drain(sock, reply.length)
                    lengths.append(reply.length)
                else:
                    for view in views[i]:
                        _recv_exact(sock, view, "GET payload")
                    lengths.append(reply.length)
                    if on_received is not None:
                        on_received(i)
        return lengths

    def put(self, key: str, buffers: Sequence[Buffer], fmt: int = MemoryFormat.BINARY,
            dtype: int = WireDtype.UINT8, shape: Sequence[int] | None = None, location: int = 0) -> None:
        """PUT the concatenation of `buffers` under `key`, sent with gathered writes (no copy).

        `shape` defaults to [nbytes] (right for BINARY). The protocol sends no reply, so a PUT the
        server dropped (ours drops ones that do not fit) shows only as a later miss; a server that
        closed the connection shows as an error on a later request."""
        views = [byte_view(b) for b in buffers]
        length = sum(len(v) for v in views)
        header = ClientMetaMessage(ClientCommand.PUT, key, length, fmt, dtype,
                                   [length] if shape is None else shape, location).serialize()
        with self._io("PUT") as sock:
            send_all(sock, [header, *views])

    def list_keys(self) -> list[str]:
        """Every key the server holds (LIST). Only our own `RemoteServer` answers LIST: a reference
        `lmcache_server` never replies, so this would time out (and close the connection) there.
        Do not rely on it for anything but tools and tests."""
        header = ClientMetaMessage(ClientCommand.LIST, HEALTH_KEY).serialize()
        with self._io("LIST") as sock:
            sock.sendall(header)
            reply = self._read_reply(sock)
            if reply.code is not ServerReturnCode.SUCCESS:
                raise ProtocolError(f"LIST answered with {reply.code.name}")
            listing = bytearray(reply.length)
            _recv_exact(sock, memoryview(listing), "LIST payload")
            try:
                text = listing.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ProtocolError(f"LIST payload is not UTF-8: {err}") from err
        return text.split("\n") if text else []

    # --- plumbing -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock is None

    def peer_closed(self) -> bool:
        """Whether this idle connection is unusable (and now closed): a zero-wait poll(). A server
        sends only replies, and every operation reads its replies in full, so an idle connection
        that polls readable has hit end of stream (the server closed it), an error, or bytes
        nobody asked for (the stream is out of step): each one means it cannot be used."""
        if self._sock is None:
            return True
        poller = select.poll()  # not select(): it cannot watch descriptors >= FD_SETSIZE
        poller.register(self._sock, select.POLLIN | select.POLLPRI)
        try:
            ready = bool(poller.poll(0))
        except OSError:
            ready = True
        if ready:
            self.close()
        return ready

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> V1Connection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @contextmanager
    def _io(self, what: str) -> Iterator[socket.socket]:
        """The socket for one operation; any failure inside closes the connection for good."""
        if self._sock is None:
            raise V1ConnectionError(f"the connection to {self.peer} is closed")
        try:
            yield self._sock
        except V1ConnectionError:
            self.close()
            raise
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as err:
            self.close()
            raise V1PeerClosedError(f"{what} with {self.peer} failed, the server closed the connection: "
                                    f"{err!r}") from err
        except (OSError, ProtocolError) as err:
            self.close()
            raise V1ConnectionError(f"{what} with {self.peer} failed, connection closed: {err!r}") from err

    def _pipelined(self, sock: socket.socket, headers: list[bytes]) -> Iterator[int]:
        """Yield i when reply i is to be read, having sent requests up to PIPELINE_WINDOW ahead
        (topped up in half-window batches, so one send carries many headers)."""
        sent, total = 0, len(headers)
        for i in range(total):
            if sent < total and sent - i <= PIPELINE_WINDOW // 2:
                end = min(total, i + PIPELINE_WINDOW)
                sock.sendall(b"".join(headers[sent:end]))
                sent = end
            yield i

    def _read_reply(self, sock: socket.socket) -> ServerMetaMessage:
        _recv_exact(sock, memoryview(self._reply), "reply header")
        self.replies += 1  # counted once received whole: a malformed one closes the connection anyway
        reply = ServerMetaMessage.deserialize(self._reply)
        if reply.code is ServerReturnCode.FAIL and reply.length:
            # The reference never sends a payload with FAIL: the stream is out of step.
            raise ProtocolError(f"FAIL reply announcing {reply.length} payload bytes")
        return reply


def _writable(buffer: Buffer) -> memoryview:
    view = byte_view(buffer)
    if view.readonly:
        raise ValueError("get_into_many needs writable buffers")
    return view


def _recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    got = recv_exact_into(sock, view)
    if got < len(view):
        raise V1PeerClosedError(f"the server closed the connection after {got} of {len(view)} {what} bytes")


def _drain(sock: socket.socket, length: int) -> None:
    scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
    while length:
        want = min(length, len(scratch))
        _recv_exact(sock, scratch[:want], "payload")
        length -= want
