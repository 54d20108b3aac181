"""What bench_floor.py's runs come to: each server's figures per concurrency (pooled over the
repetitions), their ratios to the floor's, the tokens each cache served, the correctness checks and
the targets, the table and the plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floor_steps import Step, summarize_steps
from harness import figure, percentile

SERVERS = ("small", "floor", "connector")
LABELS = {"small": "no connector, small cache", "floor": "floor: no connector, cache holds all",
          "connector": "connector, small cache"}
# Targets against the floor, same run: throughput at concurrency >= 2; TTFT and TPOT at every level.
MIN_THROUGHPUT, MAX_TTFT_MEAN, MAX_TTFT_P99, MAX_TPOT_MEAN = 0.97, 1.05, 1.10, 1.00
# A miss (a prefix's first request) with the connector against without, at concurrency 1: the two
# are different engine processes, which alone differed by up to 7% in TTFT (bench_miss_path.py).
MISS_PATH_SLACK = 0.03
COUNTERS = {"local": "vllm:prefix_cache_hits", "connector": "vllm:external_prefix_cache_hits",
            "prompt": "vllm:prompt_tokens", "preemptions": "vllm:num_preemptions"}


@dataclass
class Run:
    """One server's `vllm.benchmarks.serve.benchmark` of one data set at one concurrency."""

    server: str
    level: int  # max_concurrency
    rep: int
    slot: int  # its place among the three servers' runs of this data set (0: first)
    result: dict[str, Any]  # benchmark()'s, per request in the data set's order
    first: list[bool]  # per request: the first of its prefix in the data set (a miss everywhere)
    counters: dict[str, float]  # the server's /metrics counters over the run
    load: tuple[float, float]  # the machine's 1-minute load average before and after
    cpu_s: tuple[float, float]  # CPU seconds over the run: the server's processes, the daemon's
    steps: list[Step] | None = None  # vLLM's iteration log over the run (--steps)

    def ok(self, output_len: int) -> list[bool]:
        """Per request: answered with all `output_len` tokens."""
        lens = self.result["output_lens"]
        return [not err and n == output_len for err, n in zip(self.result["errors"], lens, strict=True)]


def tpots(result: dict[str, Any]) -> list[float]:
    """Seconds per output token after the first, per request (as vLLM's benchmark computes it)."""
    return [(lat - ttft) / (n - 1) for lat, ttft, n in zip(
        result["latencies"], result["ttfts"], result["output_lens"], strict=True) if n > 1]


def stats_ms(values: list[float], name: str) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {f"{name}_mean_ms": statistics.fmean(ms) if ms else float("nan"),
            f"{name}_p50_ms": percentile(ms, 50), f"{name}_p99_ms": percentile(ms, 99)}


def summarize(runs: list[Run]) -> dict[str, float]:
    """One server at one concurrency, its repetitions pooled: throughput is all requests (tokens)
    over the runs' summed durations (first request sent to last answer, vLLM's figure)."""
    duration = sum(r.result["duration"] for r in runs)
    results = [r.result for r in runs]
    ttfts = [t for res in results for t in res["ttfts"]]
    first = [t for r in runs for t, f in zip(r.result["ttfts"], r.first, strict=True) if f]
    later = [t for r in runs for t, f in zip(r.result["ttfts"], r.first, strict=True) if not f]
    tokens = {name: sum(r.counters.get(metric, 0.0) for r in runs) for name, metric in COUNTERS.items()}
    completed = sum(res["completed"] for res in results)
    return {"requests": completed, "failed": sum(res["failed"] for res in results), "duration_s": duration,
            "requests_per_s": completed / duration,
            "output_tokens_per_s": sum(res["total_output_tokens"] for res in results) / duration,
            "total_tokens_per_s": sum(res["total_input_tokens"] + res["total_output_tokens"]
                                      for res in results) / duration,
            "requests_per_s_runs": [res["request_throughput"] for res in results],
            **stats_ms(ttfts, "ttft"), **stats_ms([t for res in results for t in tpots(res)], "tpot"),
            **stats_ms([t for res in results for t in res["latencies"]], "e2el"),
            "first_ttft_mean_ms": statistics.fmean(first) * 1e3 if first else float("nan"),
            "later_ttft_mean_ms": statistics.fmean(later) * 1e3 if later else float("nan"),
            "tokens_local": tokens["local"], "tokens_connector": tokens["connector"],
            "tokens_prompt": tokens["prompt"], "preemptions": tokens["preemptions"],
            "cpu_ms_per_request": 1e3 * sum(sum(r.cpu_s) for r in runs) / completed,
            "daemon_cpu_ms_per_request": 1e3 * sum(r.cpu_s[1] for r in runs) / completed,
            "load_before": [r.load[0] for r in runs], "load_after": [r.load[1] for r in runs]}


