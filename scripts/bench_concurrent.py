#!/usr/bin/env python
"""Concurrent serving benchmark: two vLLM API servers share one daemon, many sessions at once.

    .venv/bin/python scripts/bench_concurrent.py [--out bench-out] [--quick] [--sessions N] [--turns N]

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

Lock step: every turn is sent at the same moment to connector k and baseline k (same prompt), and
the session's next turn waits for both answers, so both sides see the same load. TTFT is the
client's: request sent to the first streamed chunk with a token. Throughput is a side's work over
its busy time (the union of the intervals in which it had a request outstanding): in lock step the
wall time is common to both sides, the busy time is not.

Checks (exit 1 if one fails): no HTTP error or timeout; the baseline's answer tokens equal the
connector's on every turn. Targets (MET/MISS): returning turns' TTFT p50 >= 3x lower with the
connector; throughput >= 1.5x; first turns (misses for both) no more than 3% worse in TTFT p50 and
throughput; cross-engine returning turns find cached tokens (usage `prompt_tokens_details`).
Prints a table, writes concurrent.json and concurrent.png and the servers' and daemon's logs to
--out. On 2 cores under light load the four servers start together in 40-100 s and the whole
default run takes 1.2-2.2 min, --quick (6 sessions x 2 turns, 512-token contexts; 4 sessions
would leave vLLM's cache above a quarter of the working set) ~1.1 min; minutes more under load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import BLOCK, CHUNK, ENGINE_ENV, REPO, available_gib, build_model, llm_args
from bench_openai import (
    ApiServer,
    Completion,
    busy_s,
    log_findings,
    log_sizes,
    percentile,
    start_server,
    stop_servers,
    stream_completion,
    wait_healthy,
)
from bench_report import finish
from bench_serving import (
    ANSWER_TOKENS,
    DTYPE,
    KV_BYTES_PER_TOKEN,
    MAX_CACHE_SHARE,
    MESSAGE_TOKENS,
    MODEL_FLAGS,
    TARGET_SPEEDUP,
    VOCAB_IDS,
)

SIDES = ("connector", "baseline")
PAIRS = 2  # server pairs (connector k, baseline k)
TARGET_THROUGHPUT, MISS_PATH_SLACK = 1.5, 0.03
SERVER_GIB = 2.5  # an API server, its EngineCore and worker with the bench model: ~2 GiB measured


@dataclass(frozen=True)
class Workload:
    contexts: list[list[int]]  # per session
    messages: list[list[list[int]]]  # per session, per turn
    arrivals: list[float]  # per session: seconds after the start
    thinks: list[list[float]]  # per session, per turn: seconds after the previous answers
    routes: list[list[int]]  # per session, per turn: the server pair
    warmup: list[int]  # one untimed request per server first, shared with no session

    @property
    def sessions(self) -> int:
        return len(self.contexts)

    def final_tokens(self, session: int) -> int:
        """The session's conversation after its last answer (answers have a fixed length)."""
        msgs = self.messages[session]
        return len(self.contexts[session]) + sum(map(len, msgs)) + len(msgs) * ANSWER_TOKENS


