"""A KV event subscriber as a router runs one: SUB for the live stream, DEALER for replay, every
batch decoded with vLLM's own classes, and the holdings the events describe, per residence."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from lmcache_mp.curve import ClientCurve

END_SEQ = -1

# Where a block is: (medium, ownership); a block: (hash, fingerprint), the daemon's extra field
# saying which cache (vLLM's decoder leaves it out; the raw map keeps it).
Residence = tuple[str | None, str | None]
Block = tuple[Any, str | None]


class Holdings:
    """What a subscriber believes the publisher holds, from its events in seq order."""

    def __init__(self) -> None:
        self.held: dict[Residence, set[Block]] = defaultdict(set)
        self.next_seq = 0  # the batch seq expected next: what a replay asks from
        self.gaps = 0
        self.events = 0
        self.stored: list[BlockStored] = []  # every BlockStored and BlockRemoved, in order of arrival
        self.removed: list[BlockRemoved] = []

    def apply(self, seq: int, batch: KVEventBatch, raw: list[dict[str, Any]]) -> None:
        if seq < self.next_seq:
            return  # seen already (live and replay overlap)
        if seq > self.next_seq:  # some were lost: left for a replay from `next_seq` to bring in order
            self.gaps += 1
            return
        self.next_seq = seq + 1
        for event, fields in zip(batch.events, raw, strict=True):
            self.events += 1
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
                continue
            where = (event.medium, event.ownership)
            blocks = {(h, fields.get("fingerprint")) for h in event.block_hashes}
            if isinstance(event, BlockStored):
                self.held[where] |= blocks
                self.stored.append(event)
            else:
                assert isinstance(event, BlockRemoved)
                self.held[where] -= blocks
                self.removed.append(event)


class Subscriber:
    def __init__(self, pub_url: str, replay_url: str, *, rcvhwm: int = 100_000,
                 curve: ClientCurve | None = None):
        self._context = zmq.Context()
        self._curve = curve
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub_url)
        self._replay_url = replay_url
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.holdings = Holdings()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        if self._curve is not None:
            self._curve.secure(sock)
        return sock

    def _decode(self, payload: bytes) -> tuple[KVEventBatch, list[dict[str, Any]]]:
        raw = msgspec.msgpack.decode(payload)  # [ts, [event maps...]]
        return self._decoder.decode(payload), raw[1]

    def poll(self, timeout_s: float = 0.1) -> int:
        """Apply the live batches that arrive within `timeout_s`; how many."""
        got = 0
        deadline = time.monotonic() + timeout_s
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            _, seq, payload = self.sub.recv_multipart()
            self.holdings.apply(int.from_bytes(seq, "big"), *self._decode(payload))
            got += 1
        return got

    def replay(self, start: int = 0, timeout_s: float = 10.0) -> int:
        """Ask for every kept batch from `start` and apply them; how many came."""
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self._replay_url)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = 0
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay answer from {self._replay_url} in {timeout_s} s")
                _, _, seq, payload = dealer.recv_multipart()
                seq_number = int.from_bytes(seq, "big", signed=True)
                if seq_number == END_SEQ:
                    return got
                self.holdings.apply(seq_number, *self._decode(payload))
                got += 1
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self._context.term()
