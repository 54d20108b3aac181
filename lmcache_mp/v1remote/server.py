"""A standalone server for the v1 remote protocol, with a bounded in-memory LRU store.

It speaks the wire format of LMCache's `lmcache_server` (see `protocol.py`), so LMCache's remote
clients and our `V1Connection` can use it, and adds what the reference lacks:

- a size bound: objects live in memory up to `capacity_bytes`; a PUT evicts least-recently-used
  objects (GET counts as a use, EXIST does not) to make room *before* its payload is received, so
  stored plus in-flight payloads never exceed the bound. A PUT that cannot fit (larger than the
  capacity, or crowded out by other connections' in-flight PUTs) is read and discarded: PUT has no
  reply, so the client finds out only by a later GET miss, which it must handle anyway;
- LIST: a 200 header with length N, fmt BINARY, dtype uint8, shape [N, 0, 0, 0], followed by N bytes:
  the stored keys, least recently used first, UTF-8, joined by "\\n", cut at a key boundary at
  `MAX_LIST_BYTES`;
- robustness: a malformed header (unknown command, unparseable key, negative length, a PUT over
  `MAX_PUT_BYTES`) or a connection closed mid-message closes that connection only, logged once with
  the peer. Well-formed requests are always answered (PUT never is, per the protocol);
- timeouts: a connection that sends no request for `idle_timeout_s` is closed, and so is one whose
  message (a request's header and payload in, or a reply out) is not done within `idle_timeout_s`
  plus its size at `MIN_BYTES_PER_S`: forgotten, dead or stalled clients cannot keep the
  `max_connections` slots from the clients that want them;
- shares: one host holds at most `max_connections_per_host` of them (a quarter by default), so a
  client that keeps its connections busy enough to pass the idle timeout still leaves the other
  hosts theirs. A host is a peer's IPv4 address, or its IPv6 /64 (one host usually has a whole
  one). (On loopback every local client is one host, unless it binds another address of 127/8;
  and the protocol has no authentication to tell apart the clients of one host.)

Design: one listening socket (selector loop in `serve_forever`), one thread per connection with
blocking sockets, at most `max_connections` at once, `max_connections_per_host` of one host (more
are accepted and closed at once). The selector loop is also the watchdog: each connection keeps the
deadline of what it waits for, and the loop shuts overdue sockets down, which wakes their threads
(no socket timeouts, so the hot path pays no syscall for them). The store (`store.py`) is an
OrderedDict under one lock; payloads are received straight into their own buffer (`recv_into`) and
sent back with header and payload gathered by `sendmsg`, never concatenated.

There is no authentication, encryption or checksum: anyone who can reach the port can read,
overwrite and fill the store. Hence loopback by default (`parse_listen_url`).
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from lmcache_mp.v1remote.protocol import (
    CLIENT_HEADER_SIZE,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PORT,
    ClientCommand,
    ClientMetaMessage,
    MemoryFormat,
    ProtocolError,
    ServerMetaMessage,
    ServerReturnCode,
    WireDtype,
    recv_exact_into,
    send_all,
)
from lmcache_mp.v1remote.store import Entry, LRUStore

logger = logging.getLogger("lmcache_mp.v1remote.server")

# A PUT announcing more than this closes its connection instead of being read: no KV chunk is
# this large, and reading (to discard) up to 2 GiB per bogus header would be an easy way to waste us.
MAX_PUT_BYTES = 1 << 30
DEFAULT_IDLE_TIMEOUT_S = 60.0
# A message must move at least this fast (on top of the idle timeout): slow enough for any real
# network, fast enough that a peer trickling a 1 GiB PUT loses its slot within ~18 minutes.
MIN_BYTES_PER_S = 1 << 20
MAX_LIST_BYTES = 16 << 20  # LIST replies are cut (at a key boundary) beyond this
_DRAIN_CHUNK = 1 << 20

_FAIL = ServerMetaMessage.status(ServerReturnCode.FAIL).serialize()
_SUCCESS = ServerMetaMessage.status(ServerReturnCode.SUCCESS).serialize()


def parse_listen_url(url: str, allow_remote: bool) -> tuple[str, int]:
    """(host, port) of `tcp://HOST:PORT`; ValueError for other URLs, and for a non-loopback host
    unless `allow_remote` (the protocol has no authentication)."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as err:  # a port that is not a number, or out of range
        raise ValueError(f"bad listen URL {url!r}: {err}") from None
    if parts.scheme != "tcp" or not host or port is None:
        raise ValueError(f"bad listen URL {url!r}: use tcp://HOST:PORT")
    if allow_remote or host == "localhost":
        return host, port
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may resolve to anything
    if not loopback:
        raise ValueError(
            f"refusing to listen on {url}: {host} is not a loopback address. The v1 remote protocol "
            "has no authentication: anyone who can reach the port can read, overwrite and fill the "
            "store. Pass --allow-remote to listen there anyway (on a trusted network only)."
        )
    return host, port


