"""The daemon's KV event stream (`--kv-events-listen`): the event log, published for the whole node.

Wire-compatible with vLLM's `ZmqEventPublisher`, so a router that subscribes to vLLM engines
subscribes here the same way:
- a PUB socket sends each batch as three frames: topic (empty), the batch's sequence number
  (8 bytes, big-endian, from 0 at every daemon start) and the msgpack batch (`kv_events`);
- a ROUTER replay socket answers a request [empty, start seq (8 bytes)] with every kept batch from
  that seq on, each [empty, topic, seq, batch], then [empty, empty, -1 (8 bytes), empty].

One thread owns both sockets. Every BATCH_INTERVAL_S it takes what the log gained and publishes it
in batches of at most MAX_BATCH_EVENTS, so a STORE never waits for a subscriber. The log's resyncs
wait for this thread instead (`EventLog.pace_by`): it tells the log how far it has read.

Lost records. If the log's ring overwrote records before this thread read them, they are counted
as dropped (a warning at most every LOST_WARNING_INTERVAL_S) and the stream resyncs (`on_missed`:
AllBlocksCleared, then every source announces what it holds). The thread first skips to the
log's end: what the ring still holds is as stale as what it lost, and a thread that went on from
the oldest record kept would meet the resync's own records overwriting it, lose again, resync
again, for ever.

Memory, per peer, bounded:
- replay keeps the newest batches up to REPLAY_KEPT_BYTES, whatever their number (a resync of a
  large tier makes many large batches); a replay asked for from further back starts at the oldest;
- a subscriber that does not keep up loses live batches past PUB_HWM queued for it (ZeroMQ's
  high-water mark; it catches up through replay). Every subscriber's queue holds the same bytes;
- a replay is sent as far as its peer's queue (REPLAY_HWM batches) takes, then resumed as the peer
  reads, from the batches kept (no copy per peer); at most MAX_REPLAYS go on at once, a new one
  past them ending the one waiting longest. A peer that never reads holds REPLAY_HWM batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq

from lmcache_mp.curve import ServerCurve
from lmcache_mp.kv_events.log import EventLog, encode_batch
from lmcache_mp.sockets import SocketAccess, ipc_path

logger = logging.getLogger(__name__)

BATCH_INTERVAL_S = 0.005
MAX_BATCH_EVENTS = 1024  # events per published batch: ~220 bytes each (more for a long model name)
REPLAY_KEPT_BYTES = 64 * 2**20  # the newest batches kept for replay, up to this many bytes
BATCH_OVERHEAD_BYTES = 128  # what a kept batch costs besides its payload (counted against the bound)
PUB_HWM = 256  # batches queued per subscriber before dropping for it: ~64 MiB at most
REPLAY_HWM = 32  # batches queued per replay peer
MAX_REPLAYS = 64  # replays in progress at once
MAX_REQUESTS_PER_TICK = 64  # replay requests taken per pass of the thread
LOST_WARNING_INTERVAL_S = 10.0  # the least time between two warnings of one kind
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b""


def replay_endpoint(endpoint: str) -> str:
    """The replay socket beside a PUB endpoint: PATH.replay for ipc://PATH, the next port for TCP."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + 1}"


class Throttled:
    """A warning logged at most once per LOST_WARNING_INTERVAL_S, with what happened since the last:
    `template` formatted with `count` (the amounts noted added up) and `times` (the notes)."""

    def __init__(self, template: str):
        self._template = template
        self._count = self._times = 0
        self._next = 0.0

    def note(self, count: int = 1) -> None:
        self._count += count
        self._times += 1
        now = time.monotonic()
        if now >= self._next:
            logger.warning(self._template, {"count": self._count, "times": self._times})
            self._count = self._times = 0
            self._next = now + LOST_WARNING_INTERVAL_S


class KeptBatches:
    """The newest published batches, up to `limit_bytes` (payload plus BATCH_OVERHEAD_BYTES each)."""

    def __init__(self, limit_bytes: int):
        self._limit = limit_bytes
        self._batches: dict[int, bytes] = {}
        self.first = 0  # the oldest kept batch's seq
        self.end = 0  # the seq of the next batch
        self.nbytes = 0

    def add(self, seq: int, payload: bytes) -> None:
        self._batches[seq] = payload
        self.end = seq + 1
        self.nbytes += len(payload) + BATCH_OVERHEAD_BYTES
        while self.nbytes > self._limit and self.first < seq:
            self.nbytes -= len(self._batches.pop(self.first)) + BATCH_OVERHEAD_BYTES
            self.first += 1

    def get(self, seq: int) -> bytes:
        return self._batches[seq]