RATIOS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_mean_ms", "ttft_p50_ms",
          "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "e2el_mean_ms", "first_ttft_mean_ms",
          "later_ttft_mean_ms", "cpu_ms_per_request")


def analyse(runs: list[Run], levels: list[int], short: int) -> dict[str, Any]:
    """Per concurrency: each server's summary, its ratios to the floor's, and how much of the
    floor's prefix-cache hits it recovered (its own cache's hits plus the connector's); with
    --steps, its engine steps (`short`: fewer prompt tokens in a step make it a short prefill's)."""
    out: dict[str, Any] = {}
    for level in levels:
        per = {s: summarize([r for r in runs if r.server == s and r.level == level]) for s in SERVERS}
        floor = per["floor"]
        out[str(level)] = {
            "servers": per,
            "ratios": {s: {k: per[s][k] / floor[k] if floor[k] else float("nan") for k in RATIOS}
                       for s in SERVERS},
            "recovered": {s: (per[s]["tokens_local"] + per[s]["tokens_connector"]) / floor["tokens_local"]
                          if floor["tokens_local"] else float("nan") for s in SERVERS}}
        if any(r.steps is not None for r in runs):
            at_level = [r for r in runs if r.level == level]
            out[str(level)]["steps"] = {s: pooled_steps([r for r in at_level if r.server == s], short)
                                        for s in SERVERS}
    return out


def pooled_steps(runs: list[Run], short: int) -> dict[str, float]:
    return summarize_steps([step for r in runs for step in r.steps or []],
                           sum(r.result["duration"] for r in runs), short)


def mismatches(runs: list[Run]) -> list[dict[str, Any]]:
    """Requests whose generated text differs from the no-connector small-cache server's on the same
    data set (greedy, temperature 0, ignore_eos: every server must give the same tokens)."""
    found = []
    ref = {(r.level, r.rep): r.result["generated_texts"] for r in runs if r.server == "small"}
    for run in runs:
        base = ref.get((run.level, run.rep))
        if run.server == "small" or base is None:
            continue
        for i, (text, expected) in enumerate(zip(run.result["generated_texts"], base, strict=True)):
            if text != expected:
                found.append({"level": run.level, "rep": run.rep, "request": i, "server": run.server,
                              "text": text, "expected": expected})
    return found


def verdicts(fig: dict[str, Any], runs: list[Run], output_len: int,
             settles: list[dict[str, int]]) -> tuple[dict[str, bool], dict[str, bool]]:
    """(every check, the correctness ones): the correctness checks fail the run; the targets
    (against the floor) are MET or MISS."""
    unanswered = sum(not ok for r in runs for ok in r.ok(output_len))
    wrong = mismatches(runs)
    leftover = [s for s in settles if s["leases"] or s["sessions"] or s["transfers_running"]]
    levels = sorted(int(level) for level in fig)
    served = sum(fig[str(level)]["servers"]["connector"]["tokens_connector"] for level in levels)
    correctness = {
        f"every request answered with its {output_len} tokens ({unanswered} not)": not unanswered,
        f"outputs identical across the three servers on every request ({len(wrong)} differ)": not wrong,
        f"the connector server served tokens from the connector ({served:,.0f})": served > 0,
        "nothing left in the daemon after each connector run (lease, session, transfer)": not leftover}
    targets: dict[str, bool] = {}
    for level in levels:
        ratio = fig[str(level)]["ratios"]["connector"]
        if level >= 2:
            targets[f"c={level}: throughput >= {MIN_THROUGHPUT:.0%} of the floor "
                    f"({ratio['requests_per_s']:.1%} req/s)"] = ratio["requests_per_s"] >= MIN_THROUGHPUT
        targets[f"c={level}: mean TTFT <= floor + {MAX_TTFT_MEAN - 1:.0%} ({ratio['ttft_mean_ms']:.3f}x)"] = \
            ratio["ttft_mean_ms"] <= MAX_TTFT_MEAN
        targets[f"c={level}: p99 TTFT <= floor + {MAX_TTFT_P99 - 1:.0%} ({ratio['ttft_p99_ms']:.3f}x)"] = \
            ratio["ttft_p99_ms"] <= MAX_TTFT_P99
        targets[f"c={level}: mean TPOT no worse than the floor ({ratio['tpot_mean_ms']:.3f}x)"] = \
            ratio["tpot_mean_ms"] <= MAX_TPOT_MEAN
    if 1 in levels:
        one = fig["1"]["servers"]
        miss = one["connector"]["first_ttft_mean_ms"] / one["small"]["first_ttft_mean_ms"]
        targets[f"c=1: a prefix's first request (a miss) no slower than without the connector "
                f"(+{MISS_PATH_SLACK:.0%} slack; {miss:.3f}x)"] = miss <= 1 + MISS_PATH_SLACK
    return {**correctness, **targets}, correctness


