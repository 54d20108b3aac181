"""The daemon: binds the message queue and answers every request.

Where a handler runs is declared next to its schema in the protocol table
(`protocol.HandlerKind`): cheap requests (PING, HELLO, END_SESSION, ...) are answered on the
socket thread; requests that copy KV or map memory run on a bounded worker pool, so PING
stays fast while a STORE runs, and RETRIEVEs on a pool of their own (the load lane), so that a
load, which vLLM's forward pass waits for, never queues behind STOREs or registrations; a
deferred handler (LOOKUP) runs on the socket thread and may hand back a Future, whose result is
sent when it completes. A socket-thread handler may also answer at once and leave bookkeeping
for right after the reply (`dispatch.ReplyThen`, the handler contract).
Whatever happens, each request gets one reply: a result or an error. A handler that meets a
`FatalError` (the device's copies failed or hang) gets its error reply too; the server then refuses
every request and sets `failure`, for the daemon to exit and be restarted.

The server binds and answers before the daemon's engine exists: PING, HELLO, GET_CHUNK_SIZE and
STATUS from the first moment, every other request STARTING until `serve_engine` installs the
engine's handlers (its phase, in HELLO and STATUS, goes from "starting" to "serving").
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from lmcache_mp import __version__
from lmcache_mp.config import ServerConfig
from lmcache_mp.engine.dispatch import ARRIVAL, PEER, Handler, ReplyThen
from lmcache_mp.engine.status import EngineStatus
from lmcache_mp.errors import FatalError, ServerError
from lmcache_mp.mq.codec import Codec
from lmcache_mp.mq.frames import REQUEST_ID
from lmcache_mp.mq.server import MessageQueueServer
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import (
    PHASE_SERVING,
    PHASE_STARTING,
    PROTOCOL,
    PROTOCOL_VERSION,
    DoorInfo,
    ErrorCode,
    HandlerKind,
    HelloReply,
    RequestType,
    StatusReport,
)
from lmcache_mp.sockets import ipc_path

logger = logging.getLogger(__name__)

# How long a stopping daemon lets the requests it started finish, and answers them, before it
# closes the message queue (the replies of any still running after that are dropped).
DRAIN_TIMEOUT_S = 5.0


_STOPPING = "the daemon is stopping"
_NAME_LOGGED = 200  # characters of a client's HELLO name that a log line shows


class Server:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 doors: Callable[[], list[DoorInfo]] | None = None):
        """Serves HELLO, PING, GET_CHUNK_SIZE and STATUS once started; every other request gets
        STARTING until `serve_engine`. The config was validated by the Daemon. `doors()`: the daemon's
        front doors, for STATUS (none: STATUS lists none)."""
        self.config = config
        self._doors = doors
        self.metrics = metrics or Metrics()
        self.codec = Codec()
        self.started_at = time.monotonic()
        self.epoch = secrets.randbits(63)  # HELLO's and STATUS's restart epoch
        self.phase = PHASE_STARTING
        self._status_extra: Callable[[], EngineStatus] | None = None
        self._on_tick: Callable[[], None] | None = None
        self._handlers: dict[RequestType, Handler] = {rt: self._refuse_starting for rt in RequestType} | {
            RequestType.HELLO: self._hello,
            RequestType.PING: lambda nonce: nonce,
            RequestType.GET_CHUNK_SIZE: lambda: config.chunk_size,
            RequestType.STATUS: self._status,
        }
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="lmcache-mp-worker")
        self._loads = ThreadPoolExecutor(config.max_workers, thread_name_prefix="lmcache-mp-load")
        # Why the daemon cannot serve on (a FatalError's message), once one was met; None until then.
        self.failure: str | None = None
        self._queued = 0  # worker requests queued or running
        self._deferred = 0  # deferred handlers' Futures not completed yet
        self._queued_lock = threading.Lock()
        self._drained = threading.Condition(self._queued_lock)  # both counters reached 0
        self._stopping = False
        self._arrivals = 0  # requests read so far
        self._mq = MessageQueueServer(config.listen, self._on_request, on_tick=self._tick,
                                      curve=config.server_curve)
        self._secure_ipc_files()
        self.endpoints = self._mq.endpoints

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def arrivals(self) -> int:
        """How many requests the socket thread has read so far (the last one's `ARRIVAL`)."""
        return self._arrivals

    def start(self) -> None:
        self._mq.start()

    def serve_engine(self, handlers: dict[RequestType, Handler], status_extra: Callable[[], EngineStatus],
                     on_tick: Callable[[], None]) -> None:
        """The engine is built: its requests run from now on (they were refused STARTING)."""
        self._status_extra = status_extra
        self._on_tick = on_tick
        # One assignment: the socket thread reads either the old table or the new one, whole.
        self._handlers = self._handlers | handlers
        self.phase = PHASE_SERVING

    def stop(self, *, join: bool = True) -> None:
        """Refuse new requests, answer the queued ones SHUTTING_DOWN, let the running ones
        finish and send their replies (up to DRAIN_TIMEOUT_S), then close the message queue.
        `join=False`: return without waiting for the worker threads to end (after a FatalError,
        one may be blocked for good)."""
        with self._queued_lock:
            self._stopping = True
        # Cancelled queued requests are answered by their futures' callbacks (_refuse_unstarted).
        for pool in (self._pool, self._loads):
            pool.shutdown(wait=False, cancel_futures=True)
        with self._drained:
            drained = self._drained.wait_for(lambda: self._queued == 0 and self._deferred == 0,
                                             DRAIN_TIMEOUT_S)
            running = self._queued + self._deferred
        if not drained:
            logger.warning("%d requests still running after %.0f s; their replies are dropped",
                           running, DRAIN_TIMEOUT_S)
        self._mq.stop()
        if join:
            for pool in (self._pool, self._loads):
                pool.shutdown(wait=True)
        for url in self.endpoints:
            path = ipc_path(url)
            if path is not None:
                path.unlink(missing_ok=True)

    def _secure_ipc_files(self) -> None:
        for url in self.config.listen:
            path = ipc_path(url)
            if path is not None:
                self.config.socket_access.secure(path)

    def _tick(self) -> None:
        if self._on_tick is not None:
            try:
                self._on_tick()
            except Exception:
                logger.exception("periodic maintenance failed")

    # ---- dispatch ---------------------------------------------------------------------------

    def _on_request(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) < 2 or len(frames[0]) != REQUEST_ID.size:
            self._send_error(identity, frames[0] if frames else b"", ErrorCode.MALFORMED_MESSAGE,
                             "a request is [8-byte request id, request type, payload...]")
            return
        request_id, type_frame, payload = frames[0], frames[1], frames[2:]
        try:
            request_type = self.codec.decode_request_type(type_frame)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self._send_error(identity, request_id, ErrorCode.UNKNOWN_REQUEST_TYPE,
                             f"unknown request type frame {type_frame[:16]!r}")
            return
        size, limit = sum(len(frame) for frame in payload), PROTOCOL[request_type].max_payload_bytes
        if size > limit:
            self._send_error(identity, request_id, ErrorCode.BAD_PAYLOAD,
                             f"{request_type.name}: a {size}-byte payload, over its {limit}-byte limit",
                             request_type)
            return
        try:
            args = self.codec.decode_payload(request_type, payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            self._send_error(identity, request_id, ErrorCode.BAD_PAYLOAD, f"{request_type.name}: {err}",
                             request_type)
            return
        handler = self._handlers[request_type]  # every type has one (STARTING's refusal at first)
        if self._stopping:
            self._send_error(identity, request_id, ErrorCode.SHUTTING_DOWN, _STOPPING, request_type)
            return
        self._arrivals += 1  # only the socket thread counts: the order requests were read in
        arrival = self._arrivals
        kind = PROTOCOL[request_type].kind
        if kind not in (HandlerKind.WORKER, HandlerKind.LOAD):
            self._run(identity, request_id, request_type, handler, args, arrival)
            return
        with self._queued_lock:
            # Checked again under the lock: stop() waits for every request counted here.
            refusal = (ErrorCode.SHUTTING_DOWN if self._stopping
                       else ErrorCode.OVERLOADED if self._queued >= self.config.max_queued_requests
                       else None)
            if refusal is None:
                self._queued += 1
        if refusal is not None:
            message = (_STOPPING if refusal is ErrorCode.SHUTTING_DOWN
                       else f"{self.config.max_queued_requests} requests already queued")
            self._send_error(identity, request_id, refusal, message, request_type)
            return
        # The seats of the copy threads (transfer/threads.py) never make a request wait: only
        # these pools' queues do, so a load queues only behind other loads.
        pool = self._loads if kind is HandlerKind.LOAD else self._pool
        try:
            queued = pool.submit(self._run_queued, identity, request_id, request_type, handler,
                                 args, arrival, time.monotonic() + self.config.queue_deadline_s)
        except RuntimeError:  # stop() shut the pool down since the check above
            self._refuse_unstarted(identity, request_id, request_type)
            return
        queued.add_done_callback(
            lambda done: done.cancelled() and self._refuse_unstarted(identity, request_id, request_type))

    def _refuse_unstarted(self, identity: bytes, request_id: bytes, request_type: RequestType) -> None:
        """A worker request that stop() took off the queue before it started."""
        self._send_error(identity, request_id, ErrorCode.SHUTTING_DOWN, _STOPPING + "; not started",
                         request_type)
        self._count_done()

    def _count_done(self, *, deferred: bool = False) -> None:
        with self._queued_lock:
            if deferred:
                self._deferred -= 1
            else:
                self._queued -= 1
            if self._stopping:
                self._drained.notify_all()

    def _run_queued(self, identity: bytes, request_id: bytes, request_type: RequestType,
                    handler: Handler, args: list[Any], arrival: int, deadline: float) -> None:
        try:
            if time.monotonic() > deadline:
                # Its client has likely given up and moved on (a RETRIEVE's blocks may hold
                # other data by now): refuse rather than act late.
                self._send_error(identity, request_id, ErrorCode.OVERLOADED,
                                 f"{request_type.name} waited over {self.config.queue_deadline_s} s "
                                 "for a worker thread; not started", request_type)
                return
            if self._stopping:  # taken off the queue just as stop() began
                self._send_error(identity, request_id, ErrorCode.SHUTTING_DOWN, _STOPPING + "; not started",
                                 request_type)
                return
            self._run(identity, request_id, request_type, handler, args, arrival)
        finally:
            self._count_done()

    def _run(self, identity: bytes, request_id: bytes, request_type: RequestType,
             handler: Handler, args: list[Any], arrival: int) -> None:
        start = time.perf_counter()
        # The request as its handler sees it (dispatch.py): its order against
        # CANCEL_TRANSFERS, and the connection that owns what it registers.
        arrival_token, peer_token = ARRIVAL.set(arrival), PEER.set(identity)
        try:
            result = handler(*args)
        except FatalError as err:
            self._fail(err)
            self._reply(identity, request_id, request_type, start,
                        error=ServerError(ErrorCode.INTERNAL, f"{err}; the daemon exits to be restarted"))
            return
        except Exception as err:
            self._reply(identity, request_id, request_type, start, error=err)
            return
        finally:
            ARRIVAL.reset(arrival_token)
            PEER.reset(peer_token)
        if isinstance(result, Future):  # a deferred handler: reply when it completes
            with self._queued_lock:
                self._deferred += 1
            result.add_done_callback(
                lambda done: self._reply_when_done(identity, request_id, request_type, start, done))
            return
        if isinstance(result, ReplyThen):
            self._reply(identity, request_id, request_type, start, result=result.result)
            try:
                result.then()
            except Exception:
                logger.exception("%s: the bookkeeping after its reply failed", request_type.name)
            return
        self._reply(identity, request_id, request_type, start, result=result)

    def _fail(self, err: FatalError) -> None:
        """The daemon cannot serve on: refuse every request from now on (SHUTTING_DOWN, as when
        stopping) and say why in `failure`, which the daemon's main thread watches to exit."""
        with self._queued_lock:
            first = self.failure is None
            if first:
                self.failure = str(err)
                self._stopping = True
        if first:  # one line, whichever of the requests running meets it first
            logger.critical("%s; the daemon exits for its supervisor to restart it", err)

    def _reply_when_done(self, identity: bytes, request_id: bytes, request_type: RequestType,
                         start: float, done: Future) -> None:
        try:
            if done.cancelled():
                error: BaseException | None = ServerError(ErrorCode.SHUTTING_DOWN, _STOPPING)
            else:
                error = done.exception()
            if error is not None:
                self._reply(identity, request_id, request_type, start, error=error)
            else:
                self._reply(identity, request_id, request_type, start, result=done.result())
        finally:
            self._count_done(deferred=True)

    def _reply(self, identity: bytes, request_id: bytes, request_type: RequestType, start: float, *,
               result: Any = None, error: BaseException | None = None) -> None:
        """Send one handler's result or error (typed: a ServerError keeps its code)."""
        if error is None:
            try:
                status, body = ErrorCode.OK, self.codec.encode_reply(result)
            except Exception as err:
                status, body = self._error_reply(request_type, err)
        else:
            status, body = self._error_reply(request_type, error)
            # The error's traceback holds the handler's frames (a registration, a mapping): drop
            # it now rather than when the cycle collector gets to it (it kept a worker's memfd
            # open past its unregistration).
            error.__traceback__ = None
            error = None
        self._mq.reply(identity, request_id, status, body, before_send=lambda sent: self.metrics.request_done(
            request_type, ErrorCode(sent), time.perf_counter() - start))

    def _error_reply(self, request_type: RequestType, err: BaseException) -> tuple[ErrorCode, bytes]:
        """The error reply for a handler's exception: a ServerError keeps its code; anything else
        is a bug, logged with its traceback and answered INTERNAL."""
        if isinstance(err, ServerError):
            status = err.code if isinstance(err.code, ErrorCode) else ErrorCode.INTERNAL
            return status, self.codec.encode_error(status, err.message)
        logger.error("%s failed:\n%s", request_type.name, "".join(traceback.format_exception(err)))
        return ErrorCode.INTERNAL, self.codec.encode_error(
            ErrorCode.INTERNAL, f"{request_type.name} failed: {type(err).__name__}: {err}")

    def _send_error(self, identity: bytes, request_id: bytes, code: ErrorCode, message: str,
                    request_type: RequestType | None = None) -> None:
        if request_type is not None:  # counted first: a client that reads it after its reply sees it
            self.metrics.request_done(request_type, code, 0.0)
        self._mq.reply(identity, request_id, code, self.codec.encode_error(code, message))

    # ---- built-in handlers ------------------------------------------------------------------

    def _refuse_starting(self, *args: Any) -> None:
        elapsed = time.monotonic() - self.started_at
        raise ServerError(ErrorCode.STARTING, f"the daemon is starting ({elapsed:.1f} s so far): its engine "
                                              "is being built; only HELLO, PING and STATUS are answered yet, "
                                              "retry shortly")

    def _hello(self, client_protocol_version: int, client_name: str) -> HelloReply:
        if client_protocol_version != PROTOCOL_VERSION:
            logger.warning("client %r speaks protocol %d, this daemon %d", client_name[:_NAME_LOGGED],
                           client_protocol_version, PROTOCOL_VERSION)
        return HelloReply(
            protocol_version=PROTOCOL_VERSION,
            server_version=__version__,
            chunk_size=self.config.chunk_size,
            attach_socket=str(self.config.attach_socket),
            phase=self.phase,
            epoch=self.epoch,
        )

    def _status(self) -> StatusReport:
        with self._queued_lock:
            queued = self._queued
        report = StatusReport(
            server_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=time.monotonic() - self.started_at,
            chunk_size=self.config.chunk_size,
            endpoints=list(self.endpoints),
            phase=self.phase,
            requests_in_flight=queued,
            epoch=self.epoch,
            doors=self._doors() if self._doors is not None else [],
        )
        if self._status_extra is not None:  # the engine's fields, by name
            report = msgspec.structs.replace(report, **msgspec.structs.asdict(self._status_extra()))
        return report

