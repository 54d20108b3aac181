"""The client's side of the message queue: `MessageQueueClient` (a DEALER) and the
`MessagingFuture` each request's reply settles.

Invariants:
- There is no I/O thread. A thread that waits for a reply drives the socket itself (the
  "leader", holding the socket lock) and settles every reply that arrives; the others wait on
  a condition until theirs is settled or the leader leaves (see `MessageQueueClient`). A lone
  caller sends and receives on its own thread: no thread hop on either side.
- A flusher thread, started by the first `submit_later`, only sends what was deferred, when
  nothing else did within LATER_FLUSH_S; `close` stops it before the socket closes.
- Every future is settled exactly once: by its reply, by its deadline (RequestTimeoutError), or
  by `close` (ClientClosedError). A reply that matches no pending request (one that timed out)
  is dropped, never handed to another request.
- The client never blocks on a full queue or a missing connection: the request is dropped and
  times out instead.
- This module and what it imports load neither torch nor numpy: the CLI's `ping` and `status`
  start fast (tests/smoke/test_fast_start.py).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import (
    ClientClosedError,
    LMCacheMPError,
    ProtocolMismatchError,
    RequestTimeoutError,
    ServerError,
)
from lmcache_mp.mq.codec import Codec
from lmcache_mp.mq.frames import NOBLOCK, POLLIN, recv_frames, send_frames
from lmcache_mp.protocol import PROTOCOL_VERSION, ErrorCode, HelloReply, RequestType

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 300.0
# Bounded queues: a client never blocks on a full queue (or no connection): it drops the
# request, which times out.
SOCKET_HWM = 100_000


class MessagingFuture(Generic[T]):
    """The reply to one request. `query()` never blocks; `result()` raises a typed error.

    Waiting on a future also drives its client's socket (see `MessageQueueClient`), so a
    reply reaches the thread that waits for it without a hop through another thread."""

    __slots__ = ("_client", "_done", "_error", "_result", "deadline", "request_type")

    def __init__(self, request_type: RequestType, deadline: float,
                 client: MessageQueueClient | None = None):
        self.request_type = request_type
        self.deadline = deadline
        self._client = client
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    @classmethod
    def settled(cls, request_type: RequestType, value: Any = None,
                error: BaseException | None = None) -> MessagingFuture[Any]:
        """A future that is already done, for answers known without asking the daemon."""
        future: MessagingFuture[Any] = cls(request_type, 0.0)
        future._settle(value, error)
        return future

    def query(self) -> bool:
        if not self._done and self._client is not None:
            self._client._poll_now()
        return self._done

    def done(self) -> bool:
        """Whether it is settled, without driving the socket (see `query`)."""
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done and self._client is not None:
            self._client._wait_for(self, timeout)
        return self._done

    def result(self, timeout: float | None = None) -> T:
        if not self.wait(timeout):
            raise RequestTimeoutError(f"{self.request_type.name}: no reply within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        return self._error if self._done else None

    def _settle(self, value: Any, error: BaseException | None) -> None:
        self._result, self._error = value, error
        self._done = True  # last: readers check _done without a lock

    def to_cuda_future(self) -> MessagingFuture[T]:
        """The seed adapter's hook for replies that carry a CUDA event. Our STORE and
        RETRIEVE replies are sent only after the daemon's copies are complete (it waits on
        its own stream before replying), so the reply alone is the completion signal."""
        return self


_LEADER_SLICE_S = 0.05
# The longest a `submit_later` request waits in the outbox for another request to go out with.
LATER_FLUSH_S = 0.005
# How often a busy client scans its requests for missed deadlines (a timeout fires at most
# this late; scanning on every reply would cost O(in flight) per reply).
_EXPIRY_SCAN_S = 0.01


class MessageQueueClient:
    """A DEALER connected to the daemon. Many requests may be in flight, from many threads.

    There is no I/O thread. A thread that waits for a reply takes the socket lock and polls
    the socket itself ("leader"), settling every reply that arrives; threads that find the
    lock taken wait on a condition until their reply is settled or the leader leaves. A
    sender that finds the socket busy queues its frames and rings the leader's doorbell.
    So a lone caller sends and receives on its own thread: no thread hop on either side.
    Requests nobody waits on may go out later, with the next one (`submit_later`); a flusher
    thread, started by the first of them, bounds how long they wait.
    """

    def __init__(self, server_url: str, context: zmq.Context | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, curve: ClientCurve | None = None):
        self.server_url = server_url
        self.curve = curve
        self.request_timeout_s = request_timeout_s
        self.codec = Codec()
        self._ids = itertools.count(1)
        self._pending: dict[bytes, MessagingFuture[Any]] = {}
        self._pending_lock = threading.Lock()
        self._closed = False
        self._io = threading.Lock()  # whoever holds it may use the socket
        self._settled = threading.Condition()  # replies settled, or the leader left
        self._waiting = 0  # threads waiting on `_settled` (changed under its lock)
        self._outbox: collections.deque[list[bytes]] = collections.deque()
        self._later = threading.Event()  # `submit_later` queued something: the flusher is due
        self._flusher: threading.Thread | None = None
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        if curve is not None:
            curve.secure(self._sock)
        self._sock.connect(server_url)
        self._next_expiry_scan = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._doorbell, zmq.POLLIN)

    def submit(self, request_type: RequestType, payload: list[Any],
               timeout_s: float | None = None) -> MessagingFuture[Any]:
        future = self._enqueue(request_type, payload, timeout_s)
        self._kick()
        return future

    def submit_later(self, request_type: RequestType, payload: list[Any],
                     timeout_s: float | None = None) -> MessagingFuture[Any]:
        """`submit` for a request nobody waits on (END_SESSION, RELEASE_LEASES): it goes out with
        this client's next request or wait, or within LATER_FLUSH_S, sent by a flusher thread.
        The caller pays no send: a ZeroMQ send wakes libzmq's I/O thread (its cost on a VM:
        docs/benchmarks.md section 1, second round), and two requests sent together wake it
        once. Order is kept: it goes out before any request submitted after it."""
        future = self._enqueue(request_type, payload, timeout_s)
        if self._flusher is None:
            with self._pending_lock:  # one flusher, and none once `close` has begun
                if self._flusher is None and not self._closed:
                    self._flusher = threading.Thread(target=self._flush_later, name="mq-client-flusher",
                                                     daemon=True)
                    self._flusher.start()
        if not self._later.is_set():
            self._later.set()
        return future

    def _enqueue(self, request_type: RequestType, payload: list[Any],
                 timeout_s: float | None) -> MessagingFuture[Any]:
        request_id = next(self._ids)
        frames = self.codec.encode_request(request_id, request_type, payload)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.request_timeout_s)
        future: MessagingFuture[Any] = MessagingFuture(request_type, deadline, self)
        with self._pending_lock:
            if self._closed:
                raise ClientClosedError(f"client for {self.server_url} is closed")
            self._pending[frames[0]] = future
        self._outbox.append(frames)
        return future

    def _flush_later(self) -> None:
        """The flusher thread: sends what `submit_later` queued, at most LATER_FLUSH_S after it
        (usually a request or a wait of the caller's has sent it already)."""
        while True:
            self._later.wait()
            time.sleep(LATER_FLUSH_S)
            self._later.clear()
            if self._closed:  # checked before the socket is touched: `close` waits for this thread
                return
            self._kick()

    def handshake(self, client_name: str, timeout_s: float = 10.0) -> HelloReply:
        """HELLO: every client sends it first. Raises ProtocolMismatchError when the daemon
        speaks another protocol version, RequestTimeoutError when nothing answers."""
        try:
            hello: HelloReply = self.submit(
                RequestType.HELLO, [PROTOCOL_VERSION, client_name], timeout_s=timeout_s
            ).result(timeout_s)
        except RequestTimeoutError as err:
            if self.curve is None:
                raise
            raise RequestTimeoutError(  # CURVE refusals are silent on the wire: say what to check
                f"{err}; with CURVE, check that the daemon's public key is "
                f"{self.curve.server_public_key_file} and that it allows the public key of "
                f"{self.curve.client_secret_key_file}") from None
        except ServerError as err:
            if err.code != ErrorCode.BAD_PAYLOAD:
                raise
            # A daemon of protocol 1-2 reads one frame per payload value: this HELLO is not one.
            raise ProtocolMismatchError(
                f"the daemon at {self.server_url} refused this client's HELLO ({err.message}): it "
                f"speaks an older protocol than this client's {PROTOCOL_VERSION}; upgrade the "
                "daemon") from None
        if hello.protocol_version != PROTOCOL_VERSION:
            raise ProtocolMismatchError(
                f"the daemon at {self.server_url} (lmcache-mp {hello.server_version}) speaks "
                f"protocol {hello.protocol_version}, this client speaks {PROTOCOL_VERSION}: "
                "upgrade the older side"
            )
        return hello

    def close(self) -> None:
        with self._pending_lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future._settle(None, ClientClosedError(f"client for {self.server_url} closed"))
        self._wake_waiters()
        if self._flusher is not None:  # it must be gone before the socket and doorbell close
            self._later.set()
            self._flusher.join()
        with self._io:  # a leader leaves within one slice once its future is settled
            self._sock.close(linger=0)
            os.close(self._doorbell)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # ---- the socket, driven by whichever thread needs it ---------------------------------

    def _kick(self) -> None:
        """Send queued frames now, or leave them to the thread that holds the socket. Every
        holder calls this after releasing, so frames are never stranded."""
        while self._outbox and not self._closed:
            if not self._io.acquire(blocking=False):
                os.eventfd_write(self._doorbell, 1)
                return
            try:
                self._flush()
            finally:
                self._io.release()
                self._wake_waiters()  # a waiter that found the socket taken may lead now

    def _flush(self) -> None:
        while self._outbox:
            frames = self._outbox.popleft()
            try:
                send_frames(self._sock, frames, NOBLOCK)
            except zmq.Again:
                # No connection to queue it on: the daemon refused our CURVE key (ZeroMQ then
                # drops the connection for good), or its queue is full. Blocking here would hang
                # the caller; the request never reaches the daemon and times out instead.
                logger.debug("%s: request dropped, no connection to send it on", self.server_url)

    def _poll_now(self) -> None:
        if self._closed or not self._io.acquire(blocking=False):
            return
        try:
            self._flush()
            self._drain()
            self._expire_overdue()
        finally:
            self._io.release()
            self._wake_waiters()  # as in `_kick`
        self._kick()

    def _wait_for(self, future: MessagingFuture[Any], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future._done and not self._closed:
            remaining = _LEADER_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            if self._io.acquire(blocking=False):
                try:
                    self._lead(future, deadline)
                finally:
                    self._io.release()
                    self._wake_waiters()  # one of them may have to lead now
                    self._kick()
            else:
                with self._settled:
                    # Counted before the checks: a leader settles, or leaves, and then reads
                    # the count, so either we see its change or it sees us and wakes us.
                    self._waiting += 1
                    try:
                        if not future._done and self._io.locked():
                            self._settled.wait(min(remaining, _LEADER_SLICE_S))
                    finally:
                        self._waiting -= 1

    def _lead(self, future: MessagingFuture[Any], deadline: float | None) -> None:
        while not future._done and not self._closed:
            self._flush()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            slice_s = _LEADER_SLICE_S if deadline is None else min(_LEADER_SLICE_S, deadline - now)
            events = dict(self._poller.poll(max(1, int(slice_s * 1000))))
            if self._doorbell in events:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._doorbell)
            # One reply, which the poll promised: the next poll returns at once if more wait.
            # (Reading on until EAGAIN costs a failed read and an exception per round trip, more
            # than a PING's own handling where system calls are slow, as on VMs: docs/benchmarks.md
            # section 1, "Fewer system calls per round trip".)
            if self._sock in events and self._on_reply(recv_frames(self._sock)):
                self._wake_waiters()
            # Whether or not replies arrived: under steady traffic every slice has events, and a
            # request whose reply never comes must still time out on schedule.
            self._expire_overdue()

    def _drain(self) -> None:
        """Settle every reply that has arrived, asking the socket before each read (ZMQ_EVENTS
        costs less than a read that fails with EAGAIN)."""
        settled = False
        while self._sock.getsockopt(zmq.EVENTS) & POLLIN:
            settled |= self._on_reply(recv_frames(self._sock))
        if settled:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        if self._waiting:  # a Condition's notify costs microseconds even with nobody to wake
            with self._settled:
                self._settled.notify_all()

    def _on_reply(self, frames: list[bytes]) -> bool:
        if len(frames) != 3:
            logger.warning("dropping a reply with %d frames from %s", len(frames), self.server_url)
            return False
        rid, status_frame, body = frames
        with self._pending_lock:
            future = self._pending.pop(rid, None)
        if future is None:
            # A reply to a request that already timed out: never hand it to anyone else.
            logger.debug("dropping an unmatched reply from %s", self.server_url)
            return False
        try:
            status = self.codec.decode_status(status_frame)
            future._settle(self.codec.decode_reply(future.request_type, status, body), None)
        except ServerError as err:
            future._settle(None, err)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            future._settle(None, LMCacheMPError(f"undecodable {future.request_type.name} reply: {err}"))
        return True

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry_scan:
            return
        self._next_expiry_scan = now + _EXPIRY_SCAN_S
        with self._pending_lock:
            overdue = [rid for rid, f in self._pending.items() if f.deadline <= now]
            expired = [self._pending.pop(rid) for rid in overdue]
        for future in expired:
            future._settle(None, RequestTimeoutError(
                f"{future.request_type.name}: no reply from {self.server_url} before its deadline"))
        if expired:
            self._wake_waiters()
