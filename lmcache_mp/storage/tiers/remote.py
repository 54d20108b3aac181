"""Tiers behind a network (Valkey/Redis, the v1 remote server): degrade, never fail a request.

A network tier can time out, lose its server, or lose one node of a cluster. None of that may
reach vLLM: `NetworkTier` turns every failure into misses (reads) and skipped writes, logs one
warning, and marks the tier *down*. While down, the tier answers at once without touching the
network (a dead server would otherwise cost every LOOKUP a timeout), and a background thread
probes the server with exponential backoff (0.5 s, 1 s, 2 s ... at most 30 s). When a probe
answers, the tier is *up* again and logs so. The backoff keeps growing across flaps (a probe
that succeeds while real operations keep failing, e.g. one dead node of a cluster) and resets
only when a real operation succeeds.

A concrete tier implements five network primitives, each for a whole batch, and raises any
exception in `transient_errors` when the network fails; everything else (verification against
the key, counting, latency, the up/down state) is done here, once for every network tier:

    _exists_many(keys) -> list[bool]
    _fetch_many(keys, outs) -> list[Fetched | None]   None: absent. A Fetched's payload is either
                                                      the `out` given (bytes received straight
                                                      into it) or a view into a received blob
    _store_many(items) -> [bool]                      which of the (key, header, payload) items were
                                                      stored; items come lazily, each header
                                                      checksummed when its turn comes
    _delete_many(keys) -> int                         how many were removed
    _ping()                                           raises unless the server answers

and, where the protocol allows, `_clear_namespace()` and `_drop_models(models)` (CLEAR_TIERS,
RESET_MODEL: each a scan of the server, refused while the tier is down).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import torch

from lmcache_mp.chunks import ChunkKey, TierStats
from lmcache_mp.storage.chunk_format import CorruptChunk, as_buffer, encode_header, header_size, verify
from lmcache_mp.storage.tiers.base import StorageTier

logger = logging.getLogger(__name__)
R = TypeVar("R")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
LATENCY_WINDOW = 512  # operations kept for the latency percentiles
# Keys found damaged on a read, remembered so that `contains` denies them until rewritten (a
# protocol without DELETE leaves them on the server, and write-behind skips chunks it holds).
BAD_KEYS_REMEMBERED = 4096
CHECKSUM_SLICE_BYTES = 4 << 20  # a background write checksums in slices, pacing between them


def backoff_delay(failures: int) -> float:
    """Seconds to wait after `failures` failures in a row: 0.5, 1, 2, ... at most 30."""
    return min(RETRY_FIRST_S * 2 ** (failures - 1), RETRY_MAX_S)


class Backoff:
    """When to try again each of several things (cluster nodes) that failed: 0.5 s after the
    first failure, doubling up to 30 s, reset by a success. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, tuple[float, int]] = {}  # name -> (retry at, failures in a row)

    def may_try(self, name: str) -> bool:
        with self._lock:
            retry_at, _ = self._state.get(name, (0.0, 0))
        return time.monotonic() >= retry_at

    def failed(self, name: str) -> float:
        """Record a failure; returns the delay before the next try."""
        with self._lock:
            failures = self._state.get(name, (0.0, 0))[1] + 1
            delay = backoff_delay(failures)
            self._state[name] = (time.monotonic() + delay, failures)
        return delay

    def succeeded(self, name: str) -> bool:
        """Record a success; returns whether `name` had failed before it."""
        with self._lock:
            return self._state.pop(name, None) is not None


@dataclass
class Fetched:
    """A chunk as received: its header and its payload (the `out` buffer, or a view of a blob)."""

    header: bytes | memoryview
    payload: memoryview | torch.Tensor
    verified: bool = False  # the tier checked it against its key already, as it landed

    @classmethod
    def from_blob(cls, blob: bytes) -> Fetched:
        """A stored value received whole, as header and payload; a value too damaged to split is
        all header (the verification that follows rejects it)."""
        view = memoryview(blob)
        try:
            size = header_size(view)
        except CorruptChunk:
            return cls(view, view[:0])
        return cls(view[:size], view[size:])


