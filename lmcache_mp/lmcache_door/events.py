"""LMCache's KV event stream through the lmcache door: `subscribe_kv_events`, served from the daemon's
event log (`kv_events/log.py`), so that a router behind LMCache's connector learns which chunks the
pool gains and loses, evictions included, as it does from `lmcache server`.

The stream, as LMCache's wire carries it: the subscription is a request `[uid, "subscribe_kv_events",
instance_id, model_name, cursor, max_events]`; each batch goes back as a reply to that request, one per
credit: the client acks a batch it has read with `[uid, b"", b"ack"]` and ends the stream with
`[uid, b"", b"cancel"]`; a reply without payload ends it from the daemon's side.

What a batch says, in LMCache's terms:
- records of the CPU pool only (`medium` "CPU"), of the subscription's model, numbered by the log's
  sequence (+1: LMCache's cursors start at 0 before record 1);
- a chunk is named by LMCache's own hash of its tokens (`keys.lmcache_chunk_hashes`), with its
  parent's and its tokens, as `lmcache server` names it: the door learns them when it stores the
  chunk (`Bindings`, bounded). A chunk the door did not store in this daemon's life (our own
  connector's, a salted key's, one re-read after a restart) has no such name and is left out;
- records lost to the log's bound, and every clear of the log, are `lost`: the connector withdraws
  what it announced and learns the pool again from what follows; `incarnation` is this daemon's
  start, so a restarted daemon is a new one to it.

One thread serves every subscription, waking at each ack and every POLL_S; a subscription ends when
its client cancels it, when its instance subscribes again or is dropped (`liveness.py`), or when
MAX_STREAMS are open and it is the oldest.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from lmcache_mp.engine.hashing import chunk_hashes
from lmcache_mp.kv_events.log import CLEARED, POOL_SOURCE, STORED
from lmcache_mp.lmcache_door import wire
from lmcache_mp.lmcache_door.keys import lmcache_chunk_hashes

if TYPE_CHECKING:
    from lmcache_mp.kv_events.log import EventLog, Record

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often new records are looked for (an ack wakes the thread at once)
MAX_STREAMS = 256  # open subscriptions; past it the oldest is ended
READ_RECORDS = 4096  # records read from the log per look
DEFAULT_BINDING_BYTES = 64 << 20  # tokens kept for the events' stored records (~64k chunks of 256)
BINDING_OVERHEAD = 200  # bytes a binding costs beyond its tokens (hashes, entry, tuple)
CONTROL_ACK, CONTROL_CANCEL = b"ack", b"cancel"


class Binding(NamedTuple):
    """What LMCache's events say of one of our chunks."""

    lmcache_hash: bytes
    parent: bytes | None
    tokens: bytes  # native uint32, packed: 4 bytes a token, where a tuple of ints costs ~36


class Bindings:
    """Our chunk hash -> its `Binding`, learned at each store once anybody subscribed; the least
    recently bound forgotten past `limit_bytes`. Thread-safe."""

    def __init__(self, chunk_size: int, limit_bytes: int = DEFAULT_BINDING_BYTES):
        self._chunk_size = chunk_size
        self._limit = limit_bytes
        self._table: OrderedDict[bytes, Binding] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.wanted = False  # set by the first subscription: until then stores pay nothing here

    def bind(self, key: wire.Key) -> None:
        """Learn the names of the full chunks a store of `key` covers (a salted key's: none, as
        LMCache's connector names them without the salt)."""
        if not self.wanted or key.cache_salt:
            return
        tokens = key.tokens()
        size = self._chunk_size
        first, end = key.start // size, min(key.end, len(tokens)) // size
        if first >= end:
            return
        ours = chunk_hashes(tokens, size, end)
        theirs = lmcache_chunk_hashes(tokens, size, end)
        packed = array("I", tokens[first * size:end * size]).tobytes()
        step = 4 * size
        with self._lock:
            for i in range(first, end):
                offset = (i - first) * step
                self._put(ours[i], Binding(theirs[i], theirs[i - 1] if i else None,
                                           packed[offset:offset + step]))

    def _put(self, ours: bytes, binding: Binding) -> None:
        old = self._table.pop(ours, None)
        if old is not None:
            self._bytes -= len(old.tokens) + BINDING_OVERHEAD
        self._table[ours] = binding
        self._bytes += len(binding.tokens) + BINDING_OVERHEAD
        while self._bytes > self._limit and self._table:
            _, dropped = self._table.popitem(last=False)
            self._bytes -= len(dropped.tokens) + BINDING_OVERHEAD

    def get(self, ours: bytes) -> Binding | None:
        with self._lock:
            return self._table.get(ours)


def _token_ids(packed: bytes) -> list[int]:
    tokens = array("I")
    tokens.frombytes(packed)  # packed by `bind` in this process: native order both ways
    return tokens.tolist()


@dataclass
class _Stream:
    identity: bytes
    uid: bytes
    op_frame: bytes
    instance_id: int
    model_name: str
    max_events: int
    next_seq: int  # the log's next record to read
    credit: bool = True
    first: bool = True


