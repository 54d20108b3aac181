"""Prometheus metrics: counted in process, scraped over HTTP on a loopback port.

Every series exists (at 0) from the start, so dashboards and alerts work before the first
request. The server and the engine report through the small `Metrics` interface; the pool
and lease gauges are read at scrape time, never updated on the hot path. The HTTP side is
`observability/http.py` (bounded, unlike prometheus_client's own server).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmcache_mp.observability.http import MetricsHTTPServer
from lmcache_mp.protocol import NATIVE_DOOR, ChunkOutcome, DoorInfo, ErrorCode, RequestType

_LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
                    0.5, 1.0, 2.5)


class _Gauges(Collector):
    """Pool, lease and registration gauges, and each lower tier's counters (labelled by tier),
    read from the engine at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]],
                 read_tiers: Callable[[], dict[str, dict[str, float]]]):
        self._read = read
        self._read_tiers = read_tiers

    def collect(self) -> Iterator[Metric]:
        for name, value in self._read().items():
            yield _family(f"lmcache_mp_{name}", name.replace("_", " "), value=value)
        families: dict[str, Metric] = {}
        for tier, values in self._read_tiers().items():
            for name, value in values.items():
                family = families.get(name)
                if family is None:
                    family = families[name] = _family(
                        f"lmcache_mp_tier_{name}", f"lower tier {name.replace('_', ' ')}", labels=["tier"])
                family.add_metric([tier], value)
        yield from families.values()


class _LookupChunks(Collector):
    """lmcache_mp_lookup_chunks_total{result="hit"|"miss"}, from the metrics' plain totals."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("lmcache_mp_lookup_chunks", "Chunks asked for by LOOKUP",
                                     labels=["result"])
        hits = self._metrics.lookup_hits_total
        family.add_metric(["hit"], hits)
        family.add_metric(["miss"], self._metrics.lookup_chunks_total - hits)
        yield family


class _CapacityCurve(Collector):
    """lmcache_mp_capacity_predicted_hit_ratio{pool_scale="0.5"|...|"8"}: the capacity advisor's
    predicted pool hit rate at that multiple of the pool's size, read at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("lmcache_mp_capacity_predicted_hit_ratio",
                                   "Pool hit rate predicted at a multiple of the pool's size",
                                   labels=["pool_scale"])
        for scale, ratio in self._read().items():
            family.add_metric([scale], ratio)
        yield family