class NetworkTier(StorageTier):
    contains_is_cheap: ClassVar[bool] = False
    # What a failing network raises: counted, logged once, and the tier goes down. Anything
    # else is a bug, and propagates (the manager and the writer log it and carry on).
    transient_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(self, name: str) -> None:
        self.name = name  # the URL, redacted
        self._lock = threading.Lock()
        self._up = True
        self._failures = 0  # consecutive failed operations, for the probe's backoff
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        self._bad: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self._latency = {"read": deque(maxlen=LATENCY_WINDOW), "write": deque(maxlen=LATENCY_WINDOW)}
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "writes", "write_errors", "errors", "unavailable",
             "read_bytes", "written_bytes"), 0)

    # ---- the network primitives of a concrete tier --------------------------------------------

    @abstractmethod
    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def _fetch_many(self, keys: list[ChunkKey], outs: list[torch.Tensor | None]) -> list[Fetched | None]: ...

    @abstractmethod
    def _store_many(self, items: Iterable[tuple[ChunkKey, bytes, memoryview]]) -> list[bool]: ...

    @abstractmethod
    def _delete_many(self, keys: list[ChunkKey]) -> int: ...

    @abstractmethod
    def _ping(self) -> None: ...

    def _close_connections(self) -> None:
        """Release sockets and clients (called once, at close)."""

    # ---- StorageTier ----------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Iterable[ChunkKey]) -> list[bool]:
        keys = list(keys)
        found = self._guarded("read", "EXISTS", len(keys), self._exists_many, keys)
        if found is None:
            return [False] * len(keys)
        with self._lock:
            return [there and k.ident not in self._bad for k, there in zip(keys, found, strict=True)]

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.batched_get([key], [out] if out is not None else None)[0]

    def batched_get(self, keys: Iterable[ChunkKey],
                    outs: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        keys = list(keys)
        out_list: list[torch.Tensor | None] = list(outs) if outs is not None else [None] * len(keys)
        fetched = self._guarded("read", "GET", len(keys), self._fetch_many, keys, out_list)
        if fetched is None:
            return [None] * len(keys)
        results = [self._accept(k, f, o) for k, f, o in zip(keys, fetched, out_list, strict=True)]
        corrupt = [k for k, f, r in zip(keys, fetched, results, strict=True) if f is not None and r is None]
        if corrupt:
            with self._lock:
                for key in corrupt:
                    self._bad[key.ident] = None
                while len(self._bad) > BAD_KEYS_REMEMBERED:
                    self._bad.popitem(last=False)
            self._delete(corrupt)
        return results

    def put(self, key: ChunkKey, kv_chunk: torch.Tensor, blocking: bool = True) -> None:
        self.batched_put([(key, kv_chunk)], blocking)

    def batched_put(self, keys_and_chunks: Iterable[tuple[ChunkKey, torch.Tensor]],
                    blocking: bool = True) -> int:
        pairs = [(key, as_buffer(chunk)) for key, chunk in keys_and_chunks]
        if not pairs:
            return 0

        def encoded() -> Iterator[tuple[ChunkKey, bytes, memoryview]]:
            # Each header is checksummed as its chunk's turn comes, so that a tier that sends
            # chunk by chunk checksums one while the server receives the one before.
            for key, payload in pairs:
                yield key, encode_header(key, payload, CHECKSUM_SLICE_BYTES, self.pacer), payload

        done = self._guarded("write", "SET", len(pairs), self._store_many, encoded()) or [False] * len(pairs)
        stored = [pair for pair, ok in zip(pairs, done, strict=True) if ok]
        with self._lock:
            for key, _ in stored:
                self._bad.pop(key.ident, None)
                if self.events is not None:
                    self.events.stored(key)
        self._count(writes=len(stored), write_errors=len(pairs) - len(stored),
                    written_bytes=sum(payload.nbytes for _, payload in stored))
        return len(stored)

    def remove(self, key: ChunkKey) -> None:
        self._delete([key])

    def _delete(self, keys: list[ChunkKey]) -> None:
        self._guarded("write", "DELETE", len(keys), self._delete_many, keys)
        if self.events is not None:
            for key in keys:
                self.events.removed(key)

    def clear(self) -> int:
        return self._sweep("clearing", self._clear_namespace)

    def drop_models(self, models: Set[str]) -> int:
        return self._sweep("dropping the model's chunks", lambda: self._drop_models(models))

    def _sweep(self, what: str, sweep: Callable[[], int]) -> int:
        """`sweep()` of the server's keys; ConnectionError if the tier is down or the sweep fails
        (it may have removed some)."""
        if not self.is_up:
            raise ConnectionError(f"{self.name} is down: {what} was not done")
        try:
            return sweep()
        except self.transient_errors as e:
            self._went_down(what, e)
            raise ConnectionError(f"{self.name}: {what} failed ({type(e).__name__}: {e})") from None

    def _clear_namespace(self) -> int:
        """Delete every key of this tier's namespace; how many."""
        raise NotImplementedError(f"{self.name} cannot be cleared")

    def _drop_models(self, models: Set[str]) -> int:
        """Delete every key of `models`' chunks in this tier's namespace; how many."""
        raise NotImplementedError(f"{self.name} cannot drop a model's chunks")

    def stats(self) -> TierStats:
        with self._lock:
            c = dict(self._counts)
            up = self._up
            read = sorted(self._latency["read"])
            write = sorted(self._latency["write"])
        return TierStats(
            name=self.name, hits_total=c["hits"], misses_total=c["misses"], corrupt_total=c["corrupt"],
            writes_total=c["writes"], write_errors_total=c["write_errors"], up=int(up),
            errors_total=c["errors"], unavailable_total=c["unavailable"], read_bytes_total=c["read_bytes"],
            written_bytes_total=c["written_bytes"],
            read_latency_p50_ms=_percentile_ms(read, 0.5), read_latency_p99_ms=_percentile_ms(read, 0.99),
            write_latency_p50_ms=_percentile_ms(write, 0.5), write_latency_p99_ms=_percentile_ms(write, 0.99))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._prober is not None:
            self._prober.join(timeout=RETRY_MAX_S)
        self._close_connections()

    # ---- degrade, never fail ------------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        with self._lock:
            return self._up

    def _guarded(self, kind: str, op: str, count: int, call: Callable[..., R], *args: object) -> R | None:
        """`call(*args)` for `count` chunks, timed; None (and the tier goes down) when the network
        fails, or at once while the tier is down."""
        if not self.is_up or self._closed.is_set():
            self._count(unavailable=count)
            return None
        start = time.perf_counter()
        try:
            result = call(*args)
        except self.transient_errors as e:
            self._went_down(op, e)
            self._count(unavailable=count)
            return None
        with self._lock:
            self._latency[kind].append(time.perf_counter() - start)
            self._failures = 0
        return result

    def _went_down(self, op: str, error: BaseException, level: int = logging.WARNING) -> None:
        with self._lock:
            self._counts["errors"] += 1
            self._failures += 1
            if not self._up:
                return  # another thread saw it first
            self._up = False
            delay = backoff_delay(self._failures)
            self._prober = threading.Thread(target=self._probe, args=(delay,), daemon=True,
                                            name=f"lmcache-mp-probe-{self.name}")
        logger.log(level, "%s: %s failed (%s: %s); until it answers again, reads are misses and writes "
                   "are skipped; retrying in %.1f s", self.name, op, type(error).__name__, error, delay)
        self._prober.start()

    def _probe(self, delay: float) -> None:
        down_at = time.monotonic()
        while not self._closed.wait(delay):
            try:
                self._ping()
            except self.transient_errors as e:
                delay = min(delay * 2, RETRY_MAX_S)
                logger.debug("%s: still unreachable (%s); next try in %.1f s", self.name, e, delay)
                continue
            with self._lock:
                self._up = True
            logger.warning("%s: reachable again after %.1f s", self.name, time.monotonic() - down_at)
            return

    # ---- verification -------------------------------------------------------------------------

    def _accept(self, key: ChunkKey, fetched: Fetched | None,
                out: torch.Tensor | None) -> torch.Tensor | None:
        """The verified chunk (in `out` when given), or None for an absent or corrupt one."""
        if fetched is None:
            self._count(misses=1)
            return None
        try:
            if not fetched.verified:
                verify(key, fetched.header, fetched.payload)
            if out is not None and as_buffer(out).nbytes != as_buffer(fetched.payload).nbytes:
                raise CorruptChunk(f"{as_buffer(fetched.payload).nbytes} bytes where a chunk has "
                                   f"{as_buffer(out).nbytes}")
        except CorruptChunk as e:
            logger.warning("%s: dropped a damaged or foreign chunk (%s)", self.name, e.reason)
            self._count(corrupt=1)
            return None
        chunk = self._into(fetched.payload, out)
        self._count(hits=1, read_bytes=chunk.numel())
        return chunk

    @staticmethod
    def _into(payload: memoryview | torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if isinstance(payload, torch.Tensor) and (out is None or payload.data_ptr() == out.data_ptr()):
            return payload
        data = np.frombuffer(as_buffer(payload), dtype=np.uint8)  # read-only when it views a blob
        if out is None:
            return torch.from_numpy(data.copy())
        np.copyto(out.numpy(), data)
        return out

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta


def _percentile_ms(sorted_seconds: list[float], q: float) -> float:
    if not sorted_seconds:
        return 0.0
    return 1000.0 * sorted_seconds[min(len(sorted_seconds) - 1, int(q * len(sorted_seconds)))]
