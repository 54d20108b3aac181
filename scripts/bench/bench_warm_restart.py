"""Warm restart: from a daemon's start to its first hit on the chunks the last daemon
held, per pool size, next to the same pool started empty (--fresh-pool) in the same run.

    python scripts/bench/bench_warm_restart.py [--sizes-gb 1 4 16] [--out bench-out]

Per size: a daemon fills its pool file with 32 MiB chunks (bench_data_plane's 32x8 geometry:
STOREs of 8 chunks from one worker, every chunk under its own hashes) and is stopped with SIGTERM
(a clean stop checksums, "seals", what it has not yet). Then, twice each, alternating:
- warm: `lmcache-mp serve` on the same pool file; from its start, the first PING, the engine
  serving (the pool adopted), the first hit (a LOOKUP of the newest chunk, by a scheduler whose
  worker registered as soon as the daemon served: a LOOKUP names formats through a registration),
  and every adopted chunk verified; it checks that every chunk was adopted, none dropped, and that
  the newest chunk reads back bit-exact;
- empty: the same with --fresh-pool, to serving and to a prepared pool (what an empty start costs),
  and with `--pool-file ""` (anonymous memory, as before pools lived in a file), both before the
  pool is filled.
The pool file is kept between the warm runs and discarded at the end. Sizes that do not fit in the
available memory (with 4 GiB to spare) are skipped, saying so. Target: the first adopted hit within
2 s of the start.
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

import torch
from bench_data_plane import CHUNK, CHUNKS_PER_REQUEST, DEFAULT, DTYPE, hashes_for, make_kv
from harness import available_gib, figure, finish, parser, scratch

from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import PHASE_SERVING, RequestType, StatusReport
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, start_daemon
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

SPARE_GIB = 4
TARGET_FIRST_HIT_S = 2.0  # from the start, for a 16 GiB pool
POLL_S = 0.005
G = DEFAULT
FILL_SHARE = 0.9  # of the pool that `fill` stores into
CHUNK_BYTES = G.layers * G.blocks_per_chunk * G.kv_heads * G.block * 2 * 128 * DTYPE.itemsize
REQUEST_BLOCKS = list(range(CHUNKS_PER_REQUEST * G.blocks_per_chunk))


def daemon_args(size_gb: float, *extra: str) -> tuple[str, ...]:
    return ("--l1-size-gb", str(size_gb), "--chunk-size", str(CHUNK), *extra)


def requests_filling(size_gb: float) -> int:
    """The requests `fill` stores into a pool of `size_gb`: FILL_SHARE of it."""
    return int(size_gb * 2**30 * FILL_SHARE / (CHUNK_BYTES * CHUNKS_PER_REQUEST))


def fill(url: str, kv: dict[str, torch.Tensor], size_gb: float) -> int:
    """STOREs until the pool holds FILL_SHARE of its size; returns how many requests were stored."""
    worker = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, G.block)
    try:
        worker.register_kv_caches(kv, "CPU_ATTN")
        requests = requests_filling(size_gb)
        for it in range(requests):
            op = LoadStoreOp(REQUEST_BLOCKS, block_hashes=hashes_for(it, G))
            keys = worker._keys.keys_for(f"f{it}", op)
            result = worker.mq_client.submit(RequestType.STORE, [keys, worker.instance_id, REQUEST_BLOCKS,
                                                                 b""]).result(120)
            assert all(o == 0 for o in result.outcomes), result.outcomes
        return requests
    finally:
        worker.shutdown()


def _status(client: MessageQueueClient) -> StatusReport:
    return client.submit(RequestType.STATUS, []).result(30)


def _wait(what: str, condition, timeout_s: float = 300.0) -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(POLL_S)
    return time.monotonic()


def warm_start(tmp: Path, size_gb: float, kv: dict[str, torch.Tensor], newest: int, stored: int) -> dict:
    """Start on the kept pool file; seconds from start to PING, serving, first hit, all verified."""
    daemon = start_daemon(tmp, *daemon_args(size_gb), serving=False, pool_ready=False)
    t0 = daemon.started_at
    ping = time.monotonic()
    probe = MessageQueueClient(daemon.url)
    try:
        serving = _wait("serving", lambda: _status(probe).phase == PHASE_SERVING)
        worker = LMCacheMPWorkerAdapter(daemon.url, None, "bench", 1, 0, G.block)
        scheduler = LMCacheMPSchedulerAdapter(daemon.url, None, "bench", 1, 0, G.block)
        try:
            worker.register_kv_caches(kv, "CPU_ATTN")
            hashes = hashes_for(newest, G)

            def hit() -> bool:
                scheduler.maybe_submit_lookup_request("probe", block_hashes=hashes)
                while (found := scheduler.check_lookup_result("probe")) is None:
                    time.sleep(0.0005)
                scheduler.cleanup_lookup_result("probe")
                return found == CHUNKS_PER_REQUEST * CHUNK

            first_hit = _wait("the first hit", hit)
            verified = _wait("every adopted chunk verified",
                             lambda: _status(probe).pool_unverified == 0)
            report = daemon_status(daemon.url)
            assert report.pool_adopted_chunks == stored * CHUNKS_PER_REQUEST, report
            assert report.pool_dropped_total == 0, report
            check_newest(worker, scheduler, kv, newest)
        finally:
            worker.shutdown()
            scheduler.shutdown()
    finally:
        probe.close()
        assert daemon.stop(signal.SIGTERM, keep_pool=True) == 0
    return {"ping_s": ping - t0, "serving_s": serving - t0, "first_hit_s": first_hit - t0,
            "verified_s": verified - t0, "adopted_gib": report.pool_adopted_bytes / 2**30}


def check_newest(worker: LMCacheMPWorkerAdapter, scheduler: LMCacheMPSchedulerAdapter,
                 kv: dict[str, torch.Tensor], newest: int) -> None:
    """RETRIEVE the newest request's chunks into other blocks: bit-exact with what was stored."""
    scheduler.maybe_submit_lookup_request("check", block_hashes=hashes_for(newest, G))
    while scheduler.check_lookup_result("check") is None:
        time.sleep(0.0005)
    scheduler.cleanup_lookup_result("check")
    target = list(range(len(REQUEST_BLOCKS), 2 * len(REQUEST_BLOCKS)))
    keys = worker._keys.keys_for("check", LoadStoreOp(target, block_hashes=hashes_for(newest, G)))
    reply = worker.mq_client.submit(RequestType.RETRIEVE, [keys, worker.instance_id, target, b""]).result(120)
    assert reply.ok, reply.reason
    first = next(iter(kv.values()))
    assert torch.equal(first[target].view(torch.int16), first[REQUEST_BLOCKS].view(torch.int16)), \
        "the adopted chunks read back other bytes than were stored"


