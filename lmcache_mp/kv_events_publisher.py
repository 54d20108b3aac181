"""The daemon's KV event stream (`--kv-events-listen`): the event log, published for the whole node.

Wire-compatible with vLLM's `ZmqEventPublisher`, so a router that subscribes to vLLM engines
subscribes here the same way:
- a PUB socket sends each batch as three frames: topic (empty), the batch's sequence number
  (8 bytes, big-endian, from 0 at every daemon start) and the msgpack batch (`kv_events`);
- a ROUTER replay socket answers a request [empty, start seq (8 bytes)] with every kept batch from
  that seq on, each [empty, topic, seq, batch], then [empty, empty, -1 (8 bytes), empty].

One thread owns both sockets. Every BATCH_INTERVAL_S it takes what the log gained and publishes it
as one batch, so a STORE never waits for a subscriber: PUB drops messages for a subscriber that
does not keep up (ZeroMQ's high-water mark; it catches up through replay), and records the
publisher did not reach before the log's ring overwrote them are counted as dropped, after which
the stream resyncs (`on_missed`: AllBlocksCleared, then every source announces what it holds).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from lmcache_mp.curve import ServerCurve
from lmcache_mp.kv_events import EventLog, encode_batch
from lmcache_mp.sockets import SocketAccess, ipc_path

logger = logging.getLogger(__name__)

BATCH_INTERVAL_S = 0.005
MAX_BATCH_EVENTS = 4096  # events per published batch: a resync of a large tier is spread out
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's default buffer_steps)
PUB_HWM = 100_000  # messages ZeroMQ queues per subscriber before dropping for it
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b""


def replay_endpoint(endpoint: str) -> str:
    """The replay socket beside a PUB endpoint: PATH.replay for ipc://PATH, the next port for TCP."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + 1}"


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
        self._batch_seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # the counters, read by STATUS
        self.batches_total = 0
        self.events_total = 0
        self.dropped_total = 0
        self.replays_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-mp-kv-events", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"batches_total": self.batches_total, "events_total": self.events_total,
                    "dropped_total": self.dropped_total, "replays_total": self.replays_total}

    def close(self) -> None:
        """Publish what the log holds, then close (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
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
        while True:
            stopping = self._stop.is_set()
            try:
                if poller.poll(0 if stopping else BATCH_INTERVAL_S * 1000):
                    self._serve_replay()
                while self._publish_some():
                    pass
            except Exception:  # a bug must not end the stream for good
                logger.exception("KV event publisher: publishing failed; going on")
            if stopping:
                return

    def _publish_some(self) -> bool:
        """Publish one batch of what the log gained; whether there may be more."""
        got = self._log.read(self._next_seq, MAX_BATCH_EVENTS)
        if got.missed:
            lost = got.first_seq - self._next_seq
            with self._lock:
                self.dropped_total += lost
            logger.warning("KV event publisher: %d events were lost before they could be published "
                           "(the log's ring is full); resyncing subscribers", lost)
        self._next_seq = got.next_seq
        if got.records:
            self._send([self._log.vllm_event(record) for record in got.records])
        if got.missed and self._on_missed is not None:
            self._on_missed()
        return len(got.records) == MAX_BATCH_EVENTS

    def _send(self, events: list) -> None:
        payload = encode_batch(self._encoder, events)
        seq = self._batch_seq.to_bytes(8, "big")
        self._pub.send_multipart((TOPIC, seq, payload), copy=False)
        self._kept.append((self._batch_seq, payload))
        self._batch_seq += 1
        with self._lock:
            self.batches_total += 1
            self.events_total += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        with self._lock:
            self.replays_total += 1
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV event publisher: ignoring a malformed replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._kept:
            if seq >= start:
                self._replay.send_multipart((identity, b"", TOPIC, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