def print_table(fig: dict[str, Any]) -> None:
    print("\nper concurrency, repetitions pooled; ratios to the floor in brackets; miss TTFT: the mean of "
          "the prefixes' first requests, hit TTFT: of the others")
    print(f"{'c':>2} {'server':<10}{'req/s':>13}{'tok/s':>14}{'TTFT mean':>16}{'p50':>14}{'p99':>15}"
          f"{'TPOT mean':>16}{'p99':>14}{'miss TTFT':>11}{'hit TTFT':>14}{'local':>9}{'connector':>10}"
          f"{'CPU ms/req':>15}{'daemon':>7}")
    for level, row in fig.items():
        for server, s in row["servers"].items():
            r = row["ratios"][server]

            def cell(key: str, fmt: str, width: int, s: dict = s, r: dict = r) -> str:
                return f"{format(s[key], fmt)} ({r[key]:.2f})".rjust(width)

            print(f"{level:>2} {server:<10}{cell('requests_per_s', '.2f', 13)}"
                  f"{cell('total_tokens_per_s', '.0f', 14)}{cell('ttft_mean_ms', '.0f', 16)}"
                  f"{cell('ttft_p50_ms', '.0f', 14)}{cell('ttft_p99_ms', '.0f', 15)}"
                  f"{cell('tpot_mean_ms', '.1f', 16)}{cell('tpot_p99_ms', '.1f', 14)}"
                  f"{s['first_ttft_mean_ms']:>11.0f}{cell('later_ttft_mean_ms', '.0f', 14)}"
                  f"{s['tokens_local']:>9.0f}{s['tokens_connector']:>10.0f}"
                  f"{cell('cpu_ms_per_request', '.0f', 15)}{s['daemon_cpu_ms_per_request']:>7.0f}")
        print("   recovered of the floor's prefix hits: " + ", ".join(
            f"{server} {share:.1%}" for server, share in row["recovered"].items()) + "; preemptions: " +
              ", ".join(f"{server} {s['preemptions']:.0f}" for server, s in row["servers"].items()))


def draw(fig: dict[str, Any], path: Path) -> None:
    levels = [int(level) for level in fig]
    colors = {"small": "tab:gray", "floor": "tab:green", "connector": "tab:blue"}
    with figure(path, 2, 2, figsize=(11, 8), title="Serving at the floor: repeated prefixes, vLLM's "
                "cache small (with and without the connector) or holding all (the floor)") as axes:
        throughput, ttft, tpot, tokens = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
        for server in SERVERS:
            series = [fig[str(level)]["servers"][server] for level in levels]
            throughput.plot(levels, [s["requests_per_s"] for s in series], "o-", color=colors[server],
                            label=LABELS[server])
            ttft.plot(levels, [s["ttft_mean_ms"] for s in series], "o-", color=colors[server],
                      label=f"{server} mean")
            ttft.plot(levels, [s["ttft_p99_ms"] for s in series], "x--", color=colors[server],
                      label=f"{server} p99")
            tpot.plot(levels, [s["tpot_mean_ms"] for s in series], "o-", color=colors[server], label=server)
        throughput.set(title="throughput", xlabel="concurrency", ylabel="requests/s", xticks=levels)
        throughput.legend(fontsize=7)
        ttft.set(title="TTFT", xlabel="concurrency", ylabel="ms", xticks=levels, yscale="log")
        ttft.legend(fontsize=7, ncol=2)
        tpot.set(title="TPOT (mean)", xlabel="concurrency", ylabel="ms per output token", xticks=levels)
        tpot.legend(fontsize=7)
        draw_tokens(tokens, fig, levels)


def draw_tokens(ax: Any, fig: dict[str, Any], levels: list[int]) -> None:
    """Prompt tokens per server and concurrency: from vLLM's own cache, from the connector, computed."""
    width, x = 0.27, range(len(levels))
    for i, server in enumerate(SERVERS):
        series = [fig[str(level)]["servers"][server] for level in levels]
        local = [s["tokens_local"] for s in series]
        conn = [s["tokens_connector"] for s in series]
        computed = [s["tokens_prompt"] - a - b for s, a, b in zip(series, local, conn, strict=True)]
        pos = [j + (i - 1) * width for j in x]
        ax.bar(pos, local, width, color="tab:green", label="vLLM's cache" if not i else None)
        ax.bar(pos, conn, width, bottom=local, color="tab:blue", label="connector" if not i else None)
        ax.bar(pos, computed, width, bottom=[a + b for a, b in zip(local, conn, strict=True)],
               color="lightgray", label="computed" if not i else None)
        for p in pos:
            ax.text(p, 0, server[0], ha="center", va="bottom", fontsize=7)
    ax.set(title="prompt tokens by source (s small, f floor, c connector)", xlabel="concurrency",
           ylabel="tokens", xticks=list(x), xticklabels=[str(level) for level in levels])
    ax.legend(fontsize=7)