class EventStreams:
    """Every subscription of the door, and the thread that sends their batches (module docstring)."""

    def __init__(self, send: Callable[[bytes, list[bytes]], None], bindings: Bindings):
        self._send = send
        self._bindings = bindings
        self._streams: OrderedDict[tuple[bytes, bytes], _Stream] = OrderedDict()
        self._by_instance: dict[int, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._log: EventLog | None = None
        self.incarnation = time.time_ns()
        self._encode = msgspec.msgpack.Encoder().encode
        self._thread = threading.Thread(target=self._run, name="lmcache-door-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def serve(self, log: EventLog) -> None:
        """The engine is built: its log is what the subscriptions follow."""
        self._log = log
        self._wake.set()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._streams.clear()
            self._by_instance.clear()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # ---- the client's side ---------------------------------------------------------------------------

    def subscribe(self, identity: bytes, request: wire.Request) -> None:
        instance_id, model_name, cursor, max_events = request.args
        self._bindings.wanted = True
        stream = _Stream(identity, request.uid, request.op_frame, instance_id, model_name, max_events,
                         next_seq=cursor)
        ended: list[_Stream] = []
        with self._lock:
            ended.extend(self._take(self._by_instance.get(instance_id)))  # one per instance, as LMCache's
            while len(self._streams) >= MAX_STREAMS:
                ended.extend(self._take(next(iter(self._streams))))
            self._streams[(identity, request.uid)] = stream
            self._by_instance[instance_id] = (identity, request.uid)
        for old in ended:
            self._end(old)
        self._wake.set()

    def control(self, identity: bytes, uid: bytes, action: bytes) -> bool:
        """An ack (the client read a batch: the next may go) or a cancel (the stream is over); False
        if it is neither, or names no open stream of that client."""
        with self._lock:
            stream = self._streams.get((identity, uid))
            if stream is None or action not in (CONTROL_ACK, CONTROL_CANCEL):
                return False
            if action == CONTROL_CANCEL:
                self._take((identity, uid))
            else:
                stream.credit = True
        self._wake.set()
        return True

    def drop(self, instance_id: int) -> None:
        """The instance's registration is gone: so is its subscription (ended, so that a live client
        subscribes again)."""
        with self._lock:
            taken = self._take(self._by_instance.get(instance_id))
        for stream in taken:
            self._end(stream)

    def _take(self, key: tuple[bytes, bytes] | None) -> list[_Stream]:
        stream = self._streams.pop(key, None) if key is not None else None
        if stream is None:
            return []
        if self._by_instance.get(stream.instance_id) == key:
            del self._by_instance[stream.instance_id]
        return [stream]

    def _end(self, stream: _Stream) -> None:
        self._send(stream.identity, [stream.uid, stream.op_frame])

    # ---- the batches ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            with self._lock:
                if self._stopping:
                    return
                ready = [s for s in self._streams.values() if s.credit]
            log = self._log
            if log is None:
                continue
            for stream in ready:
                try:
                    self._serve_one(log, stream)
                except Exception:  # a bug in one batch must not end every subscription
                    logger.exception("lmcache door: a KV event batch failed")

    def _serve_one(self, log: EventLog, stream: _Stream) -> None:
        if not stream.first and log.end <= stream.next_seq:
            return
        batch = self._batch(log, stream)
        if batch is None:
            return
        with self._lock:
            if self._streams.get((stream.identity, stream.uid)) is not stream:
                return  # cancelled or replaced meanwhile
            stream.credit, stream.first = False, False
        self._send(stream.identity, [stream.uid, stream.op_frame, self._encode(batch)])

    def _batch(self, log: EventLog, stream: _Stream) -> wire.KVEventBatch | None:
        """The stream's next batch (None: nothing to say), its cursor moved past what it covers."""
        got = log.read(stream.next_seq, READ_RECORDS)
        lost = got.missed
        events: list[wire.KVEventRecord] = []
        for seq, record in enumerate(got.records, start=got.first_seq):
            if record[0] == CLEARED:
                lost = lost or seq > 0  # record 0 starts the log: nothing was announced before it
                events.clear()
                continue
            event = self._event(log, seq, record, stream.model_name)
            if event is not None:
                events.append(event)
                if len(events) == stream.max_events:
                    break
        else:
            seq = got.next_seq - 1
        stream.next_seq = seq + 1
        if not (stream.first or events or lost):
            return None
        return wire.KVEventBatch(enabled=True, incarnation=self.incarnation, next_cursor=stream.next_seq,
                                 lost=lost, events=events)

    def _event(self, log: EventLog, seq: int, record: Record, model_name: str) -> wire.KVEventRecord | None:
        kind, source, chunk_hash, fingerprint, _ = record
        if source != POOL_SOURCE:
            return None  # a lower tier's: LMCache's events are of its CPU cache
        fmt = log.format_of(fingerprint)
        binding = self._bindings.get(chunk_hash)
        if fmt is None or fmt.model_name != model_name or binding is None:
            return None
        if kind == STORED:
            return wire.KVEventRecord(seq + 1, "stored", "CPU", model_name, [binding.lmcache_hash],
                                      binding.parent, _token_ids(binding.tokens))
        return wire.KVEventRecord(seq + 1, "removed", "CPU", model_name, [binding.lmcache_hash], None, [])
