"""What the engine reports: its part of STATUS (typed), and its gauges for /metrics.

`engine_status` reads one snapshot of the engine's parts into `EngineStatus`, whose fields are
`protocol.StatusReport`'s by the same names (checked below): the server fills in its own fields
and merges these (`Server._status`). `gauges`, `tier_gauges` and `capacity_gauges` are read by
Prometheus at scrape time (`observability/metrics.py`): a name per series, `lmcache_mp_` prefixed there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from lmcache_mp.chunks import TierStats
from lmcache_mp.protocol import CapacityPoint, InstanceInfo, StatusReport

if TYPE_CHECKING:
    from lmcache_mp.engine.engine import Engine


class EngineStatus(msgspec.Struct, gc=False):
    """The engine's part of STATUS (see `StatusReport` for each field's meaning)."""

    pool_bytes: int
    pool_used_bytes: int
    pool_ready_bytes: int
    pool_ready: bool
    pool_pinned_bytes: int
    pool_pin_error: str
    pool_file: str
    pool_adopted_chunks: int
    pool_adopted_bytes: int
    pool_adopted_unsealed: int
    pool_verified_total: int
    pool_dropped_total: int
    pool_unverified: int
    pool_unsealed: int
    objects: int
    registered_instances: list[int]
    instances: list[InstanceInfo]
    lookup_chunks_total: int
    lookup_hits_total: int
    capacity_curve: list[CapacityPoint]
    capacity_sampled_chunks: int
    sessions: int
    leases: int
    transfers_running: int
    cancelled_transfers: int
    split_chunks: int
    tiers: list[TierStats]
    kv_events_endpoints: list[str]
    kv_events_seq: int
    kv_events_batches_total: int
    kv_events_published_total: int
    kv_events_dropped_total: int
    kv_events_resyncs_total: int
    kv_events_resyncing: bool
    tails_indexed: int
    tails_offered_total: int
    tails_noted_total: int


assert set(EngineStatus.__struct_fields__) <= set(StatusReport.__struct_fields__), \
    "every engine status field is a STATUS field"


def engine_status(engine: Engine) -> EngineStatus:
    pool, tiers = engine.storage.stats()
    sessions, leases = engine.sessions.counts()
    copying, cancelled = engine.fence.counts()
    published = engine.kv_events_counters()
    return EngineStatus(
        pool_bytes=pool.capacity_bytes,
        pool_used_bytes=pool.used_bytes,
        pool_ready_bytes=pool.ready_bytes,
        pool_ready=pool.ready_bytes >= pool.capacity_bytes,
        pool_pinned_bytes=pool.pinned_bytes,
        pool_pin_error=pool.pin_error,
        pool_file=pool.pool_file,
        pool_adopted_chunks=pool.adoption.adopted_objects,
        pool_adopted_bytes=pool.adoption.adopted_bytes,
        pool_adopted_unsealed=pool.adoption.adopted_unsealed,
        pool_verified_total=pool.adoption.verified_total,
        pool_dropped_total=pool.adoption.dropped_total,
        pool_unverified=pool.unverified,
        pool_unsealed=pool.unsealed,
        objects=pool.num_objects,
        registered_instances=engine.registry.instance_ids(),
        instances=engine.registry.describe(),
        lookup_chunks_total=engine.metrics.lookup_chunks_total,
        lookup_hits_total=engine.metrics.lookup_hits_total,
        capacity_curve=engine.capacity.curve(pool.capacity_bytes),
        capacity_sampled_chunks=engine.capacity.sampled,
        sessions=sessions,
        leases=leases,
        transfers_running=copying,
        cancelled_transfers=cancelled,
        split_chunks=engine.copy_threads.helped_chunks,
        tiers=tiers,
        kv_events_endpoints=engine.publisher.endpoints if engine.publisher is not None else [],
        kv_events_seq=engine.events.end,
        kv_events_batches_total=published["batches_total"],
        kv_events_published_total=published["events_total"],
        kv_events_dropped_total=published["dropped_total"],
        kv_events_resyncs_total=published["resyncs_total"],
        kv_events_resyncing=bool(published["resyncing"]),
        tails_indexed=len(engine.tails),
        tails_offered_total=engine.tails.offered_total,
        tails_noted_total=engine.tails.noted_total,
    )


def gauges(engine: Engine) -> dict[str, float]:
    """The pool's, the sessions' and the registrations' gauges, by series name."""
    stats = engine.storage.pool_stats()
    sessions, leases = engine.sessions.counts()
    return {
        "pool_capacity_bytes": stats.capacity_bytes,
        "pool_used_bytes": stats.used_bytes,
        "pool_objects": stats.num_objects,
        "pool_pinned_objects": stats.num_pinned,
        "pool_writing_objects": stats.num_writing,
        "pool_evictions_total": stats.evictions,
        "pool_ready_bytes": stats.ready_bytes,
        "pool_pinned_bytes": stats.pinned_bytes,
        # 1 once pinning failed: the rest of the pool is used unpinned (slower copies to GPUs)
        "pool_pin_failed": int(bool(stats.pin_error)),
        # Warm restart (0 without a pool file): what this start adopted, checked and dropped
        "pool_adopted_chunks": stats.adoption.adopted_objects,
        "pool_adopted_bytes": stats.adoption.adopted_bytes,
        "pool_adopted_unsealed_chunks": stats.adoption.adopted_unsealed,
        "pool_adopted_verified_total": stats.adoption.verified_total,
        "pool_adopted_dropped_total": stats.adoption.dropped_total,
        "pool_unverified_chunks": stats.unverified,
        "pool_unsealed_chunks": stats.unsealed,
        "lease_sessions": sessions,
        "leases": leases,
        "lease_sessions_expired_total": engine.sessions.expired_total,
        "retrieve_split_chunks_total": engine.copy_threads.helped_chunks,
        "capacity_sampled_chunks_total": engine.capacity.sampled,
        "registered_instances": len(engine.registry.instance_ids()),
        # requests' tails in the index (`tails.py`); noted since start, and offered by LOOKUPs
        "tails_indexed": len(engine.tails),
        "tails_noted_total": engine.tails.noted_total,
        "tails_offered_total": engine.tails.offered_total,
        **_kv_event_counters(engine),
        "attach_channels": engine.registry.num_attach_channels,
    }


def capacity_gauges(engine: Engine) -> dict[str, float]:
    """The predicted pool hit rates, by pool scale ("0.5" ... "8"; for /metrics, labelled)."""
    curve = engine.capacity.curve(engine.storage.pool_stats().capacity_bytes)
    return {f"{point.pool_scale:g}": point.hit_rate for point in curve}


def _kv_event_counters(engine: Engine) -> dict[str, float]:
    """Events recorded in the log; batches and events published, events lost (the log's ring overran
    the publisher), replay requests served (0 without --kv-events-listen); resyncs finished, and 1
    while one is asked for or running."""
    published = engine.kv_events_counters()
    return {"kv_events_recorded_total": engine.events.end,
            "kv_events_batches_total": published["batches_total"],
            "kv_events_published_total": published["events_total"],
            "kv_events_dropped_total": published["dropped_total"],
            "kv_events_replays_total": published["replays_total"],
            "kv_events_resyncs_total": published["resyncs_total"],
            "kv_events_resyncing": published["resyncing"]}


def tier_gauges(engine: Engine) -> dict[str, dict[str, float]]:
    """Per lower tier: its counters by name (for /metrics, labelled by tier)."""
    _, tiers = engine.storage.stats()
    return {t.name: {k: v for k, v in vars(t).items() if k != "name"} for t in tiers}