def make_workload(sessions: int, turns: int, context: int, mean_gap_s: float, think_s: float,
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB_IDS) for _ in range(n)]

    contexts = [tokens(rng.randint(context * 3 // 4, context * 5 // 4)) for _ in range(sessions)]
    messages = [[tokens(rng.randint(*MESSAGE_TOKENS)) for _ in range(turns)] for _ in range(sessions)]
    gaps = [rng.expovariate(1 / mean_gap_s) if mean_gap_s > 0 else 0.0 for _ in range(sessions)]
    arrivals = [sum(gaps[:i]) for i in range(sessions)]  # the first session starts at once
    thinks = [[rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(turns)]
              for _ in range(sessions)]
    routes = [[rng.randrange(PAIRS) for _ in range(turns)] for _ in range(sessions)]
    return Workload(contexts, messages, arrivals, thinks, routes, tokens(context))


def cache_plan(work: Workload, share: float) -> tuple[int, int, int]:
    """(working set, vLLM's cache, max model length) in tokens: the cache holds `share` of the
    working set, and at least the longest conversation (vLLM refuses a cache that cannot)."""
    working_set = sum(work.final_tokens(s) for s in range(work.sessions))
    longest = -(-max(work.final_tokens(s) for s in range(work.sessions)) // BLOCK) * BLOCK
    return working_set, max(longest, int(share * working_set) // BLOCK * BLOCK), longest


def connector_config(url: str, extras: list[str]) -> dict[str, Any]:
    """bench_common's kv_transfer_config (with `kv_load_failure_policy` recompute) plus --connector-extra."""
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


class LoadGenerator:
    """Sends the workload: a thread per session, and every turn to all sides' server k at once."""

    def __init__(self, work: Workload, servers: dict[str, list[ApiServer]], timeout_s: float):
        self.work, self.servers, self.timeout_s = work, servers, timeout_s
        self.turns: list[Turn] = []
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=2 * len(servers) * max(1, work.sessions))
        self.t0 = time.monotonic()

    def lock_step(self, pair: int, prompt: list[int], first: str) -> dict[str, Completion]:
        """One request to each side's server `pair`, submitted together (`first` side first)."""
        order = sorted(self.servers, key=lambda side: side != first)
        futures = {side: self._pool.submit(stream_completion, self.servers[side][pair].url, prompt,
                                           ANSWER_TOKENS, self.timeout_s) for side in order}
        return {side: f.result() for side, f in futures.items()}

    def warm_up(self) -> None:
        """One untimed request per server (first-use costs belong to no figure), pairs in lock step."""
        for pair in range(PAIRS):
            for side, done in self.lock_step(pair, self.work.warmup, SIDES[pair % 2]).items():
                if done.error:
                    raise RuntimeError(f"warm-up request to {side} {pair} failed: {done.error}")
                print(f"  warm-up {side} {pair}: TTFT {done.ttft_s * 1e3:.0f} ms, "
                      f"{(done.done_at - done.sent_at) * 1e3:.0f} ms in all", flush=True)

    def run(self) -> list[Turn]:
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self._session, args=(s,), daemon=True)
                   for s in range(self.work.sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join in slices: Ctrl-C reaches the main thread
                thread.join(1.0)
        self._pool.shutdown()
        return sorted(self.turns, key=lambda t: t.sent_s)

    def _session(self, session: int) -> None:
        work = self.work
        if self.stopping.wait(max(0.0, self.t0 + work.arrivals[session] - time.monotonic())):
            return  # interrupted before it arrived
        history, served = list(work.contexts[session]), set[int]()
        for turn, pair in enumerate(work.routes[session]):
            if self.stopping.wait(work.thinks[session][turn] if turn else 0.0):
                return
            prompt = history + work.messages[session][turn]
            sent = time.monotonic() - self.t0
            done = self.lock_step(pair, prompt, SIDES[(session + turn) % 2])  # who goes first alternates
            record = Turn(session, turn, pair, bool(turn) and pair not in served, sent, len(prompt), done)
            with self._lock:
                self.turns.append(record)
            print(f"  {sent:7.1f} s  {record.describe()}", flush=True)
            # The reference answer continues the history; a turn nobody answered ends the session.
            answer = next((c.token_ids for side in reversed(SIDES) if (c := done.get(side)) and not c.error),
                          None)
            if answer is None:
                return
            history, served = prompt + answer, served | {pair}


@dataclass
class Turn:
    """One turn of one session as every side answered it."""

    session: int
    turn: int
    pair: int
    cross: bool  # a returning turn on a server pair that never served its session before
    sent_s: float  # after the load's start
    prompt_tokens: int
    done: dict[str, Completion]  # per side

    def describe(self) -> str:
        kind = "first" if not self.turn else "cross" if self.cross else "same"
        sides = "; ".join(f"{side} " + (f"ERROR {c.error}" if c.error else
                                        f"TTFT {c.ttft_s * 1e3:.0f} ms cached {c.cached_tokens}")
                          for side, c in self.done.items())
        return (f"session {self.session} turn {self.turn} ({kind}, {self.prompt_tokens} tokens) "
                f"-> pair {self.pair}: {sides}")

    def as_json(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn, "pair": self.pair, "cross_engine": self.cross,
                "sent_s": self.sent_s, "prompt_tokens": self.prompt_tokens,
                **{side: {"ttft_s": c.ttft_s, "wall_s": c.done_at - c.sent_at, "error": c.error,
                          "cached_tokens": c.cached_tokens, "token_ids": c.token_ids}
                   for side, c in self.done.items()}}


def group_figures(turns: list[Turn], side: str) -> dict[str, float]:
    done = [t.done[side] for t in turns if not t.done[side].error]
    busy = busy_s([(c.sent_at, c.done_at) for c in done])
    cached = [c.cached_tokens for c in done if c.cached_tokens is not None]
    return {"n": len(done), "ttft_p50_ms": percentile([c.ttft_s * 1e3 for c in done], 50),
            "ttft_p99_ms": percentile([c.ttft_s * 1e3 for c in done], 99),
            # a request's whole time, prefill and 16 decode steps: what throughput is made of
            "wall_p50_ms": percentile([(c.done_at - c.sent_at) * 1e3 for c in done], 50),
            "cached_tokens_mean": sum(cached) / len(cached) if cached else float("nan"),
            "busy_s": busy, "requests_per_s": len(done) / busy if busy else float("nan"),
            "prompt_tokens_per_s": sum(c.prompt_tokens for c in done) / busy if busy else float("nan")}


def analyse(turns: list[Turn], expected: int) -> dict[str, Any]:
    sides = list(turns[0].done) if turns else []
    groups = {"first": [t for t in turns if not t.turn], "returning": [t for t in turns if t.turn],
              "all": turns}
    fig: dict[str, Any] = {
        "sides": {side: {g: group_figures(ts, side) for g, ts in groups.items()} for side in sides},
        "errors": sum(bool(c.error) for t in turns for c in t.done.values()),
        "answered": sum(all(not c.error for c in t.done.values()) for t in turns), "expected": expected}
    cross = [t for t in turns if t.cross and all(not c.error for c in t.done.values())]
    fig["cross_engine"] = {"n": len(cross), **{
        f"{side}_hit": sum((t.done[side].cached_tokens or 0) > 0 for t in cross) for side in sides}}
    if len(sides) < 2:
        return fig
    con, base = (fig["sides"][side] for side in SIDES)
    answered = [t for t in turns if all(not c.error for c in t.done.values())]
    fig["mismatches"] = [{"session": t.session, "turn": t.turn, "pair": t.pair, "cross_engine": t.cross,
                          **{side: t.done[side].token_ids for side in SIDES}}
                         for t in answered if t.done["connector"].token_ids != t.done["baseline"].token_ids]
    fig["ratios"] = {  # > 1: the connector is better
        "returning_ttft_p50": base["returning"]["ttft_p50_ms"] / con["returning"]["ttft_p50_ms"],
        "returning_ttft_p99": base["returning"]["ttft_p99_ms"] / con["returning"]["ttft_p99_ms"],
        "first_ttft_p50": base["first"]["ttft_p50_ms"] / con["first"]["ttft_p50_ms"],
        "first_ttft_p99": base["first"]["ttft_p99_ms"] / con["first"]["ttft_p99_ms"],
        "requests_per_s": con["all"]["requests_per_s"] / base["all"]["requests_per_s"],
        "prompt_tokens_per_s": con["all"]["prompt_tokens_per_s"] / base["all"]["prompt_tokens_per_s"],
        "first_requests_per_s": con["first"]["requests_per_s"] / base["first"]["requests_per_s"]}
    return fig


def print_table(fig: dict[str, Any], result: dict[str, Any], wall_s: float) -> None:
    print(f"\n{'side':<11}{'turns':<11}{'n':>4}{'TTFT p50':>10}{'p99 ms':>9}{'wall p50':>10}{'cached':>8}"
          f"{'busy s':>8}{'req/s':>7}{'prompt tok/s':>14}")
    for side, groups in fig["sides"].items():
        for group, g in groups.items():
            print(f"{side:<11}{group:<11}{g['n']:>4}{g['ttft_p50_ms']:>10.0f}{g['ttft_p99_ms']:>9.0f}"
                  f"{g['wall_p50_ms']:>10.0f}{g['cached_tokens_mean']:>8.0f}{g['busy_s']:>8.1f}{g['requests_per_s']:>7.2f}"
                  f"{g['prompt_tokens_per_s']:>14.0f}")
    if "ratios" in fig:
        print("baseline / connector, TTFT: " + ", ".join(
            f"{k.removesuffix('_ttft_p50').removesuffix('_ttft_p99')} {k[-3:]} {v:.2f}x"
            for k, v in fig["ratios"].items() if "ttft" in k))
        print(f"connector / baseline, throughput: {fig['ratios']['requests_per_s']:.2f}x requests/s, "
              f"{fig['ratios']['prompt_tokens_per_s']:.2f}x prompt tokens/s "
              f"(first turns {fig['ratios']['first_requests_per_s']:.2f}x)")
        for m in fig["mismatches"]:
            print(f"MISMATCH session {m['session']} turn {m['turn']} pair {m['pair']}: "
                  f"connector {m['connector']} baseline {m['baseline']}")
    cross = fig["cross_engine"]
    print(f"cross-engine returning turns: {cross['n']}; with cached tokens: "
          + ", ".join(f"{k.removesuffix('_hit')} {v}" for k, v in cross.items() if k != "n"))
    print(f"errors: {fig['errors']}; turns answered by every side: {fig['answered']} of {fig['expected']}")
    for name, c in result["counters"].items():
        print(f"{name}: {c['vllm:request_success']:.0f} requests, prefix hits "
              f"{c['vllm:prefix_cache_hits']:.0f} of {c['vllm:prefix_cache_queries']:.0f} tokens, "
              f"external hits {c['vllm:external_prefix_cache_hits']:.0f}, "
              f"preemptions {c['vllm:num_preemptions']:.0f}")
    d = result["daemon"]
    print(f"daemon: {d['objects']} objects, {d['pool_used_bytes'] / 2**20:.0f} MiB used, lookups found "
          f"{d['lookup_hits_total']} of {d['lookup_chunks_total']} chunks; wall time {wall_s:.0f} s")


def draw(turns: list[Turn], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sides = list(turns[0].done) if turns else []
    for side in sides:
        for returning, marker in ((False, "o"), (True, "^")):
            pts = [(t.sent_s, t.done[side].ttft_s * 1e3) for t in turns
                   if bool(t.turn) == returning and not t.done[side].error]
            ax1.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=14,
                        label=f"{side} {'returning' if returning else 'first'}")
    ax1.set(yscale="log", xlabel="sent at (s)", ylabel="TTFT (ms)")
    ax1.legend(fontsize=7)
    groups = {f"{side}\n{kind}": [t.done[side].ttft_s * 1e3 for t in turns
                                   if bool(t.turn) == (kind == "returning") and not t.done[side].error]
              for side in sides for kind in ("first", "returning")}
    ax2.boxplot(list(groups.values()), whis=(0, 100))
    ax2.set_xticks(range(1, len(groups) + 1), list(groups), fontsize=7)
    ax2.set(yscale="log", ylabel="TTFT (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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


def run(args: argparse.Namespace, work: Workload, cache_tokens: int, max_len: int,
        pool_gb: float) -> dict[str, Any]:
    """Start the daemon and the servers, warm up, send the workload; stop everything in any case."""
    from lmcache_mp.launcher import daemon_status, start_daemon

    with tempfile.TemporaryDirectory(prefix="lmc-concurrent-") as tmp:
        build_model(Path(tmp) / "model", DTYPE, MODEL_FLAGS)
        daemon = start_daemon(Path(tmp), "--chunk-size", str(CHUNK), "--l1-size-gb", str(pool_gb),
                              ready_timeout=300)
        servers: dict[str, list[ApiServer]] = {}
        gen: LoadGenerator | None = None
        try:
            model = str(Path(tmp) / "model")
            start_servers(servers, model, args, cache_tokens, max_len, daemon.url, args.out)
            rss = {s.name: s.rss_bytes() / 2**30 for pairs in servers.values() for s in pairs}
            print("resident memory: " + ", ".join(f"{n} {g:.2f} GiB" for n, g in rss.items()), flush=True)
            gen = LoadGenerator(work, servers, args.request_timeout_s)
            print("warm-up: one request per server...", flush=True)
            gen.warm_up()
            before = all_counters(servers)
            print(f"sending {work.sessions} sessions x {len(work.messages[0])} turns...", flush=True)
            logs = {"daemon.log": daemon.log_path, **{s.log.name: s.log for p in servers.values() for s in p}}
            start = log_sizes(logs)
            turns = gen.run()
            counters = metric_diff(before, all_counters(servers))
            status = daemon_status(daemon.url)
            end = log_sizes(logs)
            return {"turns": turns, "counters": counters, "rss_gib": rss,
                    "logs": log_findings(logs, start, end),
                    "daemon": {"objects": status.objects, "pool_used_bytes": status.pool_used_bytes,
                               "lookup_chunks_total": status.lookup_chunks_total,
                               "lookup_hits_total": status.lookup_hits_total}}
        finally:
            print("stopping the servers and the daemon...", flush=True)
            if gen:
                gen.stopping.set()  # interrupted: no session sends another turn
            stop_servers([s for pairs in servers.values() for s in pairs])
            daemon.stop(timeout=60)
            shutil.copy(daemon.log_path, args.out / "daemon.log")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="where the JSON, PNG and logs go")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 6 sessions x 2 turns, 512-token contexts, 0.5 s gaps (overrides those)")
    p.add_argument("--sessions", type=int, default=8, help="concurrent multi-turn sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--context-tokens", type=int, default=1000, help="private context per session (+-25%%)")
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
    p.add_argument("--seed", type=int, default=0, help="seed of the contexts, messages, arrivals and routes")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.context_tokens, args.mean_gap_s = 6, 2, 512, 0.5
    return args


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(REPO))  # the daemon's launcher
    # A SIGTERM (`timeout`, kill) unwinds like Ctrl-C, through the finally that stops every process.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    work = make_workload(args.sessions, args.turns, args.context_tokens, args.mean_gap_s, args.think_s,
                         args.seed)
    working_set, cache_tokens, max_len = cache_plan(work, args.cache_share)
    share = cache_tokens / working_set
    pool_gb = max(0.5, math.ceil(4 * working_set * KV_BYTES_PER_TOKEN / 2**30) / 2)  # 2x, in half GiB
    print(f"{args.sessions} sessions x {args.turns} turns; working set {working_set:,} tokens "
          f"({working_set * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB of KV); vLLM's cache {cache_tokens:,} tokens "
          f"per server: {share:.1%} of it; daemon pool {pool_gb} GiB", flush=True)
    if share >= MAX_CACHE_SHARE:
        print(f"FAIL: vLLM's cache must hold under {MAX_CACHE_SHARE:.0%} of the working set: more sessions, "
              "or a smaller --cache-share, please")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    memory_check(PAIRS * (1 if args.no_baseline else 2), pool_gb)
    started = time.monotonic()
    result = run(args, work, cache_tokens, max_len, pool_gb)
    wall_s = time.monotonic() - started
    figures = analyse(result["turns"], work.sessions * args.turns)
    print_table(figures, result, wall_s)
    checks, correctness = verdicts(figures)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    finish(args.out, "concurrent", checks,
           {"config": config, "working_set_tokens": working_set, "vllm_cache_tokens": cache_tokens,
            "cache_share": share, "max_model_len": max_len, "pool_gb": pool_gb, "wall_s": wall_s,
            "figures": figures, "checks": checks, "server_counters": result["counters"],
            "daemon": result["daemon"], "rss_gib": result["rss_gib"], "logs": result["logs"],
            "turns": [t.as_json() for t in result["turns"]]},
           lambda path: draw(result["turns"], path))
    return 0 if all(correctness.values()) else 1


def verdicts(fig: dict[str, Any]) -> tuple[dict[str, bool], dict[str, bool]]:
    """(every check and target, the correctness checks alone)."""
    correctness = {f"every turn answered, no HTTP error or timeout ({fig['errors']} errors, "
                   f"{fig['answered']} of {fig['expected']} turns)": fig["errors"] == 0
                   and fig["answered"] == fig["expected"]}
    if "ratios" not in fig:
        return correctness, correctness
    r, floor = fig["ratios"], 1 - MISS_PATH_SLACK  # one-sided: faster first turns are no cost
    correctness[f"baseline's answer tokens equal the connector's ({len(fig['mismatches'])} turns differ)"] = \
        not fig["mismatches"]
    cross = fig["cross_engine"]
    targets = {
        f"returning turns' TTFT p50 {r['returning_ttft_p50']:.2f}x lower with the connector "
        f"(>= {TARGET_SPEEDUP:.0f}x)": r["returning_ttft_p50"] >= TARGET_SPEEDUP,
        f"throughput {r['requests_per_s']:.2f}x the baseline's (>= {TARGET_THROUGHPUT}x)":
            r["requests_per_s"] >= TARGET_THROUGHPUT,
        f"first turns' TTFT p50 {r['first_ttft_p50']:.2f}x lower with the connector "
        f"(>= {floor:.2f}x: the miss path costs nothing)": r["first_ttft_p50"] >= floor,
        f"first turns' throughput {r['first_requests_per_s']:.2f}x the baseline's (>= {floor:.2f}x)":
            r["first_requests_per_s"] >= floor,
        f"cross-engine returning turns with cached tokens on the connector side: {cross['connector_hit']} of "
        f"{cross['n']}": cross["n"] > 0 and cross["connector_hit"] == cross["n"],
    }
    return {**correctness, **targets}, correctness


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # everything was stopped on the way out
        raise SystemExit("interrupted") from None
