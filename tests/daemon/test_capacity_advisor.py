"""The capacity advisor against real daemons: a chat service's LOOKUP trace replayed as
vLLM drives a daemon (LOOKUP, STORE of what missed, END_SESSION). Against daemons whose pools hold
64, 128 and 256 chunks, the hit rates the 128-chunk daemon predicts for each size (STATUS,
/metrics) are the ones measured on the daemon of that size; on a trace of more distinct chunks
than the advisor tracks, its sampled prediction is its daemon's hit rate. Within 5 points."""

from __future__ import annotations

from pathlib import Path

import torch

from lmcache_mp.protocol import ChunkOutcome, RequestType, StatusReport
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import conversation_trace, status, store
from vllm_adapter import LMCacheMPWorkerAdapter

CHUNK_BYTES = LAYERS * (CHUNK // BLOCK) * 2 * BLOCK * 64 * 2  # a chunk of SHAPE caches: 16 KiB
REFERENCE = 128  # chunks: the daemon whose curve is checked against the others
SCALES = {0.5: REFERENCE // 2, 1.0: REFERENCE, 2.0: 2 * REFERENCE}


def start(daemons, short_tmp: Path, chunks: int, *args: str) -> DaemonProcess:
    """A daemon whose pool holds exactly `chunks` chunks (8 slabs of chunks / 8 slots)."""
    return daemons("--chunk-size", str(CHUNK), "--l1-size-gb", repr(chunks * CHUNK_BYTES / 2**30), *args,
                   url=f"ipc://{short_tmp}/daemon-{chunks}.sock")


def replay(url: str, trace: list[list[bytes]]) -> StatusReport:
    """Each LOOKUP of the trace, the STORE of what it missed and its END_SESSION; checks the hit
    rate counted here (chunks found over chunks asked) is STATUS's, and returns STATUS."""
    worker = LMCacheMPWorkerAdapter(url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        client, found = worker.mq_client, 0
        for n, chain in enumerate(trace):
            request_id = f"r{n}"
            hit = client.submit(RequestType.LOOKUP_CHUNKS, ["m", 1, request_id, chain]).result(10)
            if hit < len(chain):  # vLLM computes the rest and stores it, after what it found
                assert ChunkOutcome.NO_SPACE not in store(client, worker.instance_id, chain[hit:], request_id)
            client.submit(RequestType.END_SESSION, [request_id]).result(10)
            found += hit
    finally:
        worker.shutdown()
    report = status(url)
    assert (report.lookup_hits_total, report.lookup_chunks_total) == (found, sum(map(len, trace)))
    return report


def hit_rate(report: StatusReport) -> float:
    return report.lookup_hits_total / report.lookup_chunks_total


def predicted(report: StatusReport) -> dict[float, float]:
    return {point.pool_scale: point.hit_rate for point in report.capacity_curve}


def test_predicted_hit_rates_are_those_of_daemons_of_those_sizes(daemons, short_tmp: Path) -> None:
    # 600 LOOKUPs of 2-24 chunks (7,322), 1,212 distinct chunks: all of them tracked, but the
    # daemon samples about MAX_SAMPLED_PER_LOOKUP chunks of a LOOKUP (most of these short ones).
    trace = conversation_trace(60, 600, seed=1)
    measured: dict[int, float] = {}
    for chunks in SCALES.values():
        port = free_port()
        daemon = start(daemons, short_tmp, chunks, "--metrics-port", str(port))
        report = replay(daemon.url, trace)
        assert report.objects == chunks and report.pool_bytes == chunks * CHUNK_BYTES  # full, exactly
        assert 0.5 * report.lookup_chunks_total < report.capacity_sampled_chunks < report.lookup_chunks_total
        measured[chunks] = hit_rate(report)
        assert abs(predicted(report)[1.0] - measured[chunks]) <= 0.05, (chunks, report.capacity_curve)
        if chunks == REFERENCE:
            curve = predicted(report)
            gauges = scrape(port)
            for point in report.capacity_curve:
                series = f'lmcache_mp_capacity_predicted_hit_ratio{{pool_scale="{point.pool_scale:g}"}}'
                assert gauges[series] == point.hit_rate
            assert gauges["lmcache_mp_capacity_sampled_chunks_total"] == report.capacity_sampled_chunks
        assert daemon.stop() == 0
    print(f"predicted by the {REFERENCE}-chunk daemon / measured: " + ", ".join(
        f"{chunks} chunks {curve[scale]:.3f} / {measured[chunks]:.3f}" for scale, chunks in SCALES.items()))
    assert measured[SCALES[0.5]] + 0.1 < measured[SCALES[1.0]] < measured[SCALES[2.0]]
    for scale, chunks in SCALES.items():
        assert abs(curve[scale] - measured[chunks]) <= 0.05, (scale, curve, measured)


def test_a_sampled_prediction_is_the_hit_rate_of_its_daemon(daemons, short_tmp: Path) -> None:
    # 8,000 LOOKUPs of 4-16 chunks (81,496), 32,012 distinct chunks: a quarter of them sampled at
    # the end (all of them at first).
    trace = conversation_trace(4000, 8000, seed=2, turn_chunks=4, max_chunks=16)
    daemon = start(daemons, short_tmp, 2048)
    report = replay(daemon.url, trace)
    assert report.capacity_sampled_chunks < 0.7 * report.lookup_chunks_total
    print(f"sampled {report.capacity_sampled_chunks:,} of {report.lookup_chunks_total:,} chunk lookups: "
          f"predicted {predicted(report)[1.0]:.3f}, measured {hit_rate(report):.3f}")
    assert abs(predicted(report)[1.0] - hit_rate(report)) <= 0.05, report.capacity_curve
    assert daemon.stop() == 0