class _Doors(Collector):
    """Per front door (`door="native"|"lmcache"`): lmcache_mp_door_requests_total{result="ok"|"failed"}
    and lmcache_mp_door_registered_instances, read at scrape time."""

    def __init__(self, read: Callable[[], list[DoorInfo]]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("lmcache_mp_door_requests", "Requests answered, by front door and "
                                       "result", labels=["door", "result"])
        registered = GaugeMetricFamily("lmcache_mp_door_registered_instances",
                                       "Instances registered through each front door", labels=["door"])
        for door in self._read():
            requests.add_metric([door.name, "ok"], door.requests_total - door.failed_total)
            requests.add_metric([door.name, "failed"], door.failed_total)
            registered.add_metric([door.name], door.registered_instances)
        yield requests
        yield registered


def _family(name: str, documentation: str, **kwargs) -> CounterMetricFamily | GaugeMetricFamily:
    """A `..._total` value only ever grows: typed as a counter, so Prometheus' rate() and
    Grafana treat restarts right; anything else is a gauge."""
    if name.endswith("_total"):
        return CounterMetricFamily(name.removesuffix("_total"), documentation, **kwargs)
    return GaugeMetricFamily(name, documentation, **kwargs)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmcache_mp_requests", "Requests answered, by type and status",
                                ["type", "status"], registry=self.registry)
        self.latency = Histogram("lmcache_mp_request_seconds", "Time from decoded request to reply",
                                 ["type"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.store_chunks = Counter("lmcache_mp_store_chunks", "Chunks offered to STORE, by outcome",
                                    ["outcome"], registry=self.registry)
        self.retrieve_chunks = Counter("lmcache_mp_retrieve_chunks", "Chunks asked for by RETRIEVE",
                                       ["result"], registry=self.registry)
        self.bytes = Counter("lmcache_mp_copied_bytes", "KV bytes copied", ["direction"],
                             registry=self.registry)
        # The lmcache door's requests (LMCache's connector's wire), as `requests` counts the native
        # door's: by operation (one of lmcache's, or "unknown") and result ("ok" or "failed").
        self.lmcache_door_requests = Counter(
            "lmcache_mp_lmcache_door_requests", "Requests the lmcache door answered, by operation and result",
            ["op", "result"], registry=self.registry)
        # Every request updates these: their children are looked up once here, not by `labels()`
        # per request (which costs more than a PING's own handling).
        self._latency = {rt: self.latency.labels(rt.name) for rt in RequestType}
        self._requests: dict[tuple[RequestType, ErrorCode], Counter] = {}
        for rt in RequestType:  # pre-register every series at 0
            for code in (ErrorCode.OK, ErrorCode.INVALID_ARGUMENT, ErrorCode.INTERNAL):
                self._requests[rt, code] = self.requests.labels(rt.name, code.name)
        # Every STORE and RETRIEVE updates these: their children too are looked up once, here.
        self._store_chunks = {outcome: self.store_chunks.labels(outcome.name.lower())
                              for outcome in ChunkOutcome}
        self._retrieve_chunks = {ok: self.retrieve_chunks.labels("loaded" if ok else "failed")
                                 for ok in (True, False)}
        self._bytes = {direction: self.bytes.labels(direction) for direction in ("store", "retrieve")}
        # Plain totals (for STATUS's hit rate), exported as lmcache_mp_lookup_chunks_total at
        # scrape time: a LOOKUP adds to two ints instead of taking two counters' locks.
        self.lookup_chunks_total = 0
        self.lookup_hits_total = 0
        self.registry.register(_LookupChunks(self))

    def watch(self, read: Callable[[], dict[str, float]],
              read_tiers: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.registry.register(_Gauges(read, read_tiers))

    def watch_doors(self, read: Callable[[], list[DoorInfo]]) -> None:
        """`read()`: the front doors as STATUS shows them, for their per-door series."""
        self.registry.register(_Doors(read))

    def answered(self, door: str) -> tuple[int, int]:
        """A door's requests answered since start, and of those the failed ones."""
        counter, label, ok = ((self.requests, "status", ErrorCode.OK.name) if door == NATIVE_DOOR
                              else (self.lmcache_door_requests, "result", "ok"))
        total = failed = 0
        for metric in counter.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):  # not `_created`
                    total += int(sample.value)
                    failed += int(sample.value) if sample.labels[label] != ok else 0
        return total, failed

    def watch_capacity(self, read: Callable[[], dict[str, float]]) -> None:
        """`read()`: the predicted pool hit rate by pool scale (`status.capacity_gauges`)."""
        self.registry.register(_CapacityCurve(read))

    def serve(self, host: str, port: int) -> MetricsHTTPServer:
        """Serve http://HOST:PORT/metrics on a daemon thread from now on (OSError if the port is
        taken); the server is returned for `close()`, which the daemon never needs."""
        server = MetricsHTTPServer(host, port, self.registry)
        server.start()
        return server

    def request_done(self, request_type: RequestType, status: ErrorCode, seconds: float) -> None:
        requests = self._requests.get((request_type, status))
        if requests is None:  # a status first seen now
            requests = self._requests[request_type, status] = self.requests.labels(request_type.name,
                                                                                    status.name)
        requests.inc()
        self._latency[request_type].observe(seconds)

    def looked_up(self, asked: int, hits: int) -> None:
        self.lookup_chunks_total += asked
        self.lookup_hits_total += hits

    def stored(self, outcomes: list[ChunkOutcome], chunk_bytes: int) -> None:
        for outcome in set(outcomes):  # one increment per outcome, not per chunk (each takes a lock)
            self._store_chunks[outcome].inc(outcomes.count(outcome))
        self._bytes["store"].inc(chunk_bytes * outcomes.count(ChunkOutcome.STORED))

    def retrieved(self, chunks: int, ok: bool, chunk_bytes: int) -> None:
        self._retrieve_chunks[ok].inc(chunks)
        if ok:
            self._bytes["retrieve"].inc(chunk_bytes * chunks)
