#!/usr/bin/env python
"""Sum up the connector's step trace (`lmcache.mp.step_trace`, `vllm_adapter/step_trace.py`).

    .venv/bin/python scripts/bench/step_trace_report.py PREFIX [--start S --end S] [--json]

Reads every `PREFIX.*.jsonl` (the scheduler's and each worker's). Worker steps are sorted by kind:
`sync load` (the forward pass waited for a load), `async load` (loads sent to run beside it),
`store` (stores only), `idle` (nothing computed: vLLM steps to collect transfers), `plain` (none of
these). Per kind: how many steps, the worker's span from `begin_step` to the end of
`transfer_results` (the forward pass included), and each hook's mean ms: `begin_step` sends the
step's loads, `start_load_kv` waits for the sync ones, `wait_for_save` sends the stores,
`transfer_results` collects what finished. Per scheduler step: the lookups' time
(`get_num_new_matched_tokens`, and how many were still in flight), `build_connector_meta`,
`update_connector_output`. `--start`/`--end` (`time.monotonic()` seconds) keep one run's records.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections import defaultdict
from typing import Any

Record = dict[str, Any]
WORKER_HOOKS = ("begin_step", "start_load_kv", "wait_for_save", "transfer_results")
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "build_connector_meta", "update_connector_output")
KINDS = ("sync load", "async load", "store", "idle", "plain")


def read(prefix: str, start: float = float("-inf"), end: float = float("inf")) -> dict[str, list[Record]]:
    """Records by role ("scheduler", "worker"), those that started within [start, end]."""
    by_role: dict[str, list[Record]] = defaultdict(list)
    for path in sorted(glob.glob(f"{glob.escape(prefix)}.*.jsonl")):
        role = path[len(prefix) + 1:].split(".")[0]
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a process killed mid-line
                record = json.loads(line)
                if start <= record["start"] <= end:
                    by_role[role].append(record)
    return by_role


def _kind(begin: Record) -> str:
    if begin["sync_loads"]:
        return "sync load"
    if begin["loads"]:
        return "async load"
    if begin["stores"]:
        return "store"
    return "idle" if begin["idle"] else "plain"


def worker_steps(records: list[Record]) -> dict[str, dict[str, float]]:
    """Per kind of step: count, mean span, mean ms of each hook."""
    steps: dict[Any, dict[str, Record]] = defaultdict(dict)
    for record in records:
        if record.get("step") is not None:
            steps[record["step"]][record["hook"]] = record
    by_kind: dict[str, list[dict[str, Record]]] = defaultdict(list)
    for hooks in steps.values():
        if "begin_step" in hooks and "transfer_results" in hooks:
            by_kind[_kind(hooks["begin_step"])].append(hooks)
    out = {}
    for kind in KINDS:
        chosen = by_kind.get(kind, [])
        if not chosen:
            continue
        spans = [(h["transfer_results"]["start"] - h["begin_step"]["start"]) * 1e3
                 + h["transfer_results"]["ms"] for h in chosen]
        row = {"steps": float(len(chosen)), "span_ms": statistics.fmean(spans),
               "span_p50_ms": statistics.median(spans)}
        for hook in WORKER_HOOKS:
            row[f"{hook}_ms"] = statistics.fmean(h[hook]["ms"] if hook in h else 0.0 for h in chosen)
        out[kind] = row
    return out


def scheduler_steps(records: list[Record]) -> dict[str, float]:
    """Per scheduler step (one `build_connector_meta` each): the mean ms of each hook, the lookups."""
    builds = [r for r in records if r["hook"] == "build_connector_meta"]
    if not builds:
        return {}
    lookups = [r for r in records if r["hook"] == "get_num_new_matched_tokens"]
    out = {"steps": float(len(builds)), "lookups": float(len(lookups)),
           "lookups_in_flight": float(sum(1 for r in lookups if r.get("tokens") is None))}
    for hook in SCHEDULER_HOOKS:
        out[f"{hook}_ms_per_step"] = sum(r["ms"] for r in records if r["hook"] == hook) / len(builds)
    return out


def summarize(prefix: str, start: float = float("-inf"), end: float = float("inf")) -> dict[str, Any]:
    by_role = read(prefix, start, end)
    return {"worker": worker_steps(by_role.get("worker", [])),
            "scheduler": scheduler_steps(by_role.get("scheduler", []))}


def print_summary(summary: dict[str, Any], title: str = "") -> None:
    print(f"\nconnector step trace{f' ({title})' if title else ''}: worker steps by kind, mean ms")
    print(f"{'kind':<11}{'steps':>7}{'span':>8}{'p50':>8}" + "".join(f"{h:>18}" for h in WORKER_HOOKS))
    for kind, row in summary["worker"].items():
        print(f"{kind:<11}{row['steps']:>7.0f}{row['span_ms']:>8.1f}{row['span_p50_ms']:>8.1f}"
              + "".join(f"{row[f'{h}_ms']:>18.2f}" for h in WORKER_HOOKS))
    s = summary["scheduler"]
    if s:
        print(f"scheduler: {s['steps']:.0f} steps, {s['lookups']:.0f} lookups ({s['lookups_in_flight']:.0f} "
              "answered 'still in flight'); ms per step: "
              + ", ".join(f"{h} {s[f'{h}_ms_per_step']:.2f}" for h in SCHEDULER_HOOKS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="the lmcache.mp.step_trace the engine ran with")
    parser.add_argument("--start", type=float, default=float("-inf"), help="monotonic seconds")
    parser.add_argument("--end", type=float, default=float("inf"), help="monotonic seconds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    summary = summarize(args.prefix, args.start, args.end)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["worker"] or summary["scheduler"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
