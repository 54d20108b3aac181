"""The daemon's side of the message queue: `MessageQueueServer`, a ROUTER bound to one or more
endpoints.

Invariants:
- One I/O thread alone touches the ROUTER. Incoming requests go to `on_request` on that
  thread; replies from any other thread are queued and the I/O thread is woken through an
  eventfd doorbell.
- A reply after `stop` is dropped (its client is gone or will time out): replies are ordered
  against the socket's close by one lock, so none touches a closed socket or doorbell.
- Queues are bounded per connection, in replies (SERVER_PEER_HWM) and in bytes: replies of
  TRACKED_REPLY_BYTES or more are charged to their connection until libzmq has written them out,
  and past PEER_REPLY_BYTES of those a large reply is answered OVERLOADED instead (`_ReplyBytes`).
  A client that stops reading has its replies dropped past the first bound, refused past the
  second; the daemon never blocks on, nor buffers without bound for, a client.
- A frame over MAX_FRAME_BYTES disconnects its sender; a reply to a client that went away is
  dropped silently.
- A bug in one request's handling is logged and never stops the I/O thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from lmcache_mp.curve import ServerCurve
from lmcache_mp.mq.frames import MAX_FRAME_BYTES, STATUS_FRAME, recv_frames, send_frames
from lmcache_mp.protocol import ErrorCode, ErrorReply

logger = logging.getLogger(__name__)

# Per connection on the daemon's side: replies waiting for a client whose libzmq stops reading
# (a frozen or hostile client: a live one's library reads on, whatever its threads do), and
# requests read ahead of the socket thread. 100,000 replies held ~0.5 KiB each in the daemon
# per such connection (+47 MiB for one); a pipelining client keeps far fewer in flight.
SERVER_PEER_HWM = 2_048
# ...and the bytes they hold. The usual reply is a few dozen bytes; a reply of this size or more
# (STATUS, KV_EVENTS, a long STORE's outcomes) is sent zero-copy, with a tracker that says when
# libzmq has written it out, and charged to its connection until then...
TRACKED_REPLY_BYTES = 1 << 10
# ...up to this much per connection: a larger reply past it is answered OVERLOADED (a reply of any
# size goes out to a connection that holds none). A connection that reads nothing holds at most
# SERVER_PEER_HWM small replies (2 MiB) and this: 2,048 STATUS replies of 1 MiB each held 2 GiB.
PEER_REPLY_BYTES = 4 << 20
# How long a stopping server keeps trying to deliver its last replies to connected clients.
CLOSE_LINGER_MS = 2000


class _ReplyBytes:
    """The large replies of each connection that libzmq has not written out yet, by bytes.
    Thread-safe: replies come from every thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # routing id -> (tracker, bytes) of each reply not known to be written out, oldest first
        self._unsent: dict[bytes, collections.deque[tuple[zmq.MessageTracker, int]]] = {}
        self._held: dict[bytes, int] = {}  # routing id -> the bytes of those

    def charge(self, identity: bytes, body: bytes) -> zmq.Frame | None:
        """A tracked frame of `body`, charged to the connection; None (nothing charged) when that
        connection holds PEER_REPLY_BYTES with it already."""
        with self._lock:
            held = self._settle_locked(identity)
            if held and held + len(body) > PEER_REPLY_BYTES:
                return None
            frame = zmq.Frame(body, copy=False, track=True)
            self._unsent.setdefault(identity, collections.deque()).append((frame.tracker, len(body)))
            self._held[identity] = held + len(body)
            return frame

    def held(self, identity: bytes) -> int:
        with self._lock:
            return self._settle_locked(identity)

    def sweep(self) -> None:
        """Forget the replies written out since, and the connections that hold none (those gone
        included: libzmq frees a closed connection's replies)."""
        with self._lock:
            for identity in list(self._unsent):
                self._settle_locked(identity)

    def _settle_locked(self, identity: bytes) -> int:
        """The bytes `identity` still holds, once the replies written out are taken off (a
        connection's replies go out in order)."""
        unsent = self._unsent.get(identity)
        if unsent is None:
            return 0
        held = self._held[identity]
        while unsent and unsent[0][0].done:
            held -= unsent.popleft()[1]
        if not unsent:
            del self._unsent[identity], self._held[identity]
            return 0
        self._held[identity] = held
        return held


