#!/usr/bin/env python
"""Data-plane benchmark: STORE and RETRIEVE throughput through the real daemon.

    .venv/bin/python scripts/bench/bench_data_plane.py [--out bench-out] [--geometry 32x8 80x2 8x2]

KV in vLLM's CPU layout (CPU_ATTN, [blocks, kv_heads, block_size, 2*head_size] per layer,
all layers views of one allocation), head size 128, bf16, 256-token chunks, 8 chunks per
request, in two geometries by default:
- `32x8`: 32 layers, 8 KV heads, 128-token blocks (32 MiB per chunk, 2 blocks of 128 KiB pages);
- `80x2`: 80 layers, 2 KV heads (a 70B-class model at TP=4), vLLM's GPU
  default of 16-token blocks (20 MiB per chunk, 16 pages of 16 KiB per layer): many small pages,
  where one copy call per layer and chunk costs more than the bytes it moves;
and on request `8x2`: 8 layers, 2 KV heads, 128-token blocks, 8 KiB of KV a token as the serving
benchmarks' model (`bench_floor.py`): 2 MiB chunks, 16 MiB a request, the size of a returning
prefix's synchronous load there, where a request's fixed costs weigh most.
"End to end" is the adapter's request -> daemon copy -> reply. Every round checks that what it
timed is what users get: every chunk stored, every chunk found by LOOKUP, the RETRIEVE ok, and
the retrieved blocks bit-exact against the stored ones (checked outside the timing).
Baseline, same process, same pages, one thread: one bulk copy call per chunk for all layers at
once, the fastest torch gather and scatter that we know of: to gather, one `index_select` of the
chunk's blocks over all layers (dim 1 of the `[layers, blocks, ...]` allocation) into the
chunk-shaped buffer; to scatter, one `copy_` per run of consecutive blocks (the chunks are
retrieved into ascending blocks: one run per chunk).
RETRIEVE runs against two daemons: one with one copy thread (`--max-workers 1`) and one with two
(the default), which splits a RETRIEVE's chunks over both. Both keep their pool in a pool file
(the default, which a warm restart adopts); a third daemon, one copy thread, keeps it in anonymous
memory (`--pool-file ""`): target >= 95% of its speed in both directions. Every round measures all
paths one after the other, so that a busy machine slows them alike.
Target: >= 80% of the baseline in both directions, for every geometry. Prints a table,
writes data_plane.png and data_plane.json to --out.
`--profile`: the one-copy-thread daemon runs under `scripts/profile/daemon_profile.py`; each
geometry also prints (and the JSON holds) its time per request in each phase of STORE and
RETRIEVE (wall and CPU, microseconds). Its timers cost that daemon's rows ~0.1-0.2 ms a request.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import figure, finish, parse, parser, scratch

from lmcache_mp.protocol import RequestType
from lmcache_mp.testing.launcher import start_daemon
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

DTYPE = torch.bfloat16
PROFILER = Path(__file__).resolve().parents[1] / "profile" / "daemon_profile.py"
HEAD, CHUNK, CHUNKS_PER_REQUEST = 128, 256, 8


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    block: int
    num_blocks: int  # a request's blocks and half as many again: requests start at varying blocks

    @property
    def blocks_per_chunk(self) -> int:
        return CHUNK // self.block

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.kv_heads, self.block, 2 * HEAD)


GEOMETRIES = {"32x8": Geometry(32, 8, 128, 48), "80x2": Geometry(80, 2, 16, 192),
              "8x2": Geometry(8, 2, 128, 48)}
DEFAULT_GEOMETRIES = ["32x8", "80x2"]
DEFAULT = GEOMETRIES["32x8"]
# The default geometry's figures, by name (bench_tiers.py and bench_remote.py take the same worker).
LAYERS, KV_HEADS, BLOCK, NUM_BLOCKS = DEFAULT.layers, DEFAULT.kv_heads, DEFAULT.block, DEFAULT.num_blocks
BLOCKS_PER_CHUNK = DEFAULT.blocks_per_chunk


def make_kv(g: Geometry = DEFAULT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole allocation, and its layers by name (views of it, as vLLM's CPU caches are)."""
    buffer = torch.empty(g.layers, g.num_blocks, *g.page_shape, dtype=DTYPE)
    buffer.view(torch.int16).random_(-1000, 1000)
    return buffer, {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(g.layers)}


