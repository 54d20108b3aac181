"""What bench_concurrent.py's runs come to: the lock step's and the saturated phases' figures and
tables, the plot, and the verdicts (the correctness checks and the targets)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench_serving import TARGET_SPEEDUP
from concurrent_load import SIDES, Phase, Turn, Workload, mismatches
from harness import figure, percentile
from harness.api_server import busy_s

TARGET_THROUGHPUT, MISS_PATH_SLACK = 1.5, 0.03
# How long the daemon may take to let go of every lease, session and transfer once the last turn is
# answered: the engines release them as their requests finish, a moment after the answer.
SETTLE_S = 60.0
THROUGHPUT = ("requests_per_s", "prompt_tokens_per_s")  # the saturated phases' figures, per side


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


def print_table(fig: dict[str, Any], result: dict[str, Any]) -> None:
    print("\nlock step: both sides sent every turn at once (req/s and prompt tok/s over each side's busy "
          "time: secondary, the saturated phase measures capacity)")
    print(f"{'side':<11}{'turns':<11}{'n':>4}{'TTFT p50':>10}{'p99 ms':>9}{'wall p50':>10}{'cached':>8}"
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
        print(f"connector / baseline, lock-step busy-time throughput (secondary): "
              f"{fig['ratios']['requests_per_s']:.2f}x requests/s, "
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
    print(f"daemon after the lock step: {d['objects']} objects, {d['pool_used_bytes'] / 2**20:.0f} MiB used, "
          f"lookups found {d['lookup_hits_total']} of {d['lookup_chunks_total']} chunks")


def analyse_saturated(phases: list[Phase], expected_per_phase: int) -> dict[str, Any]:
    """Per side the median over repetitions of requests/s and prompt tokens/s (over phase wall
    time), their ratio, and the paired phases' (same seed, one per side) answer mismatches."""
    sides = list(dict.fromkeys(p.side for p in phases))
    figs = {side: [p.figures() for p in phases if p.side == side] for side in sides}
    sat: dict[str, Any] = {
        "median": {side: {k: statistics.median(f[k] for f in fs) for k in THROUGHPUT}
                   for side, fs in figs.items()},
        "errors": sum(int(f["errors"]) for fs in figs.values() for f in fs),
        "answered": sum(int(f["n"]) for fs in figs.values() for f in fs),
        "expected": expected_per_phase * len(phases)}
    if len(sides) < 2:
        return sat
    sat["mismatches"] = [{"rep": c.rep, "seed": c.seed, **m}
                         for c in phases if c.side == "connector"
                         for b in phases if b.side == "baseline" and b.seed == c.seed
                         for m in mismatches(c.turns, b.turns)]
    con, base = (sat["median"][side] for side in SIDES)
    sat["ratios"] = {k: con[k] / base[k] for k in con}  # > 1: the connector is better
    return sat


def print_saturated(phases: list[Phase], sat: dict[str, Any], work: Workload) -> None:
    print(f"\nsaturated, closed loop, each side alone in turn ({work.sessions} sessions x {work.turns} turns "
          "per phase, all at once, no think time; req/s and prompt tok/s over the phase's wall time)")
    print(f"{'side':<11}{'rep':>3}{'seed':>5}{'n':>5}{'wall s':>8}{'req/s':>7}{'prompt tok/s':>14}"
          f"{'TTFT p50':>10}{'req p50':>9}{'ext hits':>10}{'preempt':>9}")
    for p in phases:
        f = p.figures()
        print(f"{p.side:<11}{p.rep:>3}{p.seed:>5}{f['n']:>5.0f}{f['wall_s']:>8.1f}{f['requests_per_s']:>7.2f}"
              f"{f['prompt_tokens_per_s']:>14.0f}{f['ttft_p50_ms']:>10.0f}{f['request_p50_ms']:>9.0f}"
              f"{f['external_hits']:>10.0f}{f['preemptions']:>9.0f}")
    for side, m in sat["median"].items():
        print(f"{side} median: {m['requests_per_s']:.2f} requests/s, "
              f"{m['prompt_tokens_per_s']:.0f} prompt tokens/s")
    if "ratios" in sat:
        print(f"connector / baseline, saturated throughput (medians): {sat['ratios']['requests_per_s']:.2f}x "
              f"requests/s, {sat['ratios']['prompt_tokens_per_s']:.2f}x prompt tokens/s")
        for m in sat["mismatches"]:
            print(f"MISMATCH saturated rep {m['rep']} session {m['session']} turn {m['turn']}: "
                  f"connector {m['connector']} baseline {m['baseline']}")
    print(f"saturated: errors {sat['errors']}; turns answered {sat['answered']} of {sat['expected']}")


