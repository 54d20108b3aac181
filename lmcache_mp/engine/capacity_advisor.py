"""What other pool sizes would buy: the pool's hit rate predicted at 0.5x to 8x its capacity, from
the LOOKUPs the daemon sees.

Method: a miss-ratio curve from reuse distances (Mattson's stack algorithm), spatially sampled
with bounded memory (fixed-size SHARDS: Waldspurger et al., FAST 2015). The reuse distance of an
access is the number of distinct chunks accessed since the last access of the same chunk; an LRU
cache of C chunks hits exactly the accesses whose distance is below C, so one histogram of
distances answers for every size at once. First accesses (cold misses) miss at every size.

Sampling: a chunk hash is already uniformly random bytes, so its first 8 bytes (big-endian) are
its sample value, and a chunk is tracked when that value is below a threshold T (the sampling
rate is T / 2^64). The check is one bytes comparison per chunk of a LOOKUP, against T's 8 bytes
(for hashes of 8 bytes or more, as every chunk hash is, it is the same as comparing the values);
most chunks stop there once the rate is low. At most `max_tracked` chunks (8,192) are tracked:
one more lowers T to the largest tracked value and forgets the chunks at or above it. And the
rate is held to what samples MAX_SAMPLED_PER_LOOKUP chunks of the average LOOKUP (a LOOKUP is
recorded on the socket thread: the time bound); on the tests' traces the curve stays within a
point of exact either way. A sampled
distance stands for distance / rate real chunks, and a sampled access for 1 / rate accesses
(the histogram's weight, so accesses sampled before a rate change keep their due share).
The few hottest chunks (a shared system prompt's, in every LOOKUP) are each sampled or not, and
can hold a large share of the accesses: whether they were sampled moves the sum of the weights
away from the real count of accesses, by 10% in the tests' traces. As SHARDS_adj does, the
difference (accesses less weights) is counted as hits of distance 0: the hottest chunks' share
(that took the predicted hit rates from 3-7 points above the exact ones to within 1.5).

Distances: the tracked chunks' last access times, kept sorted (new times are the latest, so they
are appended). A chunk's distance is the number of times after its previous one (bisect), which is
then removed: O(log n) to find, and a memmove of the times after it, at most `max_tracked`
pointers. Measured here against a Fenwick tree over the times in pure Python: 0.5 us an access
against 1.6 us, with no compaction of times to do. Distances go into logarithmic buckets, 64 per
doubling (exact below 128 chunks, within 1/64 above); a capacity inside a bucket takes its share
of that bucket, as if its distances were spread evenly.

How a LOOKUP maps to the pool. It names a chain of chunk hashes in prefix order and finds what the
pool holds before anything of its request moves; then vLLM STOREs the chunks it missed, so every
chunk looked up is present afterwards; and the pool evicts prefix-aware: within a chain an
ancestor is always more recent than its descendants (`pool/chains.py`). So all of a
LOOKUP's chunks are recorded, hits and misses alike: their distances are read first, as the
LOOKUP finds them, then they become the most recent, last chunk first, the first chunk last (the
most recent), as the pool orders them. (Recording them one by one, last first, counted a chain's
new tail into the distances of its own prefix: 4.5 points under the hit rate measured on a
64-chunk daemon in the tests; now the two agree.) Each chunk is recorded by its hash alone, not its
pool key (hash, format fingerprint) per rank: the ranks of one engine store and lose a chunk
together.

Bytes: a capacity in bytes is turned into chunks with the mean pool bytes of a looked-up chunk,
every rank's object of it (the engine gives each LOOKUP's: its chunk size times its ranks),
weighted as the accesses are. That is what the pool stores per chunk, where its mean bytes per
object (used bytes / objects) would miss that a chunk takes one object per rank.

Limits: it predicts the CPU pool alone, as if no lower tier were below it (a chunk the pool
evicted but a disk tier still holds counts as a miss here, where LOOKUP counts it found); it
models the pool as one LRU of chunks, so it ignores the space chunks pinned by leases take, the
slack of slabs (up to one slab of the pool holds no chunk: 1/8 of a small pool, 64 MiB of a
large one), separate LRUs of different chunk sizes, CLEAR, the chunks a warm restart adopts
(their first access counts as cold), and a pool file's background checksums (a chunk pinned for
its checksum while an eviction looks returns as the most recent: a daemon measured up to 0.6
points off its exact prediction in the tests, none without a pool file). Chunks of two models
with equal hashes count as one.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading

from lmcache_mp.protocol import CapacityPoint

SCALES = (0.5, 1.0, 2.0, 4.0, 8.0)  # the pool sizes predicted, as multiples of the pool's
MAX_TRACKED = 8192  # chunks tracked at most: the memory bound (about 2 MiB)
# Chunks sampled per LOOKUP on average, at most: the time bound. A LOOKUP is recorded on the
# daemon's socket thread (after its reply, before the next request), at ~0.6 us per sampled
# chunk: sampling every chunk of 128-chunk LOOKUPs measured ~80 us more per LOOKUP
# (bench_control_plane), where 8 cost ~5 us.
MAX_SAMPLED_PER_LOOKUP = 8.0
_SPACE = 1 << 64  # sample values are a hash's first 8 bytes
_SUB_BITS = 6
_SUB = 1 << _SUB_BITS  # histogram buckets per doubling of the distance


def _bucket(distance: float) -> int:
    """The histogram bucket of a (scaled) distance: its integer part below 2 * _SUB, then _SUB
    buckets per doubling."""
    if distance < 2 * _SUB:
        return int(distance)
    mantissa, exponent = math.frexp(distance)
    return _SUB * (exponent - _SUB_BITS - 1) + int(mantissa * 2 * _SUB)


def _bounds(bucket: int) -> tuple[int, int]:
    """The distances a bucket holds: (lowest, width)."""
    if bucket < 2 * _SUB:
        return bucket, 1
    shift = bucket // _SUB - 1
    return (_SUB + bucket % _SUB) << shift, 1 << shift


class CapacityAdvisor:
    """The LOOKUPs' reuse-distance histogram (module docstring). Thread-safe: LOOKUPs `record`
    on the daemon's socket thread, STATUS and /metrics read `curve` from others."""

    def __init__(self, max_tracked: int = MAX_TRACKED,
                 max_sampled_per_lookup: float | None = MAX_SAMPLED_PER_LOOKUP) -> None:
        """`max_sampled_per_lookup`: None samples at the rate the memory bound allows alone."""
        self._max_tracked = max_tracked
        self._max_per_lookup = max_sampled_per_lookup
        self._lookups = 0
        self._lock = threading.Lock()
        # Sample a chunk whose hash is below `_cut` (None: every chunk); `_weight` is 1 / rate.
        self._cut: bytes | None = None
        self._weight = 1.0
        self._last: dict[bytes, int] = {}  # tracked chunk -> its last access time
        self._times: list[int] = []  # the tracked chunks' last access times, ascending
        self._by_value: list[tuple[int, bytes]] = []  # heap of (-sample value, chunk), tracked ones
        self._clock = 0
        # Weights of the accesses by distance bucket (at most `max_tracked` chunks of distance at
        # the lowest rate, T = 1), of all accesses, and their pool bytes.
        self._histogram = [0.0] * (_bucket(float(max_tracked) * _SPACE) + 1)
        self._total = 0.0
        self._bytes = 0.0
        self._accesses = 0  # sampled or not
        self.sampled = 0  # sampled accesses: what the curve rests on

    def record(self, hashes: list[bytes], chunk_bytes: int) -> None:
        """One LOOKUP's chunk hashes, in prefix order; `chunk_bytes`: the pool bytes one of its
        chunks takes (all ranks). Its chunks' distances are read before any of them moves (the
        LOOKUP finds what is there before its STORE adds anything), then they move, last chunk
        first. Loops with their state in locals: at a rate of 1 (until `max_tracked` chunks were
        seen) every chunk of every LOOKUP comes through them."""
        if not hashes:
            return  # a LOOKUP of no chunk (only a tail, `tails.py`): no access
        with self._lock:
            self._accesses += len(hashes)
            self._lookups += 1
            if self._max_per_lookup is not None:  # the rate that samples that many, on average
                self._cap_rate(self._max_per_lookup * self._lookups / self._accesses)
            cut = self._cut
            sampled = hashes if cut is None else [h for h in hashes if h < cut]
            if not sampled:
                return
            last, times, histogram, weight = self._last, self._times, self._histogram, self._weight
            seen: set[int] = set()  # where the chunks seen before are in `times`
            for chunk in sampled:
                previous = last.get(chunk)
                if previous is not None:  # else a cold miss: in no bucket
                    i = bisect.bisect_left(times, previous)
                    seen.add(i)
                    distance = (len(times) - 1 - i) * weight
                    histogram[int(distance) if distance < 2 * _SUB else _bucket(distance)] += weight
            for i in sorted(seen, reverse=True):
                del times[i]
            clock = self._clock
            for chunk in dict.fromkeys(reversed(sampled)):
                if chunk not in last:
                    heapq.heappush(self._by_value, (-int.from_bytes(chunk[:8], "big"), chunk))
                times.append(clock)
                last[chunk] = clock
                clock += 1
            self._clock = clock
            self.sampled += len(sampled)
            self._total += len(sampled) * weight
            self._bytes += len(sampled) * weight * chunk_bytes
            while len(last) > self._max_tracked:
                self._lower_rate()

    def curve(self, pool_bytes: int) -> list[CapacityPoint]:
        """The predicted hit rate at each of SCALES times `pool_bytes` (0 before any LOOKUP)."""
        with self._lock:
            chunk_bytes = self._bytes / self._total if self._total else 0.0
            return [CapacityPoint(scale, round(pool_bytes * scale),
                                  self._hit_rate(pool_bytes * scale / chunk_bytes) if chunk_bytes else 0.0)
                    for scale in SCALES]

    def hit_rate(self, capacity_chunks: float) -> float:
        """The predicted hit rate of an LRU pool of `capacity_chunks` chunks."""
        with self._lock:
            return self._hit_rate(capacity_chunks)

    @property
    def tracked(self) -> int:
        """Chunks tracked now (never more than `max_tracked`)."""
        return len(self._last)

    @property
    def rate(self) -> float:
        """The sampling rate: 1 until more than `max_tracked` chunks were seen, then about
        `max_tracked` over the distinct chunks seen."""
        return 1 / self._weight

    def _lower_rate(self) -> None:
        """Lower the threshold to the largest tracked value (the chunks of one LOOKUP may all be
        tracked first: the bound holds between LOOKUPs)."""
        self._lower_cut(-self._by_value[0][0])

    def _cap_rate(self, rate: float) -> None:
        """Sample at `rate` at most (a rate, once lowered, is never raised: the chunks it left out
        have no history)."""
        if rate < 1 / self._weight:
            self._lower_cut(int(rate * _SPACE))

    def _lower_cut(self, top: int) -> None:
        """Sample the values below `top` only: forget the tracked chunks at or above it."""
        while self._by_value and -self._by_value[0][0] >= top:
            _, chunk = heapq.heappop(self._by_value)
            del self._times[bisect.bisect_left(self._times, self._last.pop(chunk))]
        top = max(top, 1)  # values of 0 only: a rate of 2^-64, never 0
        self._cut = top.to_bytes(8, "big")
        self._weight = _SPACE / top

    def _hit_rate(self, capacity_chunks: float) -> float:
        """Accesses of distance below the capacity (whole chunks), over all accesses; what the
        weights miss of the accesses counts as hits of distance 0 (module docstring)."""
        limit = math.floor(capacity_chunks)
        if not self._total or limit < 1:
            return 0.0
        bucket = min(_bucket(limit), len(self._histogram))
        hits = sum(self._histogram[:bucket]) + self._accesses - self._total
        if bucket < len(self._histogram):
            lowest, width = _bounds(bucket)
            hits += self._histogram[bucket] * (limit - lowest) / width
        return min(max(hits / self._accesses, 0.0), 1.0)