def empty_start(tmp: Path, size_gb: float, *extra: str) -> dict:
    daemon = start_daemon(tmp, *daemon_args(size_gb, "--fresh-pool", *extra), serving=False, pool_ready=False)
    t0 = daemon.started_at
    probe = MessageQueueClient(daemon.url)
    try:
        serving = _wait("serving", lambda: _status(probe).phase == PHASE_SERVING)
        ready = _wait("pool ready", lambda: _status(probe).pool_ready)
    finally:
        probe.close()
        daemon.stop(keep_pool=False)
    return {"serving_s": serving - t0, "pool_ready_s": ready - t0}


def run(size_gb: float, tmp: Path) -> dict:
    home = tmp / f"{size_gb:g}g"
    home.mkdir()
    # Empty starts first (a large pool and its kept copy would not fit side by side): a new pool
    # file, and an anonymous pool (`--pool-file ""`, the only pool before pool files).
    empty: dict[str, list[dict]] = {"empty": [], "anonymous": []}
    for i in range(2):
        for name, extra in (("empty", ()), ("anonymous", ("--pool-file", ""))):
            empty_home = home / f"{name}-{i}"
            empty_home.mkdir()
            empty[name].append(empty_start(empty_home, size_gb, *extra))
    buffer, kv = make_kv(G)
    del buffer
    daemon: DaemonProcess = start_daemon(home, *daemon_args(size_gb, "--fresh-pool"), ready_timeout=600)
    try:
        stored = fill(daemon.url, kv, size_gb)
    finally:
        assert daemon.stop(signal.SIGTERM, timeout=120, keep_pool=True) == 0
    print(f"{size_gb:g} GiB: stored {stored * CHUNKS_PER_REQUEST} chunks of {CHUNK_BYTES / 2**20:.0f} MiB",
          flush=True)
    warm = []
    try:
        for _ in range(2):
            warm.append(warm_start(home, size_gb, kv, stored - 1, stored))
    finally:
        daemon.discard_pool()
    row = {f"warm {k}": statistics.median(r[k] for r in warm) for k in warm[0]}
    for name, runs in empty.items():
        row |= {f"{name} {k}": statistics.median(r[k] for r in runs) for k in runs[0]}
    for name, value in row.items():
        print(f"  {name:<22}{value:8.2f}")
    return row


def plot(figures: dict[str, dict[str, float]], path: Path) -> None:
    names = ["anonymous serving_s", "anonymous pool_ready_s", "empty serving_s", "empty pool_ready_s",
             "warm serving_s", "warm first_hit_s", "warm verified_s"]
    with figure(path, figsize=(8, 3.5)) as ax:
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([x + i * width for x in range(len(figures))], [row[name] for row in figures.values()],
                   width, label=name.replace("_s", ""))
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(figures))], list(figures))
        ax.set_ylabel("seconds from start")
        ax.set_title("Daemon start: empty pool vs adopted pool file (warm restart)", fontsize=9)
        ax.legend(fontsize=7)


def main() -> int:
    command = parser(__doc__)
    command.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 4, 16],
                         help="pool sizes in GiB (skipped, saying so, where they do not fit)")
    args = command.parse_args()
    if too_small := [size for size in args.sizes_gb if requests_filling(size) < 2]:
        # a warm start looks up the last request stored but one
        request_gib = CHUNK_BYTES * CHUNKS_PER_REQUEST / 2**30
        command.error(f"--sizes-gb {too_small}: a pool must hold two requests of {request_gib:g} GiB "
                      f"at {FILL_SHARE:.0%} full (at least {2 * request_gib / FILL_SHARE:.2f} GiB)")
    args.out.mkdir(parents=True, exist_ok=True)
    figures, checks = {}, {}
    for size in args.sizes_gb:
        if size + SPARE_GIB > available_gib():
            print(f"{size:g} GiB: skipped, {available_gib():.1f} GiB available")
            continue
        with scratch("lmc-warm-") as tmp:
            row = figures[f"{size:g} GiB"] = run(size, tmp)
        first_hit = row["warm first_hit_s"]
        checks[f"{size:g} GiB: first adopted hit {first_hit:.2f} s after start, "
               f"{first_hit - row['empty serving_s']:+.2f} s from an empty start's serving "
               f"(target <= {TARGET_FIRST_HIT_S} s)"] = first_hit <= TARGET_FIRST_HIT_S
    finish(args.out, "warm_restart", checks, figures, lambda path: plot(figures, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
