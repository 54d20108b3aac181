#!/usr/bin/env python
"""Concurrent serving benchmark: two vLLM API servers share one daemon, many sessions at once.

    .venv/bin/python scripts/bench/bench_concurrent.py [--out bench-out] [--quick] [--sessions N] [--turns N]
        [--no-saturate | --saturate-sessions N --saturate-reps N]

What it runs: the random-weight fp32 Llama of bench_serving.py, one lmcache-mp daemon whose pool
holds the whole working set, and four OpenAI-compatible API servers on loopback (`python -m
vllm.entrypoints.openai.api_server`): connector 0 and 1 use the daemon, baseline 0 and 1 do not.
Every server runs the same engine settings: prefix caching, block 128, `--max-num-seqs`, and
vLLM's own cache cut (`--num-gpu-blocks-override`) to under a quarter of the working set (checked
before anything starts), `VLLM_CPU_NUM_OF_RESERVED_CPU=1`. By default (`--bind pairs`) server pair
k, API server, EngineCore and worker, runs on core k alone, so both sides of a pair meet the same
CPU: vLLM's processes spin (sched_yield, up to 1 s) while they wait on each other, and with the
kernel free to place them, two identical servers in lock step differed up to 5x in TTFT p50 (an
A/A run); confined per pair, they agreed within 8%.

Workload: SESSIONS sessions (default 8) arrive as a Poisson process (`--mean-gap-s`), each with a
private random-token context (`--context-tokens` +-25%, fixed seed) and TURNS turns (default 3). A
turn sends the whole history (context, earlier messages and answers) plus a new 50-100-token
message as a streamed, greedy `/v1/completions` of token ids (16 tokens, `ignore_eos`); its
answer's token ids (`return_token_ids`) join the history, and the next turn follows an exponential
think time (`--think-s`) later. Each turn goes to server pair 0 or 1 at random (fixed seed), so a
returning turn often lands on the engine that never saw its session: only the shared daemon can
then spare its prefill.

Phase 1, lock step (TTFT): every turn is sent at the same moment to connector k and baseline k
(same prompt), and the session's next turn waits for both answers, so both sides see the same load.
TTFT is the client's: request sent to the first streamed chunk with a token. The table also gives
each side's work over its busy time (the union of the intervals in which it had a request
outstanding), a secondary figure: in lock step the faster side waits for the slower one, and with
arrival gaps and think time the servers are mostly idle, so it cannot show capacity.

Phase 2, saturated throughput (on unless --no-saturate): each side alone at full load, closed loop.
All `--saturate-sessions` sessions (default 16, `--saturate-turns` turns, default --turns) start at
once and send their next turn as soon as the previous answer arrives (no gaps, no think time),
routed at random to the side's two servers as before, each continuing with its own answers. The
sides take turns on the machine, connector then baseline, `--saturate-reps` times (default 2),
while the other side's servers idle; a phase starts once the daemon has settled after the one
before. Repetition r's two phases share a fresh workload (seed SEED + 1 + r): the connector's first
turns miss in the daemon too, and the pool is sized for every phase's working set. Throughput is
completed requests (prompt tokens) over the phase's wall time, first request sent to last answer;
per side the median over repetitions.

Checks (exit 1 if one fails): no HTTP error or timeout in any phase; the baseline's answer tokens
equal the connector's on every turn, in the lock step and between the two phases of each saturated
repetition (same seed, greedy); nothing left in the daemon (lease, session, transfer) once a
phase's turns are answered. Targets (MET/MISS): returning turns' TTFT p50 >= 3x lower with the
connector (lock step); saturated throughput >= 1.5x, requests/s and prompt tokens/s (not evaluated
with --no-saturate); first turns (misses for both) no more than 3% worse in TTFT p50 and busy-time
throughput (lock step); cross-engine returning turns find cached tokens (usage
`prompt_tokens_details`). Prints the tables, writes concurrent.json and concurrent.png and the
servers' and daemon's logs to --out. On 2 cores the four servers start together in 40-100 s, the
lock step takes ~0.5 min and the four saturated phases 9-16 s each; the whole default run took
2 min (load average 5), --quick (6 sessions x 2 turns, 512-token contexts, 8 saturated sessions,
phases of ~4 s; 4 sessions would leave vLLM's cache above a quarter of the working set) 1.2 min;
minutes more under heavier load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_serving import (
    ANSWER_TOKENS,
    DTYPE,
    KV_BYTES_PER_TOKEN,
    MAX_CACHE_SHARE,
    MODEL_FLAGS,
)
from concurrent_load import (
    PAIRS,
    SIDES,
    LoadGenerator,
    Phase,
    Workload,
    closed_loop,
    make_workload,
    phase_wall_s,
)
from concurrent_report import (
    SETTLE_S,
    analyse,
    analyse_saturated,
    draw,
    print_saturated,
    print_table,
    verdicts,
)
from harness import available_gib, finish, parser
from harness.api_server import (
    ApiServer,
    log_findings,
    log_sizes,
    start_server,
    stop_servers,
    wait_healthy,
)
from harness.engines import BLOCK, CHUNK, ENGINE_ENV, build_model, llm_args

SERVER_GIB = 2.5  # an API server, its EngineCore and worker with the bench model: ~2 GiB measured


def cache_plan(work: Workload, share: float, others: list[Workload]) -> tuple[int, int, int]:
    """(working set, vLLM's cache, max model length) in tokens: the cache holds `share` of the
    lock-step working set, and at least the longest conversation of any phase (`others`: the
    saturated phases' workloads), which vLLM refuses a cache that cannot hold."""
    longest = max(w.longest() for w in [work, *others])
    max_len = -(-longest // BLOCK) * BLOCK
    return work.working_set(), max(max_len, int(share * work.working_set()) // BLOCK * BLOCK), max_len


def connector_config(url: str, extras: list[str]) -> dict[str, Any]:
    """harness.engines' kv_transfer_config (with `kv_load_failure_policy` recompute) plus
    --connector-extra."""
    config: dict[str, Any] = llm_args("", DTYPE, url)["kv_transfer_config"]
    for item in extras:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--connector-extra wants KEY=VALUE, got {item!r}")
        try:
            config["kv_connector_extra_config"][key] = json.loads(value)  # true, 2.0, ... typed
        except json.JSONDecodeError:
            config["kv_connector_extra_config"][key] = value
    return config


def start_servers(servers: dict[str, list[ApiServer]], model: str, args: argparse.Namespace,
                  cache_tokens: int, max_len: int, daemon_url: str, out: Path) -> None:
    """Start every server at once (their starts overlap) into `servers` (the caller's, so that it
    can stop those started when a later one fails), and wait for all to be healthy."""
    common = ["--dtype", DTYPE, "--max-model-len", str(max_len), "--enforce-eager", "--seed", "0",
              "--block-size", str(BLOCK), "--max-num-seqs", str(args.max_num_seqs),
              "--num-gpu-blocks-override", str(cache_tokens // BLOCK + 1),  # + the null block
              "--enable-prefix-caching", "--enable-prompt-tokens-details",
              # Both sides alike: 0.32 turns the hybrid manager off anyway for a non-HMA connector.
              "--disable-hybrid-kv-cache-manager"]
    for side in SIDES[:1] if args.no_baseline else SIDES:
        pairs = servers.setdefault(side, [])
        for k in range(PAIRS):
            env, cpus = dict(ENGINE_ENV), None
            if args.bind == "pairs":
                # Server pair k, with its EngineCore and worker, on core k alone: both sides of a pair meet
                # the same CPU. vLLM's processes spin for a while (sched_yield) waiting on each other; left
                # free, the kernel's placement of spinners favoured one server of a pair for seconds.
                cpus = {k % (os.cpu_count() or 1)}
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(min(cpus))
            elif args.bind == "nobind":  # the kernel places them; one thread as with the other modes
                env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
            extra = ["--kv-transfer-config", json.dumps(connector_config(daemon_url, args.connector_extra))] \
                if side == "connector" else []
            log = out / f"server-{side}-{k}.log"
            pairs.append(start_server(f"{side} {k}", model, [*common, *extra], env, log, cpus))
    print(f"starting {sum(map(len, servers.values()))} API servers (logs in {out})...", flush=True)
    wait_healthy([s for pairs in servers.values() for s in pairs], args.start_timeout_s)


def metric_diff(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}


def all_counters(servers: dict[str, list[ApiServer]]) -> dict[str, dict[str, float]]:
    return {s.name: s.counters() for pairs in servers.values() for s in pairs}


def memory_check(n_servers: int, pool_gb: float) -> None:
    need, have = n_servers * SERVER_GIB + pool_gb, available_gib()
    print(f"memory: ~{need:.1f} GiB needed ({n_servers} servers x ~{SERVER_GIB} GiB + {pool_gb} GiB pool), "
          f"{have:.1f} GiB available", flush=True)
    if have and need > have:
        raise SystemExit("FAIL: not enough memory for the servers and the daemon's pool")


def run(args: argparse.Namespace, work: Workload, saturate: list[tuple[int, Workload]], cache_tokens: int,
        max_len: int, pool_gb: float) -> dict[str, Any]:
    """Start the daemon and the servers, warm up, send the lock-step workload, then the saturated
    phases; stop everything in any case."""
    from lmcache_mp.testing.launcher import start_daemon

    stopping = threading.Event()  # set on the way out: no session sends another turn
    with tempfile.TemporaryDirectory(prefix="lmc-concurrent-") as tmp:
        build_model(Path(tmp) / "model", DTYPE, MODEL_FLAGS)
        daemon = start_daemon(Path(tmp), "--chunk-size", str(CHUNK), "--l1-size-gb", str(pool_gb),
                              ready_timeout=300)
        servers: dict[str, list[ApiServer]] = {}
        try:
            model = str(Path(tmp) / "model")
            start_servers(servers, model, args, cache_tokens, max_len, daemon.url, args.out)
            rss = {s.name: s.rss_bytes() / 2**30 for pairs in servers.values() for s in pairs}
            print("resident memory: " + ", ".join(f"{n} {g:.2f} GiB" for n, g in rss.items()), flush=True)
            gen = LoadGenerator(work, servers, args.request_timeout_s, stopping)
            print("warm-up: one request per server...", flush=True)
            gen.warm_up()
            logs = {"daemon.log": daemon.log_path, **{s.log.name: s.log for p in servers.values() for s in p}}
            start = log_sizes(logs)
            result = lock_step_phase(gen, servers, daemon.url)
            result["phases"] = saturated_phases(saturate, servers, args.request_timeout_s, daemon.url,
                                                stopping)
            return {**result, "rss_gib": rss, "logs": log_findings(logs, start, log_sizes(logs))}
        finally:
            print("stopping the servers and the daemon...", flush=True)
            stopping.set()
            stop_servers([s for pairs in servers.values() for s in pairs])
            daemon.stop(timeout=60)
            shutil.copy(daemon.log_path, args.out / "daemon.log")


def lock_step_phase(gen: LoadGenerator, servers: dict[str, list[ApiServer]],
                    daemon_url: str) -> dict[str, Any]:
    """The lock-step workload: its turns, the servers' counters over it, the daemon settled after it."""
    before = all_counters(servers)
    print(f"lock step: sending {gen.work.sessions} sessions x {gen.work.turns} turns...", flush=True)
    turns = gen.run()
    counters = metric_diff(before, all_counters(servers))
    return {"turns": turns, "counters": counters, "daemon": status_figures(settled(daemon_url))}


def saturated_phases(works: list[tuple[int, Workload]], servers: dict[str, list[ApiServer]], timeout_s: float,
                     daemon_url: str, stopping: threading.Event) -> list[Phase]:
    """Each (seed, workload) in closed loop on each side alone, connector first, while the other
    side's servers idle: both sides meet the same machine in turn. A phase starts once the daemon
    has settled after the one before (the connector's last stores done): no phase pays for another."""
    phases: list[Phase] = []
    for rep, (seed, work) in enumerate(works):
        for side, pairs in servers.items():
            print(f"saturated: {side} alone, repetition {rep} (seed {seed}), {work.sessions} sessions x "
                  f"{work.turns} turns at once...", flush=True)
            before = all_counters(servers)
            turns = closed_loop(work, side, pairs, timeout_s, stopping)
            daemon = status_figures(settled(daemon_url))
            diff = metric_diff(before, all_counters(servers))
            counters = {s.name: diff[s.name] for s in pairs}
            phase = Phase(side, rep, seed, turns, phase_wall_s(turns), counters, daemon)
            f = phase.figures()
            print(f"  {f['n']:.0f} answered, {f['errors']:.0f} errors in {f['wall_s']:.1f} s: "
                  f"{f['requests_per_s']:.2f} requests/s, {f['prompt_tokens_per_s']:.0f} prompt tokens/s, "
                  f"TTFT p50 {f['ttft_p50_ms']:.0f} ms", flush=True)
            phases.append(phase)
    return phases


def status_figures(status: Any) -> dict[str, int]:
    """What the report keeps of the daemon's STATUS."""
    return {name: int(getattr(status, name)) for name in (
        "objects", "pool_used_bytes", "lookup_chunks_total", "lookup_hits_total", "leases", "sessions",
        "transfers_running")}


def settled(url: str, deadline_s: float = SETTLE_S) -> Any:
    """The daemon's STATUS once every answered request has let go of it: no lease, session or
    transfer left (the engines release them as requests finish, a moment after the answer), or as
    it is at the deadline: then something leaked, which the verdicts report."""
    from lmcache_mp.testing.launcher import daemon_status

    end = time.monotonic() + deadline_s
    while True:
        status = daemon_status(url)
        if not (status.leases or status.sessions or status.transfers_running) or time.monotonic() > end:
            return status
        time.sleep(0.2)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, "smoke run: 6 sessions x 2 turns, 512-token contexts, 0.5 s gaps (overrides those)",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=8, help="concurrent multi-turn sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--context-tokens", type=int, default=1000, help="private context per session (+-25%%)")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help="every answer's length (greedy, ignore_eos): longer answers grow the running "
                   "requests while they decode, which is what makes vLLM preempt")
    p.add_argument("--mean-gap-s", type=float, default=1.0, help="mean gap between arrivals (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0, help="mean think time before a session's next turn")
    p.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's --max-num-seqs on every server")
    p.add_argument("--cache-share", type=float, default=0.2,
                   help=f"vLLM's own cache as a share of the working set (< {MAX_CACHE_SHARE})")
    p.add_argument("--connector-extra", action="append", default=[], metavar="KEY=VALUE",
                   help="into kv_connector_extra_config, e.g. lmcache.mp.save_decode_cache=true; repeatable")
    p.add_argument("--no-baseline", action="store_true", help="only the two connector servers: no comparison")
    p.add_argument("--bind", choices=("pairs", "auto", "nobind"), default="pairs",
                   help="pairs: server pair k's workers on core k; auto: vLLM's binding (all on one core); "
                   "nobind: none, one OpenMP thread each")
    p.add_argument("--start-timeout-s", type=float, default=1800, help="deadline for all servers' /health")
    p.add_argument("--request-timeout-s", type=float, default=900, help="one request's deadline")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the lock-step contexts, messages, arrivals and routes; saturated "
                   "repetition r uses SEED + 1 + r")
    p.set_defaults(saturate=True)  # SUPPRESS below: "(default: True)" would read as skipping them
    p.add_argument("--no-saturate", dest="saturate", action="store_false", default=argparse.SUPPRESS,
                   help="skip the saturated throughput phases, run by default (without them the throughput "
                   "target is not evaluated)")
    p.add_argument("--saturate-sessions", type=int, default=16,
                   help="sessions per saturated phase, all started at once (closed loop, no think time)")
    p.add_argument("--saturate-turns", type=int, default=0, help="turns per saturated session; 0: --turns")
    p.add_argument("--saturate-reps", type=int, default=2,
                   help="repetitions of the saturated pair of phases (connector alone, then baseline alone)")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.context_tokens, args.mean_gap_s = 6, 2, 512, 0.5
        args.saturate_sessions = 8
    args.saturate_turns = args.saturate_turns or args.turns
    return args


def saturate_workloads(args: argparse.Namespace) -> list[tuple[int, Workload]]:
    """(seed, workload) per repetition, both sides' phases of a repetition sharing it: fresh contexts
    each time (a seed of its own), so the connector's first turns miss in the daemon too."""
    seeds = [args.seed + 1 + rep for rep in range(args.saturate_reps)] if args.saturate else []
    return [(seed, make_workload(args.saturate_sessions, args.saturate_turns, args.context_tokens,
                                 mean_gap_s=0.0, think_s=0.0, seed=seed, answer_tokens=args.answer_tokens))
            for seed in seeds]


def pool_plan(work: Workload, saturate: list[tuple[int, Workload]]) -> tuple[int, float]:
    """(tokens the daemon is sent, its pool in GiB): every phase's contexts are fresh, so the pool
    holds the lock step's working set and every saturated connector phase's; twice that, in half GiB."""
    tokens = work.working_set() + sum(w.working_set() for _, w in saturate)
    return tokens, max(0.5, math.ceil(4 * tokens * KV_BYTES_PER_TOKEN / 2**30) / 2)


def main() -> int:
    args = parse_args()
    # A SIGTERM (`timeout`, kill) unwinds like Ctrl-C, through the finally that stops every process.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    work = make_workload(args.sessions, args.turns, args.context_tokens, args.mean_gap_s, args.think_s,
                         args.seed, args.answer_tokens)
    saturate = saturate_workloads(args)
    working_set, cache_tokens, max_len = cache_plan(work, args.cache_share, [w for _, w in saturate])
    share = cache_tokens / working_set
    daemon_tokens, pool_gb = pool_plan(work, saturate)
    print(f"lock step: {args.sessions} sessions x {args.turns} turns; working set {working_set:,} tokens "
          f"({working_set * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB of KV); vLLM's cache {cache_tokens:,} tokens "
          f"per server: {share:.1%} of it", flush=True)
    print(f"saturated: {len(saturate)} x (connector, baseline) phases of {args.saturate_sessions} sessions x "
          f"{args.saturate_turns} turns; daemon pool {pool_gb} GiB for {daemon_tokens:,} tokens "
          f"({daemon_tokens * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB) in all", flush=True)
    if share >= MAX_CACHE_SHARE:
        print(f"FAIL: vLLM's cache must hold under {MAX_CACHE_SHARE:.0%} of the working set: more sessions, "
              "or a smaller --cache-share, please")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    memory_check(PAIRS * (1 if args.no_baseline else 2), pool_gb)
    started = time.monotonic()
    result = run(args, work, saturate, cache_tokens, max_len, pool_gb)
    wall_s = time.monotonic() - started
    figures = analyse(result["turns"], work.sessions * args.turns)
    print_table(figures, result)
    phases: list[Phase] = result["phases"]
    sat = analyse_saturated(phases, args.saturate_sessions * args.saturate_turns) if phases else {}
    if phases:
        print_saturated(phases, sat, saturate[0][1])
    else:
        print("\nsaturated phases skipped (--no-saturate): the throughput target is not evaluated")
    print(f"wall time {wall_s:.0f} s")
    settles = {"lock step": result["daemon"], **{f"saturated {p.side} rep {p.rep}": p.daemon for p in phases}}
    checks, correctness = verdicts(figures, sat, settles)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    finish(args.out, "concurrent", checks,
           {"config": config, "working_set_tokens": working_set, "vllm_cache_tokens": cache_tokens,
            "cache_share": share, "max_model_len": max_len, "pool_gb": pool_gb, "wall_s": wall_s,
            "figures": figures, "saturated": sat, "checks": checks, "server_counters": result["counters"],
            "daemon": result["daemon"], "rss_gib": result["rss_gib"], "logs": result["logs"],
            "turns": [t.as_json() for t in result["turns"]], "phases": [p.as_json() for p in phases]},
           lambda path: draw(result["turns"], phases, path))
    return 0 if all(correctness.values()) else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # everything was stopped on the way out
        raise SystemExit("interrupted") from None