class Replays:
    """Replay answers in progress, one per peer, each sent as far as its peer's queue takes."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._pending: OrderedDict[bytes, list[int]] = OrderedDict()  # peer -> [next seq, end seq]

    def ask(self, peer: bytes, start: int, kept: KeptBatches) -> None:
        """A peer's request: every batch kept from `start` to the newest now, then the end mark."""
        if self._pending.pop(peer, None) is None and len(self._pending) >= MAX_REPLAYS:
            self._pending.popitem(last=False)
        self._pending[peer] = [start, kept.end]

    def send(self, kept: KeptBatches) -> bool:
        """Up to REPLAY_HWM batches to each peer, as far as its queue takes; whether any went."""
        sent = False
        for peer, cursor in list(self._pending.items()):
            cursor[0] = before = max(cursor[0], kept.first)  # those dropped since: from the oldest kept
            if self._send_to(peer, cursor, kept):
                del self._pending[peer]
                sent = True
            sent = sent or cursor[0] != before
        return sent

    def _send_to(self, peer: bytes, cursor: list[int], kept: KeptBatches) -> bool:
        """Whether the answer is complete (or the peer gone); else `cursor` moves past what went."""
        try:
            for _ in range(REPLAY_HWM):
                if cursor[0] >= cursor[1]:
                    self._sock.send_multipart((peer, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                    return True
                seq = cursor[0]
                # copy=False: a payload is handed to ZeroMQ by reference, not copied per peer.
                self._sock.send_multipart((peer, b"", TOPIC, seq.to_bytes(8, "big"), kept.get(seq)),
                                          zmq.NOBLOCK, copy=False)
                cursor[0] = seq + 1
            return False
        except zmq.Again:  # its queue is full: the rest once it reads
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # it went away
                return True
            raise


class EventPublisher:
    """Publishes an `EventLog` on PUB with replay (see the module docstring)."""

    def __init__(self, log: EventLog, endpoint: str, replay: str, *, curve: ServerCurve | None = None,
                 access: SocketAccess | None = None, on_missed: Callable[[], None] | None = None):
        self._log = log
        self._on_missed = on_missed
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER)
        self._auth = curve.secure(self._context, self._pub, self._replay) if curve is not None else None
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer queue says so (EAGAIN)
        for sock in (self._pub, self._replay):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            for url in (endpoint, replay):
                path = ipc_path(url)
                if path is not None and access is not None:
                    access.make_directory(path.parent)
            self._pub.bind(endpoint)
            self._replay.bind(replay)
        except BaseException:
            self._close_sockets()
            raise
        for url in (endpoint, replay):
            path = ipc_path(url)
            if path is not None and access is not None:
                access.secure(path)
        self.endpoints = [endpoint, replay]
        self._next_seq = 0  # the log's first record on: the clear that starts the stream
        log.pace_by(0)
        self._batch_seq = 0
        self._kept = KeptBatches(REPLAY_KEPT_BYTES)
        self._replays = Replays(self._replay)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # the counters, read by STATUS
        self.batches_total = 0
        self.events_total = 0
        self.dropped_total = 0
        self.replays_total = 0
        self._lost_warning = Throttled(
            "KV event publisher: %(count)d events lost before they could be published (the log's ring "
            "overran the publisher, %(times)d time(s) since the last such warning); resyncing subscribers")
        self._malformed_warning = Throttled(
            "KV event publisher: ignored %(count)d malformed replay request(s) since the last such warning")
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lmcache-mp-kv-events", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"batches_total": self.batches_total, "events_total": self.events_total,
                    "dropped_total": self.dropped_total, "replays_total": self.replays_total}

    def close(self) -> None:
        """Publish what the log holds, stop the thread, close (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join()
        self._log.pace_by(None)  # a resync waiting for this thread goes on without it
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        busy = False  # more to do at once: no wait for the next interval
        while not self._stop.is_set():
            try:
                if poller.poll(0 if busy else BATCH_INTERVAL_S * 1000):
                    self._take_requests()
                busy = self._publish_pending()
                busy = self._replays.send(self._kept) or busy
            except Exception:  # a bug must not end the stream for good
                logger.exception("KV event publisher: publishing failed; going on")
                busy = False
        try:
            self._publish_pending()
        except Exception:
            logger.exception("KV event publisher: publishing at close failed")

    def _publish_pending(self) -> bool:
        """Publish the records the log holds now (bounded: later ones wait for the next pass);
        whether more came meanwhile."""
        end = self._log.end
        while self._next_seq < end:
            got = self._log.read(self._next_seq, MAX_BATCH_EVENTS)
            if got.missed:
                self._skip_to_end()
                break
            self._next_seq = got.next_seq
            self._log.pace_by(self._next_seq)
            if got.records:
                self._send([self._log.vllm_event(record) for record in got.records])
        return self._log.end > self._next_seq

    def _skip_to_end(self) -> None:
        """Records were lost before this thread read them: on from the log's end, then resync (see
        the module docstring)."""
        end = self._log.end
        with self._lock:
            self.dropped_total += end - self._next_seq
        self._lost_warning.note(end - self._next_seq)
        self._next_seq = end
        self._log.pace_by(end)
        if self._on_missed is not None:
            self._on_missed()

    def _send(self, events: list) -> None:
        payload = encode_batch(self._encoder, events)
        seq = self._batch_seq
        self._pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload), copy=False)
        self._kept.add(seq, payload)
        self._batch_seq += 1
        with self._lock:
            self.batches_total += 1
            self.events_total += len(events)

    def _take_requests(self) -> None:
        for _ in range(MAX_REQUESTS_PER_TICK):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                self.replays_total += 1
            if len(frames) != 3 or len(frames[2]) != 8:
                self._malformed_warning.note()
                continue
            self._replays.ask(frames[0], int.from_bytes(frames[2], "big"), self._kept)