def draw(turns: list[Turn], phases: list[Phase], path: Path) -> None:
    with figure(path, 1, 3, figsize=(15, 4)) as (ax1, ax2, ax3):
        sides = list(turns[0].done) if turns else []
        for side in sides:
            for returning, marker in ((False, "o"), (True, "^")):
                pts = [(t.sent_s, t.done[side].ttft_s * 1e3) for t in turns
                       if bool(t.turn) == returning and not t.done[side].error]
                ax1.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=14,
                            label=f"{side} {'returning' if returning else 'first'}")
        ax1.set(yscale="log", xlabel="sent at (s)", ylabel="TTFT (ms)", title="lock step")
        ax1.legend(fontsize=7)
        groups = {f"{side}\n{kind}": [t.done[side].ttft_s * 1e3 for t in turns
                                       if bool(t.turn) == (kind == "returning") and not t.done[side].error]
                  for side in sides for kind in ("first", "returning")}
        ax2.boxplot(list(groups.values()), whis=(0, 100))
        ax2.set_xticks(range(1, len(groups) + 1), list(groups), fontsize=7)
        ax2.set(yscale="log", ylabel="TTFT (ms)", title="lock step")
        ax3.bar(range(len(phases)), [p.figures()["requests_per_s"] for p in phases],
                color=["tab:blue" if p.side == "connector" else "tab:orange" for p in phases])
        ax3.set_xticks(range(len(phases)), [f"{p.side}\nrep {p.rep}" for p in phases], fontsize=7)
        ax3.set(ylabel="requests/s", title="saturated, closed loop")


def verdicts(fig: dict[str, Any], sat: dict[str, Any],
             settles: dict[str, dict[str, int]]) -> tuple[dict[str, bool], dict[str, bool]]:
    """(every check and target, the correctness checks alone). `fig`: the lock step's figures, `sat`:
    the saturated phases' (empty if none ran), `settles`: the daemon's settled STATUS after each phase."""
    correctness = {f"lock step: every turn answered, no HTTP error or timeout ({fig['errors']} errors, "
                   f"{fig['answered']} of {fig['expected']} turns)": fig["errors"] == 0
                   and fig["answered"] == fig["expected"], **daemon_check(settles)}
    if sat:
        correctness[f"saturated: every turn answered, no HTTP error or timeout ({sat['errors']} errors, "
                    f"{sat['answered']} of {sat['expected']} turns)"] = \
            sat["errors"] == 0 and sat["answered"] == sat["expected"]
    if "ratios" in sat:
        correctness[f"saturated: answer tokens equal between the paired connector and baseline phases "
                    f"({len(sat['mismatches'])} turns differ)"] = not sat["mismatches"]
    if "ratios" not in fig:
        return correctness, correctness
    correctness[f"lock step: baseline's answer tokens equal the connector's ({len(fig['mismatches'])} turns "
                "differ)"] = not fig["mismatches"]
    return {**correctness, **targets(fig, sat)}, correctness


def daemon_check(settles: dict[str, dict[str, int]]) -> dict[str, bool]:
    """No lease, session or transfer left in the daemon once a phase's turns were all answered."""
    left = {where: (d["leases"], d["sessions"], d["transfers_running"]) for where, d in settles.items()
            if d["leases"] or d["sessions"] or d["transfers_running"]}
    found = "; ".join(f"{where}: {a} leases, {b} sessions, {c} transfers"
                      for where, (a, b, c) in left.items())
    return {f"nothing left in the daemon once each phase's turns were answered (after up to "
            f"{SETTLE_S:.0f} s; {len(settles)} phase(s): {found or 'none left anything'})": not left}


def targets(fig: dict[str, Any], sat: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets: TTFT and first-turn checks from the lock step, throughput from the
    saturated phases (not evaluated without them: the lock step's busy time cannot show capacity)."""
    r, floor = fig["ratios"], 1 - MISS_PATH_SLACK  # one-sided: faster first turns are no cost
    cross = fig["cross_engine"]
    found = {
        f"returning turns' TTFT p50 {r['returning_ttft_p50']:.2f}x lower with the connector "
        f"(>= {TARGET_SPEEDUP:.0f}x; lock step)": r["returning_ttft_p50"] >= TARGET_SPEEDUP}
    if "ratios" in sat:
        s = sat["ratios"]
        found[f"saturated throughput {s['requests_per_s']:.2f}x requests/s, {s['prompt_tokens_per_s']:.2f}x "
              f"prompt tokens/s the baseline's (>= {TARGET_THROUGHPUT}x; medians over repetitions)"] = \
            min(s.values()) >= TARGET_THROUGHPUT
    found.update({
        f"first turns' TTFT p50 {r['first_ttft_p50']:.2f}x lower with the connector "
        f"(>= {floor:.2f}x: the miss path costs nothing; lock step)": r["first_ttft_p50"] >= floor,
        f"first turns' throughput {r['first_requests_per_s']:.2f}x the baseline's (>= {floor:.2f}x; "
        "lock step, busy time)": r["first_requests_per_s"] >= floor,
        f"cross-engine returning turns with cached tokens on the connector side: {cross['connector_hit']} of "
        f"{cross['n']} (lock step)": cross["n"] > 0 and cross["connector_hit"] == cross["n"]})
    return found