class MessageQueueServer:
    """A ROUTER bound to one or more endpoints, owned by one I/O thread.

    Incoming requests go to `on_request` on that thread. Replies may come from any thread:
    on the I/O thread itself they go straight out; from elsewhere they are queued and the
    I/O thread is woken through an eventfd doorbell (only it may touch the socket).

    The server owns its ZeroMQ context (unless given one) so that `stop` can wait until the
    last replies are written out: closing a socket drops what its context has not sent yet."""

    def __init__(self, endpoints: list[str], on_request: Callable[[bytes, list[bytes]], None],
                 on_tick: Callable[[], None] | None = None, context: zmq.Context | None = None,
                 tick_s: float = 1.0, curve: ServerCurve | None = None):
        self._context = context or zmq.Context()
        self._owns_context = context is None
        sock = self._context.socket(zmq.ROUTER)
        self._auth = curve.secure(self._context, sock) if curve is not None else None
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SERVER_PEER_HWM)
        sock.setsockopt(zmq.RCVHWM, SERVER_PEER_HWM)
        # A reply to a client that went away is dropped silently instead of raising.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Control messages are small (KV bytes never travel here): a peer sending a larger
        # frame is disconnected instead of making the daemon buffer it.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.endpoints: list[str] = []
        try:
            for endpoint in endpoints:
                sock.bind(endpoint)
                self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            sock.close(linger=0)
            self._stop_auth()
            if self._owns_context:
                self._context.term()
            raise
        self._sock = sock
        self._on_request = on_request
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._outbox: collections.deque[list[bytes | zmq.Frame]] = collections.deque()
        self._reply_bytes = _ReplyBytes()
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stopping = False
        # Replies may come from any thread until the I/O thread closes the socket and the
        # doorbell; this lock orders them against that close (a late reply is dropped).
        self._reply_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mq-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._reply_lock:
            self._stopping = True
            # The I/O thread may have seen `_stopping` (it wakes every tick) and closed the
            # doorbell already: writing to it then failed with EBADF and the daemon exited 1.
            if not self._closed:
                os.eventfd_write(self._doorbell, 1)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def reply(self, identity: bytes, request_id: bytes, status: int, body: bytes,
              before_send: Callable[[int], None] | None = None) -> int:
        """Send a reply (from any thread); returns the status sent: OVERLOADED, instead of a
        large reply to a connection that holds PEER_REPLY_BYTES of replies not written out
        yet. `before_send(status)` runs just before it goes: what it records (a request's count)
        is there by the time the client reads the reply. After `stop` it is dropped: its client
        is gone or will time out, and the socket is closed."""
        payload: bytes | zmq.Frame = body
        if len(body) >= TRACKED_REPLY_BYTES:
            frame = self._reply_bytes.charge(identity, body)
            if frame is None:
                status, payload = ErrorCode.OVERLOADED, self._unread_refusal(identity, len(body))
            else:
                payload = frame
        if before_send is not None:
            before_send(status)
        self.send(identity, [request_id, STATUS_FRAME[status], payload])
        return status

    def send(self, identity: bytes, frames: list[bytes | zmq.Frame]) -> None:
        """Send a message of these frames to the connection `identity` (from any thread; after
        `stop` it is dropped). `reply` sends through it; another wire's replies go as they are."""
        message = [identity, *frames]
        if threading.current_thread() is self._thread:  # only while the I/O thread runs
            send_frames(self._sock, message)
            return
        with self._reply_lock:
            if self._closed:
                logger.debug("dropping a reply: the message queue is stopped")
                return
            self._outbox.append(message)
            os.eventfd_write(self._doorbell, 1)

    def _unread_refusal(self, identity: bytes, size: int) -> bytes:
        message = (f"a reply of {size} bytes not sent: this connection holds "
                   f"{self._reply_bytes.held(identity)} bytes of replies it has not read yet (at most "
                   f"{PEER_REPLY_BYTES}); read them, then ask again")
        return msgspec.msgpack.encode(ErrorReply(int(ErrorCode.OVERLOADED), message))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._doorbell, zmq.POLLIN)
        next_tick = time.monotonic() + self._tick_s
        try:
            while not self._stopping:
                events = dict(poller.poll(int(self._tick_s * 1000)))
                if self._doorbell in events:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._doorbell)
                self._flush_outbox()
                if self._sock in events:
                    self._read_one()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick_s
                    self._reply_bytes.sweep()
                    if self._on_tick is not None:
                        self._on_tick()
        finally:
            with self._reply_lock:
                self._closed = True
                try:
                    self._flush_outbox()
                finally:
                    self._sock.close(linger=CLOSE_LINGER_MS)
                    os.close(self._doorbell)
            self._stop_auth()
            if self._owns_context:
                self._context.term()  # returns once the replies are out, or after the linger

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()  # its ZAP socket would keep the context from terminating

    def _flush_outbox(self) -> None:
        while self._outbox:
            send_frames(self._sock, self._outbox.popleft())

    def _read_one(self) -> None:
        """Handle the one request the poll promised. The next poll returns at once while more
        wait (no sleep, so no extra wake-up under load); reading on until EAGAIN would cost a
        failed read and an exception per request, more than a PING's own handling where system
        calls are slow (VMs: docs/benchmarks.md section 1, "Fewer system calls per round trip")."""
        frames = recv_frames(self._sock)
        try:
            self._on_request(frames[0], frames[1:])
        except Exception:  # a bug in one request must not stop the daemon serving
            logger.exception("unhandled error while dispatching a request")
