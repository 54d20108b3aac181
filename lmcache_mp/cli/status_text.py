"""`lmcache-mp status` as an operator reads it: a few summary lines and two tables."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_mp.protocol import StatusReport


def _pool_file(s: StatusReport) -> str:
    if not s.pool_file:
        return "none: the pool is lost at a restart"
    adopted = (f"adopted {s.pool_adopted_chunks:,} chunks ({_size(s.pool_adopted_bytes)}) at start, "
               f"{s.pool_verified_total:,} verified, {s.pool_dropped_total:,} dropped, "
               f"{s.pool_unverified:,} to verify" if s.pool_adopted_chunks else "started empty")
    return f"{s.pool_file}: {adopted}; {s.pool_unsealed:,} new chunks to checksum"


def _advice(s: StatusReport) -> str:
    """The capacity advisor's curve: what other pool sizes would hit."""
    if not s.capacity_sampled_chunks:
        return "no lookups yet to predict other pool sizes' hit rates from"
    rates = " | ".join(f"{p.pool_scale:g}x {p.hit_rate:.0%}" for p in s.capacity_curve)
    return f"predicted pool hit rate at {rates} ({s.capacity_sampled_chunks:,} chunk lookups sampled)"


def _events(s: StatusReport) -> str:
    """Where KV events go, and how many went."""
    if not s.kv_events_endpoints:
        return f"not published (--kv-events-listen); {s.kv_events_seq:,} in the log connectors follow"
    pub, replay = s.kv_events_endpoints
    resyncing = ", resyncing" if s.kv_events_resyncing else ""
    return (f"published on {pub} (replay {replay}): {s.kv_events_published_total:,} events in "
            f"{s.kv_events_batches_total:,} batches, {s.kv_events_dropped_total:,} lost, "
            f"{s.kv_events_resyncs_total:,} resyncs{resyncing}")


def _doors(s: StatusReport) -> str:
    """Each front door: where, and what it served (the lmcache door: LMCache's own connector)."""
    return " | ".join(f"{d.name} on {' '.join(d.endpoints)}: {d.requests_total:,} requests "
                      f"({d.failed_total:,} failed), {d.registered_instances} registered" for d in s.doors)


def render_status(url: str, s: StatusReport) -> str:
    hit_rate = f"{s.lookup_hits_total / s.lookup_chunks_total:.1%}" if s.lookup_chunks_total else "-"
    used = s.pool_used_bytes / s.pool_bytes if s.pool_bytes else 0.0
    prepared = "ready" if s.pool_ready else f"{_size(s.pool_ready_bytes)} prepared so far"
    if s.pool_pin_error:  # the operator should know why copies to GPUs are slower than they could be
        prepared += (f"; pinned only {_size(s.pool_pinned_bytes)} ({s.pool_pin_error}): copies to and "
                     "from GPUs beyond that are staged and slower")
    elif s.pool_pinned_bytes:
        prepared += ", pinned"
    lines = [
        f"lmcache-mp {s.server_version} at {url} (protocol {s.protocol_version}), "
        f"up {_duration(s.uptime_s)}, chunk size {s.chunk_size} tokens, {s.phase}",
        f"pool      {_size(s.pool_used_bytes)} of {_size(s.pool_bytes)} used ({used:.0%}), "
        f"{s.objects:,} chunks; {prepared}",
        f"pool file {_pool_file(s)}",
        f"lookups   {s.lookup_chunks_total:,} chunks asked, {s.lookup_hits_total:,} found: "
        f"hit rate {hit_rate}",
        f"capacity  {_advice(s)}",
        f"tails     {s.tails_indexed:,} indexed, {s.tails_noted_total:,} noted and "
        f"{s.tails_offered_total:,} offered to returning turns since start",
        f"kv events {_events(s)}",
        f"leases    {s.leases:,} chunks leased by {s.sessions:,} sessions",
        f"requests  {s.requests_in_flight} in flight, {s.transfers_running} copies running, "
        f"{s.cancelled_transfers} cancelled transfers remembered",
        *([f"doors     {_doors(s)}"] if s.doors else []),
        "",
        "instances",
    ]
    rows = [[str(i.instance_id), i.model_name, f"{i.worker_id}/{i.world_size}", i.layout, str(i.num_layers),
             f"{i.num_blocks:,}", _size(i.kv_bytes), i.door] for i in s.instances]
    header = ["id", "model", "rank", "layout", "layers", "blocks", "KV cache", "door"]
    lines += _table(header, rows) if rows else ["  none"]
    lines += ["", "tiers"]
    rows = [[t.name, "yes" if t.up else "DOWN", f"{t.objects:,}", _capacity(t.bytes, t.capacity_bytes),
             f"{t.hits_total:,}", f"{t.misses_total:,}", f"{t.promotions_total:,}",
             f"{t.corrupt_total + t.errors_total + t.write_errors_total:,}",
             f"{t.read_latency_p99_ms:.1f}/{t.write_latency_p99_ms:.1f}",
             f"{t.write_queue_chunks:,} ({_size(t.write_queue_bytes)})"] for t in s.tiers]
    header = ["tier", "up", "objects", "used", "hits", "misses", "promoted", "errors", "p99 ms r/w",
              "write queue"]
    lines += _table(header, rows) if rows else ["  none (the CPU pool only)"]
    return "\n".join(lines)


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [list(header), *rows]) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [list(header), *rows]]


def _capacity(used: int, capacity: int) -> str:
    if not capacity:  # a network tier: the server evicts, by its own policy
        return _size(used)
    return f"{_size(used)} / {_size(capacity)}"


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"