def request_bytes(g: Geometry = DEFAULT) -> int:
    return g.layers * CHUNKS_PER_REQUEST * g.blocks_per_chunk * math.prod(g.page_shape) * DTYPE.itemsize


def block_ids(iteration: int, g: Geometry = DEFAULT) -> list[int]:
    """Where a request's chunks are stored from: not ascending, like vLLM after block reuse. They
    are retrieved into the same blocks in ascending order (a fresh request's blocks)."""
    n = CHUNKS_PER_REQUEST * g.blocks_per_chunk
    start = (iteration * 7) % (g.num_blocks - n)
    return list(range(start, start + n))[::-1]


def hashes_for(iteration: int, g: Geometry) -> list[bytes]:
    n = CHUNKS_PER_REQUEST * g.blocks_per_chunk
    return [hashlib.sha256(f"{g}-{iteration}-{b}".encode()).digest() for b in range(n)]


class Baseline:
    """Single-threaded bulk torch gather and scatter of the same pages, one call per chunk."""

    def __init__(self, buffer: torch.Tensor, g: Geometry):
        self._buffer = buffer
        self._g = g
        self._chunks = [torch.empty(g.layers, g.blocks_per_chunk, *g.page_shape, dtype=DTYPE)
                        for _ in range(CHUNKS_PER_REQUEST)]

    def gather(self, ids: list[int]) -> float:
        per_chunk = torch.tensor(ids).view(CHUNKS_PER_REQUEST, self._g.blocks_per_chunk)
        start = time.perf_counter()
        for c, chunk in enumerate(self._chunks):
            torch.index_select(self._buffer, 1, per_chunk[c], out=chunk)
        return time.perf_counter() - start

    def scatter(self, ids: list[int]) -> float:
        """Into ascending `ids`: each chunk's blocks are one run, one copy_ for all layers."""
        bpc = self._g.blocks_per_chunk
        start = time.perf_counter()
        for c, chunk in enumerate(self._chunks):
            first = ids[c * bpc]
            self._buffer[:, first:first + bpc].copy_(chunk)
        return time.perf_counter() - start


class Client:
    """A worker and a scheduler adapter on one daemon, the worker's caches registered."""

    def __init__(self, url: str, kv: dict[str, torch.Tensor], g: Geometry):
        self._g = g
        self.worker = LMCacheMPWorkerAdapter(url, None, "bench", 1, 0, g.block)
        self.scheduler = LMCacheMPSchedulerAdapter(url, None, "bench", 1, 0, g.block)
        self.worker.register_kv_caches(kv, "CPU_ATTN")

    def store(self, it: int) -> float:
        ids = block_ids(it, self._g)
        keys = self._keys(it)
        start = time.perf_counter()
        payload = [keys, self.worker.instance_id, ids, b""]
        result = self.worker.mq_client.submit(RequestType.STORE, payload).result(60)
        elapsed = time.perf_counter() - start
        assert all(o == 0 for o in result.outcomes), result.outcomes
        return elapsed

    def retrieve(self, it: int) -> float:
        request_id = f"r{it}"
        self.scheduler.maybe_submit_lookup_request(request_id, block_hashes=hashes_for(it, self._g))
        while (hit := self.scheduler.check_lookup_result(request_id)) is None:
            time.sleep(0.0005)
        assert hit == CHUNKS_PER_REQUEST * CHUNK, hit
        payload = [self._keys(it), self.worker.instance_id, block_ids(it, self._g)[::-1], b""]
        start = time.perf_counter()
        reply = self.worker.mq_client.submit(RequestType.RETRIEVE, payload).result(60)
        elapsed = time.perf_counter() - start
        assert reply.ok, reply.reason
        self.scheduler.cleanup_lookup_result(request_id)
        return elapsed

    def _keys(self, it: int) -> list:
        op = LoadStoreOp(block_ids(it, self._g), block_hashes=hashes_for(it, self._g))
        return self.worker._keys.keys_for(f"r{it}", op)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


