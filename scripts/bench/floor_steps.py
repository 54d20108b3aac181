"""bench_floor.py --steps: vLLM's per-iteration log (`--enable-logging-iteration-details`: per
engine step, the prefill ("context") and decode ("generation") requests and tokens it computed,
the time the EngineCore waited for the worker's forward pass, connector hooks included, and the KV
cache's use) summed up over runs, so that a server's time splits into how many steps it took,
how long they ran by kind, and the time outside them (scheduling, the connector's scheduler side,
output handling, steps with nothing to compute, which vLLM does not log)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

Step = tuple[int, int, int, int, float, float]  # prefill requests, tokens; decode requests, tokens; ms; KV %

# vLLM 0.32's LoggingStatLogger line, one per step that computed something
_ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
                        r"requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms.*?"
                        r"KV cache usage: ([\d.]+)%")


def read_steps(log: Path, start: int, end: int) -> list[Step]:
    """The iteration lines a server logged between byte offsets `start` and `end` of its log."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode(errors="replace")
    return [(int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6]))
            for m in _ITERATION.finditer(text)]


def summarize_steps(steps: list[Step], duration_s: float, short: int) -> dict[str, float]:
    """Steps by kind: with a short prefill (under `short` prompt tokens in all: here, returning
    prefixes' suffixes, whose KV came from a cache), with a long one (a miss), decode only; their
    time, and what is left of the run."""
    kinds = {"short": [s for s in steps if 0 < s[1] < short], "long": [s for s in steps if s[1] >= short],
             "decode": [s for s in steps if not s[1]]}
    busy_s = sum(s[4] for s in steps) / 1e3
    figures = {"steps": len(steps), "busy_s": busy_s, "outside_s": duration_s - busy_s,
               "decode_batch": statistics.fmean(s[2] for s in kinds["decode"]) if kinds["decode"] else 0.0,
               "kv_usage_max": max((s[5] for s in steps), default=float("nan"))}
    for kind, chosen in kinds.items():
        ms = [s[4] for s in chosen]
        figures[f"{kind}_steps"] = len(chosen)
        figures[f"{kind}_step_ms"] = statistics.fmean(ms) if ms else float("nan")
        figures[f"{kind}_step_p50_ms"] = statistics.median(ms) if ms else float("nan")
    return figures


def print_steps(per_level: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\nengine steps (vLLM's iteration log), repetitions pooled: steps with a short prefill (hits), a "
          "long one (misses), decode only: how many, their mean and p50 ms; the time outside them")
    print(f"{'c':>2} {'server':<10}{'steps':>7}{'short':>15}{'long':>17}{'decode':>17}{'batch':>7}"
          f"{'busy s':>8}{'outside s':>10}{'KV max %':>9}")
    for level, servers in per_level.items():
        for server, s in servers.items():
            kinds = "".join(f"{s[f'{k}_steps']:>6.0f} {s[f'{k}_step_ms']:>5.1f}/{s[f'{k}_step_p50_ms']:<5.1f}"
                            .rjust(w) for k, w in (("short", 15), ("long", 17), ("decode", 17)))
            print(f"{level:>2} {server:<10}{s['steps']:>7.0f}{kinds}{s['decode_batch']:>7.2f}"
                  f"{s['busy_s']:>8.1f}{s['outside_s']:>10.1f}{s['kv_usage_max']:>9.1f}")
