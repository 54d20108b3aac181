"""The HTTP server behind the Prometheus endpoint: GET /metrics, bounded in threads, descriptors
and time.

Why not prometheus_client's `start_http_server`: it starts a thread per connection and reads the
request with no timeout, so idle connections, from anyone who can reach `--metrics-host`, pinned
a thread and a descriptor each until the daemon ran out of both.

This server is one thread around a selector, with non-blocking sockets:
- at most `max_connections` connections are open at once. One more closes the oldest, not the
  newcomer: a pile of idle connections then costs at most that many descriptors, and cannot keep
  a scrape out unless it is renewed faster than a scrape is answered (milliseconds);
- a connection has `timeout_s` from its accept for the whole exchange (the request in, the reply
  out), then is closed, whatever it is doing: a peer that trickles bytes is cut off too;
- one request per connection (`Connection: close`), its head at most `MAX_HEAD_BYTES`;
- the listening socket has SO_REUSEADDR (`socket.create_server` sets it on POSIX), so a restarted
  daemon gets its port back while the last scrapes' connections are in TIME_WAIT.

A scrape gets what prometheus_client's own server gives it: the format its Accept header asks for
(text, or OpenMetrics as Prometheus asks), gzipped when its Accept-Encoding allows. The reply is
built on this thread: collecting takes milliseconds, and the collectors then never run
concurrently.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import re
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

logger = logging.getLogger("lmcache_mp.observability.http")

METRICS_PATH = "/metrics"
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_TIMEOUT_S = 10.0  # Prometheus' own scrape timeout is 10 s at most by default
MAX_HEAD_BYTES = 8192  # a request line and headers; a scrape's are a few hundred bytes
_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")


@dataclass(slots=True, eq=False)
class _Connection:
    sock: socket.socket
    deadline: float  # monotonic; closed at this time whatever it is doing
    received: bytes = b""
    reply: memoryview | None = None  # once the request is in: what is left to send


class MetricsHTTPServer:
    """Serves `registry` at http://HOST:PORT/metrics. Binds in the constructor (port 0 picks a free
    port: see `address`); `start()` serves on a daemon thread until `close()`."""

    def __init__(self, host: str, port: int, registry: Collector, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if max_connections < 1 or not timeout_s > 0:
            raise ValueError(f"need max_connections >= 1 and timeout_s > 0, not {max_connections} "
                             f"and {timeout_s}")
        self.registry = registry
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Connection] = {}  # oldest first: see `_accept`
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close every connection (from another thread than the server's)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:  # never started: nothing else will close the sockets
            self._close_all()

    # --- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(self._wait_s()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif isinstance(key.data, _Connection) and key.data.sock in self._conns:
                        self._step(key.data, events)  # (unless closed earlier in this batch)
                self._close_expired(time.monotonic())
        except Exception:  # without this thread there are no metrics, but the daemon serves on
            logger.exception("the metrics endpoint failed and is closed")
        finally:
            self._close_all()

    def _wait_s(self) -> float | None:
        """Until the next deadline; no timeout with no connection open."""
        if not self._conns:
            return None
        return max(0.0, min(c.deadline for c in self._conns.values()) - time.monotonic())

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return  # the client gave up already
        except OSError as err:  # e.g. out of descriptors: let the others finish first
            logger.warning("metrics endpoint: accept failed: %s", err)
            time.sleep(0.05)
            return
        if len(self._conns) >= self.max_connections:
            self._close(next(iter(self._conns.values())))  # the oldest: dicts keep insertion order
        sock.setblocking(False)
        conn = _Connection(sock, time.monotonic() + self.timeout_s)
        self._conns[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _close_expired(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return  # closed already
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    # --- one connection -----------------------------------------------------------------------

    def _step(self, conn: _Connection, events: int) -> None:
        """Read what has come of the request, or send what the reply has left; close when done
        or broken. A failure here costs this connection only."""
        try:
            if conn.reply is None and events & selectors.EVENT_READ:
                self._receive(conn)
            elif conn.reply is not None and events & selectors.EVENT_WRITE:
                self._send(conn)
        except OSError:  # reset by the peer: nothing to tell it
            self._close(conn)
        except Exception:
            logger.exception("metrics endpoint: unexpected error, closing the connection")
            self._close(conn)

    def _receive(self, conn: _Connection) -> None:
        data = conn.sock.recv(MAX_HEAD_BYTES)
        if not data:  # closed before a whole request
            self._close(conn)
            return
        conn.received += data
        end = _END_OF_HEAD.search(conn.received)
        if end is not None:
            reply = self._reply(conn.received[:end.start()])
        elif len(conn.received) > MAX_HEAD_BYTES:
            reply = _response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request head too large\n")
        else:
            return  # more to come
        conn.reply = memoryview(reply)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)  # most replies go out at once, without another turn of the loop

    def _send(self, conn: _Connection) -> None:
        assert conn.reply is not None
        try:
            sent = conn.sock.send(conn.reply)
        except BlockingIOError:
            return
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._close(conn)

    def _reply(self, head: bytes) -> bytes:
        """The whole HTTP reply to a request whose head (without its blank line) is `head`."""
        request_line, *header_lines = head.decode("latin-1").splitlines()
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(HTTPStatus.BAD_REQUEST, b"bad request line\n")
        method, target, _ = parts
        if urlsplit(target).path != METRICS_PATH:
            return _response(HTTPStatus.NOT_FOUND, f"metrics are at {METRICS_PATH}\n".encode())
        if method not in ("GET", "HEAD"):
            return _response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET or HEAD only\n", [("Allow", "GET, HEAD")])
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self.registry)
        except Exception:  # a collector's bug: the scraper sees the failure, the next scrape may work
            logger.exception("metrics endpoint: collecting the metrics failed")
            return _response(HTTPStatus.INTERNAL_SERVER_ERROR, b"collecting the metrics failed\n")
        extra: list[tuple[str, str]] = []
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return _response(HTTPStatus.OK, body, extra, content_type=content_type, send_body=method == "GET")


def _response(status: HTTPStatus, body: bytes, headers: list[tuple[str, str]] | None = None, *,
              content_type: str = "text/plain; charset=utf-8", send_body: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")