class _PeerClosed(Exception):
    """The peer closed its connection in the middle of a message."""


def peer_host(address: str) -> str:
    """The host a peer's address belongs to, as connection shares count it: an IPv4 address
    (one mapped into IPv6 included), or an IPv6 address's /64."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # without an IPv6 zone
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(slots=True, eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    host: str  # `peer_host`: whose share it counts in
    # Monotonic time by which what the connection waits for must be done: the next request's
    # header while idle, the current message while busy. Written by its thread, read by the
    # watchdog in `serve_forever` (a float assignment: atomic under the GIL).
    deadline: float
    thread: threading.Thread | None = None
    timed_out: bool = False  # the watchdog shut it down


class RemoteServer:
    """The v1 remote server. Binds in the constructor (port 0 picks a free port: see `address`);
    `serve_forever()` accepts connections until `stop()`; `close()` stops and closes everything."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, capacity_bytes: int,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_connections_per_host: int | None = None,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> None:
        """`max_connections_per_host`: one host's share of `max_connections` (None: a quarter)."""
        if capacity_bytes <= 0:
            raise ValueError(f"the capacity must be positive, not {capacity_bytes}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        if max_connections_per_host is None:
            max_connections_per_host = max(1, max_connections // 4)
        if max_connections_per_host < 1:
            raise ValueError(f"max_connections_per_host must be at least 1, not {max_connections_per_host}")
        if not idle_timeout_s > 0:
            raise ValueError(f"the idle timeout must be positive, not {idle_timeout_s}")
        self.store = LRUStore(capacity_bytes)
        self.max_connections = max_connections
        self.max_connections_per_host = max_connections_per_host
        self.idle_timeout_s = idle_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)  # accept() only after select() says so, never blocks
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stopping = threading.Event()
        self._serve_done = threading.Event()
        self._serve_done.set()  # not serving yet
        self._serve_ident: int | None = None
        self._conn_lock = threading.Lock()
        self._conns: dict[socket.socket, _Connection] = {}
        self._of_host: collections.Counter[str] = collections.Counter()  # open connections by host
        # How often the watchdog looks: a connection is closed at most this late.
        self._watch_every_s = min(1.0, idle_timeout_s / 4)
        self._accepted = 0
        self._rejected = 0
        self._timed_out = 0

    # --- lifecycle ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Accept connections until `stop()` (or `close()`) is called."""
        self._serve_done.clear()
        self._serve_ident = threading.get_ident()
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            next_watch = time.monotonic()
            while not self._stopping.is_set():
                for key, _ in selector.select(timeout=max(0.0, next_watch - time.monotonic())):
                    if key.fileobj is self._listener:
                        self._accept()
                now = time.monotonic()
                if now >= next_watch:
                    self._close_overdue(now)
                    next_watch = now + self._watch_every_s
        finally:
            selector.close()
            self._listener.close()
            self._serve_done.set()

    def stop(self) -> None:
        """Ask `serve_forever` to return. Safe from a signal handler: it only sets a flag and
        writes a byte."""
        self._stopping.set()
        # OSError: already closed, or the wakeup pipe is full; either way the loop sees the flag.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection, wait (bounded) for their threads."""
        self.stop()
        if self._serve_ident != threading.get_ident():
            self._serve_done.wait(timeout_s)
        self._listener.close()
        with self._conn_lock:
            conns = list(self._conns.values())
            for conn in conns:
                _shutdown(conn)
        deadline = time.monotonic() + timeout_s
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(max(0.0, deadline - time.monotonic()))
        self._wake_r.close()
        self._wake_w.close()

    def stats(self) -> dict[str, int]:
        """Store size and counters: objects, bytes (payloads), accounted_bytes, capacity, gets,
        hits, exists, puts, discarded_puts, evictions, connections, accepted, rejected, timed_out
        (connections closed for idling or for a message not done in time)."""
        with self._conn_lock:
            conns = {"connections": len(self._conns), "accepted": self._accepted,
                     "rejected": self._rejected, "timed_out": self._timed_out}
        return {**self.store.stats(), **conns}

    # --- connections ------------------------------------------------------------------------

    def _close_overdue(self, now: float) -> None:
        with self._conn_lock:
            for conn in self._conns.values():
                if not conn.timed_out and conn.deadline < now:
                    conn.timed_out = True
                    self._timed_out += 1
                    _shutdown(conn)

    def _arm(self, conn: _Connection, message_bytes: int = 0) -> None:
        """Start the clock for what `conn` waits for next: a request (`message_bytes` 0), or a
        message of that many bytes to receive or send."""
        conn.deadline = time.monotonic() + self.idle_timeout_s + message_bytes / MIN_BYTES_PER_S

    def _accept(self) -> None:
        try:
            conn, peer = self._listener.accept()
        except BlockingIOError:
            return  # another wakeup took it, or the client gave up
        except OSError as err:
            if not self._stopping.is_set():
                logger.warning("accept failed: %s", err)
                time.sleep(0.05)  # e.g. out of file descriptors: do not spin
            return
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = f"{peer[0]}:{peer[1]}"
        state = _Connection(conn, name, peer_host(peer[0]), deadline=0.0)
        self._arm(state)
        with self._conn_lock:
            refusal = self._refusal_locked(state.host)
            if refusal is None:
                thread = state.thread = threading.Thread(target=self._serve_connection, args=(state,),
                                                         name=f"v1remote-{name}", daemon=True)
                self._conns[conn] = state
                self._of_host[state.host] += 1
                self._accepted += 1
            else:
                self._rejected += 1
        if refusal is not None:
            logger.debug("%s: refused, %s", name, refusal)
            conn.close()
            return
        thread.start()

    def _refusal_locked(self, host: str) -> str | None:
        """Why a new connection from `host` is refused, if it is."""
        if self._stopping.is_set():
            return "stopping"
        if len(self._conns) >= self.max_connections:
            return f"{self.max_connections} connections already open"
        if self._of_host[host] >= self.max_connections_per_host:
            return f"{self.max_connections_per_host} connections of host {host} already open"
        return None

    def _serve_connection(self, state: _Connection) -> None:
        """Answer one connection's requests in order until it closes, misbehaves or times out."""
        conn, peer = state.sock, state.peer
        header = bytearray(CLIENT_HEADER_SIZE)
        view = memoryview(header)
        try:
            while True:
                self._arm(state)
                got = recv_exact_into(conn, view)
                if got == 0:
                    if state.timed_out:
                        logger.info("%s: idle for %g s, closing the connection", peer, self.idle_timeout_s)
                    else:
                        logger.debug("%s: closed", peer)
                    return
                if got < CLIENT_HEADER_SIZE:
                    raise _PeerClosed(f"after {got} of {CLIENT_HEADER_SIZE} header bytes")
                self._handle(state, ClientMetaMessage.deserialize(header))
        except ProtocolError as err:
            logger.warning("%s: malformed request, closing the connection: %s", peer, err)
        except (_PeerClosed, OSError) as err:
            # The watchdog's shutdown shows as a short read (receiving) or an error (sending).
            if state.timed_out:
                logger.warning("%s: message not done in time, closing the connection (%s)", peer, err)
            elif isinstance(err, _PeerClosed):
                logger.warning("%s: closed in the middle of a message (%s)", peer, err)
            elif not self._stopping.is_set():  # at shutdown, close() broke the connection itself
                logger.warning("%s: connection error, closing it: %s", peer, err)
        except Exception:  # a bug here must cost this connection only, never the server
            logger.exception("%s: unexpected error, closing the connection", peer)
        finally:
            with self._conn_lock:  # unlisted before closed: see `_shutdown`
                self._conns.pop(conn, None)
                self._of_host[state.host] -= 1
                if not self._of_host[state.host]:
                    del self._of_host[state.host]
            conn.close()

    def _handle(self, state: _Connection, msg: ClientMetaMessage) -> None:
        conn = state.sock
        # Re-armed as soon as the header is in: a request that came just before the idle
        # deadline is not cut off while being answered. Only a PUT's length is a payload to come.
        self._arm(state, msg.length if msg.command is ClientCommand.PUT else 0)
        if msg.command is ClientCommand.PUT:
            self._put(conn, msg)
        elif msg.command is ClientCommand.GET:
            entry = self.store.get(msg.key)
            if entry is None:
                conn.sendall(_FAIL)
            else:
                reply = ServerMetaMessage(ServerReturnCode.SUCCESS, len(entry.payload), entry.fmt,
                                          entry.dtype, entry.shape, entry.location)
                self._arm(state, len(entry.payload))
                send_all(conn, [reply.serialize(), entry.payload])
        elif msg.command is ClientCommand.EXIST:
            conn.sendall(_SUCCESS if self.store.contains(msg.key) else _FAIL)
        elif msg.command is ClientCommand.HEALTH:
            conn.sendall(_SUCCESS)
        elif msg.command is ClientCommand.LIST:
            listing = self.store.listing(MAX_LIST_BYTES)
            reply = ServerMetaMessage(ServerReturnCode.SUCCESS, len(listing), MemoryFormat.BINARY,
                                      WireDtype.UINT8, (len(listing), 0, 0, 0))
            self._arm(state, len(listing))
            send_all(conn, [reply.serialize(), listing])

    def _put(self, conn: socket.socket, msg: ClientMetaMessage) -> None:
        if msg.length > MAX_PUT_BYTES:
            raise ProtocolError(f"PUT of {msg.length} bytes is over the {MAX_PUT_BYTES}-byte limit")
        cost = self.store.cost(msg.length)
        if not self.store.reserve(cost):
            _drain(conn, msg.length)
            self.store.count_discarded()
            logger.debug("PUT %s of %d bytes does not fit: discarded", msg.key, msg.length)
            return
        try:
            # Uninitialised memory: a bytearray would zero every payload before receiving it
            # (at large sizes that alone halved the PUT rate).
            payload = np.empty(msg.length, dtype=np.uint8)
            got = recv_exact_into(conn, memoryview(payload))
            if got < msg.length:
                raise _PeerClosed(f"after {got} of {msg.length} PUT payload bytes")
        except BaseException:
            self.store.release(cost)
            raise
        self.store.commit(msg.key, Entry(msg.fmt, msg.dtype, msg.shape, msg.location, payload, cost))


def _shutdown(conn: _Connection) -> None:
    """Wake the thread blocked on `conn`'s socket, which then closes it itself (closing it here,
    under that thread's recv, would free the descriptor for reuse while still in use). Call with the
    connection lock held: a thread unlists its connection before closing the socket, so a listed
    connection's descriptor is still its own."""
    with contextlib.suppress(OSError):  # the peer reset it meanwhile
        conn.sock.shutdown(socket.SHUT_RDWR)


def _drain(conn: socket.socket, length: int) -> None:
    """Read and drop `length` bytes (a PUT that does not fit), keeping the stream in step."""
    scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
    left = length
    while left:
        want = min(left, len(scratch))
        got = recv_exact_into(conn, scratch[:want])
        if got < want:
            raise _PeerClosed(f"after {length - left + got} of {length} PUT payload bytes")
        left -= want
