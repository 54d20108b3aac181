"""`lmcache-mp kv-events`: follow a daemon's KV event stream as a router does, one JSON line per
event, so an operator can see what the daemon tells routers.

It subscribes first, then (with `from_start`) asks the replay socket for every batch kept, and
reads the live stream on from there, dropping what the replay already gave; a gap in the live
stream (batches ZeroMQ dropped for a slow reader) is filled by replay from the first one missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec
import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.kv_events.log import EventBatch
from lmcache_mp.kv_events.publisher import END_SEQ

REPLAY_TIMEOUT_S = 10.0


class Follower:
    """The stream's batches in seq order, each once (see the module docstring)."""

    def __init__(self, pub: str, replay: str, curve: ClientCurve | None = None):
        self._context = zmq.Context()
        self._curve = curve
        self._replay = replay
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub)
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self.next_seq: int | None = None  # None: from the first live batch on

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.secure(sock)
        return sock

    def replay(self, start: int, emit: Callable[[int, EventBatch], bool]) -> bool:
        """Every kept batch from `start`, to `emit` until it returns False; False if it did.
        TimeoutError if the replay socket does not answer."""
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self._replay)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    raise TimeoutError(f"no answer from the replay socket {self._replay}")
                _, _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return True
                if not self._take(int.from_bytes(seq_bytes, "big"), payload, emit):
                    return False
        finally:
            dealer.close()

    def live(self, emit: Callable[[int, EventBatch], bool], idle_timeout_s: float | None) -> None:
        """The live stream to `emit` until it returns False, or nothing came for `idle_timeout_s`."""
        timeout_ms = -1 if idle_timeout_s is None else int(idle_timeout_s * 1000)
        while self._sub.poll(timeout_ms):
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.next_seq is not None and seq > self.next_seq and not self.replay(self.next_seq, emit):
                return
            if not self._take(seq, payload, emit):
                return

    def _take(self, seq: int, payload: bytes, emit: Callable[[int, EventBatch], bool]) -> bool:
        if self.next_seq is not None and seq < self.next_seq:
            return True  # had it already
        self.next_seq = seq + 1
        return emit(seq, self._decoder.decode(payload))

    def close(self) -> None:
        self._sub.close()
        self._context.term()


def follow(pub: str, replay: str, *, curve: ClientCurve | None, from_start: bool, count: int | None,
           idle_timeout_s: float | None, write: Callable[[str], None]) -> int:
    """Write each event as a JSON line (its batch's seq and time, its type, its fields) until
    `count` events were written, or nothing came for `idle_timeout_s`; how many were written."""
    written = 0

    def emit(seq: int, batch: EventBatch) -> bool:
        nonlocal written
        for event in batch.events:
            if count is not None and written >= count:
                return False
            write(json.dumps({"seq": seq, "ts": batch.ts, **msgspec.to_builtins(event)}))
            written += 1
        return count is None or written < count

    follower = Follower(pub, replay, curve)
    try:
        if not from_start or follower.replay(0, emit):
            follower.live(emit, idle_timeout_s)
    finally:
        follower.close()
    return written