ROWS = ("baseline gather", "STORE, 1 thread", "STORE, anonymous pool", "baseline scatter",
        "RETRIEVE, 1 thread", "RETRIEVE, anonymous pool", "RETRIEVE, split")
COLORS = ["#999", "#1f77b4", "#aec7e8", "#999", "#ff7f0e", "#ffbb78", "#d62728"]


def measure(g: Geometry, urls: dict[str, str], iterations: int) -> dict[str, list[float]]:
    """Seconds per request, per path; every round runs each path once (the first round warms up)."""
    torch.set_num_threads(1)
    buffer, kv = make_kv(g)
    baseline = Baseline(buffer, g)
    clients = {name: Client(url, kv, g) for name, url in urls.items()}
    samples: dict[str, list[float]] = {name: [] for name in ROWS}
    try:
        for it in range(iterations + 1):
            ids = block_ids(it, g)
            times = {"baseline gather": baseline.gather(ids), "baseline scatter": baseline.scatter(ids[::-1])}
            stored = buffer[:, ids].view(torch.int16)  # the pages as the STOREs take them (bits: NaNs too)
            for name, client in clients.items():
                times[f"STORE, {name}"] = client.store(it)
            for name, client in clients.items():
                times[f"RETRIEVE, {name}"] = client.retrieve(it)
            # Each daemon's RETRIEVE wrote the stored pages into the same (ascending) blocks.
            retrieved = buffer[:, ids[::-1]].view(torch.int16)
            assert torch.equal(retrieved, stored), f"round {it}: retrieved pages differ from stored ones"
            if it:
                for name in ROWS:
                    samples[name].append(times[name])
        return samples
    finally:
        for client in clients.values():
            client.close()


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    with figure(path, 1, len(results), figsize=(6 * len(results), 3.5), squeeze=False) as axes:
        for ax, (name, rows) in zip(axes[0], results.items(), strict=True):
            names = list(rows)
            ax.bar(names, [rows[n] for n in names], color=COLORS)
            for i, n in enumerate(names):
                ax.annotate(f"{rows[n]:.1f}", (i, rows[n]), ha="center", va="bottom", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_ylabel("GB/s")
            g = GEOMETRIES[name]
            ax.set_title(f"KV copy throughput ({g.layers} layers x {g.kv_heads} heads x {HEAD}, bf16, "
                         f"{g.block}-token blocks, {CHUNK}-token chunks)", fontsize=8)


def run(g: Geometry, tmp: Path, iterations: int, profile: Path | None = None) -> dict[str, float]:
    """GB/s per path, end to end, through two daemons (one and two copy threads); with `profile`,
    the one-thread daemon runs under daemon_profile.py, which writes its phases there."""
    nbytes = request_bytes(g)
    print(f"\n{g.layers} layers x {g.num_blocks} blocks of {g.block} tokens, {g.kv_heads} KV heads; "
          f"{nbytes / 2**20:.0f} MiB per request", flush=True)
    daemons = {}
    try:
        # Copy threads: two split a RETRIEVE. The pool lives in a pool file (warm restart; where
        # the launcher puts them), but for the "anonymous pool" daemon's, in anonymous memory as
        # every pool was before pools lived in a file.
        for name, workers, pool_file in (("1 thread", 1, ()), ("split", 2, ()),
                                         ("anonymous pool", 1, ("--pool-file", ""))):
            home = tmp / f"{g.layers}x{g.kv_heads}-{name.replace(' ', '-')}"
            home.mkdir()
            prefix = ((sys.executable, str(PROFILER), str(profile), "--")
                      if profile is not None and name == "1 thread" else ())
            daemons[name] = start_daemon(home, "--l1-size-gb", "1.2", "--chunk-size", str(CHUNK),
                                         "--max-workers", str(workers), *pool_file, command_prefix=prefix)
        samples = measure(g, {name: d.url for name, d in daemons.items()}, iterations)
    finally:
        for daemon in daemons.values():
            daemon.stop()  # the profiled one writes its phases as it exits
    rows = {name: nbytes / statistics.median(samples[name]) / 1e9 for name in ROWS}
    print(f"{'path':<22}{'GB/s':>8}{'median ms':>12}")
    for name, rate in rows.items():
        print(f"{name:<22}{rate:>8.2f}{statistics.median(samples[name]) * 1e3:>12.1f}")
    print(f"split RETRIEVE / 1-thread RETRIEVE: {rows['RETRIEVE, split'] / rows['RETRIEVE, 1 thread']:.2f}x")
    return rows


def phases(path: Path, iterations: int) -> dict[str, dict[str, float]]:
    """The profiled daemon's phases that ran, per request (a STORE and a RETRIEVE each round, the
    first round included), in microseconds; printed."""
    rounds = iterations + 1
    measured = json.loads(path.read_text())
    table = {name: {"calls_per_round": v["calls"] / rounds, "wall_us": v["wall_ns"] / rounds / 1e3,
                    "cpu_us": v["cpu_ns"] / rounds / 1e3}
             for name, v in measured.items() if v["calls"] and not name.startswith("timer")}
    print("\nthe 1-thread daemon's phases, per round (a STORE, a LOOKUP, a RETRIEVE):"
          f"\n{'phase':<80}{'calls':>6}{'wall us':>9}{'CPU us':>8}")
    for name, row in table.items():
        print(f"{name:<80}{row['calls_per_round']:>6.0f}{row['wall_us']:>9.0f}{row['cpu_us']:>8.0f}")
    return table


def main() -> int:
    command = parser(__doc__)
    command.add_argument("--iterations", type=int, default=8, help="requests per direction")
    command.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), default=DEFAULT_GEOMETRIES,
                         help=f"KV geometries to measure (default: {' '.join(DEFAULT_GEOMETRIES)})")
    command.add_argument("--profile", action="store_true",
                         help="time the 1-thread daemon's STORE and RETRIEVE phases (daemon_profile.py)")
    args = parse(command)
    profiles = {}
    with scratch("lmc-bench-") as tmp:
        results = {}
        for name in args.geometry:
            path = tmp / f"profile-{name}.json" if args.profile else None
            results[name] = run(GEOMETRIES[name], tmp, args.iterations, path)
            if path is not None:
                profiles[name] = phases(path, args.iterations)
    checks, figures = {}, {}
    for name, rows in results.items():
        ratios = {"STORE / gather": rows["STORE, 1 thread"] / rows["baseline gather"],
                  "RETRIEVE, 1 thread / scatter": rows["RETRIEVE, 1 thread"] / rows["baseline scatter"],
                  "RETRIEVE, split / scatter": rows["RETRIEVE, split"] / rows["baseline scatter"]}
        checks |= {f"{name}: {what} = {ratio:.0%} (target >= 80%)": ratio >= 0.8
                   for what, ratio in ratios.items()}
        # A pool in a pool file (tmpfs pages) moves KV as fast as an anonymous one.
        pool_file = {what: rows[f"{what}, 1 thread"] / rows[f"{what}, anonymous pool"]
                     for what in ("STORE", "RETRIEVE")}
        checks |= {f"{name}: {what}, pool file / anonymous pool = {ratio:.0%} (target >= 95%)": ratio >= 0.95
                   for what, ratio in pool_file.items()}
        ratios |= {f"{what}, pool file / anonymous pool": ratio for what, ratio in pool_file.items()}
        figures[name] = {"gbps": rows, "ratios": ratios, "request_bytes": request_bytes(GEOMETRIES[name]),
                         "split_speedup": rows["RETRIEVE, split"] / rows["RETRIEVE, 1 thread"]}
        if name in profiles:
            figures[name]["phases_per_round"] = profiles[name]
    finish(args.out, "data_plane", checks, figures, lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
