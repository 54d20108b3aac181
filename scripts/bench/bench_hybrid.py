#!/usr/bin/env python
"""Hybrid-model benchmark: KV memory in use and TTFT, vLLM's hybrid KV cache manager on and off.

    .venv/bin/python scripts/bench/bench_hybrid.py [--out bench-out] [--quick] [--prompts N]

Model: a random-weight Gemma 3 text model (`make_tiny_model.py --arch gemma3`, fp32) of 12
layers in Gemma 3's pattern, five sliding-window layers (window 128 tokens) to one full-attention
layer, 2 KV heads of 64. Workload: PROMPTS prompts (default 6) of 3,000-3,900 random tokens
(fixed seed), far beyond the window, sent one at a time, 16 greedy tokens each, prefill chunked
into steps of 512 tokens (`max_num_batched_tokens`: a sliding layer needs only the window and
the step's tokens; one step over the whole prompt would need it all at once).

Two modes, each with our connector against a fresh daemon of its own: vLLM's hybrid KV cache
manager (HMA) on, where vLLM gives the sliding layers and the full layers KV cache groups of
their own and frees sliding blocks once they leave the window; and HMA off, where every layer
keeps the KV of every token (what the connector forced before it supported HMA). Each runs a cold pass
(a fresh engine: prefills, the connector stores) and a warm pass (another fresh engine: the
same prompts, hits from the daemon, not from vLLM's own prefix cache). A reference, HMA on
without the connector, runs the cold pass: what vLLM alone holds. Each pass's engines run side
by side in lock step, as in bench_serving.py, so that load from the rest of the machine falls
on all alike; each engine gets the same KV memory budget (`VLLM_CPU_KVCACHE_SPACE`, 1 GiB).

Measured per mode and pass: the peak of vLLM's KV cache usage over each request (the fraction of
the budget's blocks in use, `SchedulerStats.kv_cache_usage`, which the scheduler reports after
every step), as blocks and as the bytes they stand for (an HMA block holds one group's layers,
a block without HMA all of them: bytes are what compare); TTFT (vLLM's `first_token_latency`).

Checks (exit 1 if one fails): with HMA on (vLLM's default, not forced: vLLM would turn it off
for a connector without HMA support), vLLM keeps it on (its log has no "Turning off hybrid kv
cache manager") and the connector works with several KV cache groups (its log line in the
scheduler and the worker); with HMA off, one group; every prompt gives the same tokens in all
five engines; no cold prompt finds anything cached; every warm prompt loads tokens from the
daemon (vLLM's `external_prefix_cache_hits`). Target: HMA on holds less KV memory at the peak
of the cold pass. Prints a table, writes hybrid.json and hybrid.png to --out. Five engine starts
(three, then two at a time) dominate both the full run and --quick (2 prompts of 2,000-2,500
tokens).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import figure, finish
from harness.engines import (
    BLOCK,
    CHUNK,
    ENGINE_TIMEOUT_S,
    EngineProcess,
    build_model,
    engine_args,
    external_hits,
    llm_args,
)

DTYPE, DTYPE_BYTES = "float32", 4
LAYER_TYPES = (["sliding"] * 5 + ["full"]) * 2
WINDOW, KV_HEADS, HEAD_DIM = 128, 2, 64
MODEL_FLAGS = ["--arch", "gemma3", "--layer-types", ",".join(LAYER_TYPES), "--sliding-window", str(WINDOW),
               "--hidden", "256", "--intermediate", "768", "--heads", "4", "--kv-heads", str(KV_HEADS),
               "--head-dim", str(HEAD_DIM), "--max-pos", "8192"]
LAYER_BLOCK_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one layer's K and V for one block
STEP_TOKENS, ANSWER_TOKENS, VOCAB_IDS, WARMUP_TOKENS = 512, 16, (3, 1000), 600
POOL_GB = 1.0  # GiB per daemon: the full run stores ~250 MiB of KV
PASSES = ("cold", "warm")
TURNING_OFF = "Turning off hybrid kv cache manager"
# The connector's start-up line: its role, its KV cache groups and each one's layers.
GROUPS_LINE = re.compile(r"LMCacheMPDaemonConnector \((SCHEDULER|WORKER)\) from "
                         r".*?(\d+) KV cache group\(s\)(.*)")
GROUP_LAYERS = re.compile(r"group \d+: (\d+) layers")
Requests = list[dict[str, Any]]  # one engine's requests, in the order sent, as its RESULT lines give them


@dataclass(frozen=True)
class Mode:
    hybrid: bool  # vLLM's hybrid KV cache manager left on (its default), else turned off
    connector: bool  # our connector, against a daemon of the mode's own
    passes: tuple[str, ...]


# The reference shows what vLLM alone holds with HMA on: a full prefill, no stores to wait for.
REFERENCE = "HMA on, no connector"
MODES = {"HMA on": Mode(True, True, PASSES), "HMA off": Mode(False, True, PASSES),
         REFERENCE: Mode(True, False, ("cold",))}


def slug(mode: str) -> str:
    return mode.lower().replace(",", "").replace(" ", "-")


def make_prompts(count: int, lengths: tuple[int, int], seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """`count` prompts of random token ids, and a warm-up prompt shared with none of them."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB_IDS) for _ in range(n)]

    return [tokens(rng.randint(*lengths)) for _ in range(count)], tokens(WARMUP_TOKENS)


def usage_trace() -> Any:
    """A vLLM stat logger that collects the KV cache usage the scheduler reports after every
    step, in `steps` (the caller empties it)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class UsageTrace(StatLoggerBase):
        def __init__(self) -> None:
            self.steps: list[float] = []

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self.steps.append(scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    return UsageTrace()


def run_engine(spec: dict[str, Any]) -> None:
    """Child process: one engine, the prompts one at a time, each when a line arrives on stdin;
    a RESULT line with its cache size once ready, then one per prompt."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    # HMA on is vLLM's default (None): it leaves HMA on for a connector that supports it, and
    # turns it off, with a warning, for one that does not.
    args = {**llm_args(spec["model"], DTYPE, spec["url"]), "max_num_batched_tokens": STEP_TOKENS,
            "disable_hybrid_kv_cache_manager": None if spec["hybrid"] else True}
    if "kv_transfer_config" in args:  # `vllm.LLM` takes a dict, the engine's arguments the config
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    usage = usage_trace()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[lambda _config, _index: usage])
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)

    def generate(request_id: str, prompt: list[int]) -> Any:
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        final = None
        while engine.has_unfinished_requests():
            final = next((out for out in engine.step() if out.finished), final)
        return final

    # First-use costs (allocations, the first store's registration path) belong to no figure.
    generate("warmup", spec["warmup"])
    print("RESULT " + json.dumps({"num_blocks": engine.vllm_config.cache_config.num_gpu_blocks}), flush=True)
    for index, (prompt, _go) in enumerate(zip(spec["prompts"], sys.stdin, strict=False)):
        before, start = external_hits(), time.perf_counter()
        usage.steps = []
        out = generate(str(index), prompt)
        wall = time.perf_counter() - start
        print("RESULT " + json.dumps({
            "prompt_tokens": len(prompt), "token_ids": list(out.outputs[0].token_ids),
            "ttft_s": out.metrics.first_token_latency, "cached_tokens": out.num_cached_tokens,
            "external_tokens": external_hits() - before, "peak_usage": max(usage.steps, default=0.0),
            "usage_steps": usage.steps, "wall_s": wall}), flush=True)


def connector_groups(log: str) -> dict[str, list[int]]:
    """Per connector role, the layer count of each KV cache group, from its log line (a model
    with one group: one entry, every layer)."""
    found: dict[str, list[int]] = {}
    for role, count, details in GROUPS_LINE.findall(log):
        layers = [int(n) for n in GROUP_LAYERS.findall(details)] or [len(LAYER_TYPES)]
        found[role] = layers if len(layers) == int(count) else []
    return found


def summary(requests: Requests, num_blocks: int, block_bytes: int) -> dict[str, Any]:
    ttft = [r["ttft_s"] * 1e3 for r in requests]
    peak = max(r["peak_usage"] for r in requests)
    # vLLM's usage counts the blocks in use out of all but the null block.
    peak_blocks = round(peak * (num_blocks - 1))
    return {"n": len(ttft), "ttft_mean_ms": statistics.fmean(ttft), "ttft_p50_ms": statistics.median(ttft),
            "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in requests),
            "external_tokens_mean": statistics.fmean(r["external_tokens"] for r in requests),
            "peak_usage": peak, "peak_blocks": peak_blocks, "peak_bytes": peak_blocks * block_bytes}


def geometry(engine: dict[str, Any]) -> dict[str, Any]:
    """A connector engine's KV cache: its blocks, and their size from the groups it logged (each
    block holds one layer of each group's: as many layers as a group has; one group, all)."""
    layers_per_block = max(engine["groups"]["WORKER"])
    block_bytes = layers_per_block * LAYER_BLOCK_BYTES
    return {"num_blocks": engine["num_blocks"], "kv_cache_groups": len(engine["groups"]["WORKER"]),
            "layers_per_block": layers_per_block, "block_bytes": block_bytes,
            "budget_bytes": (engine["num_blocks"] - 1) * block_bytes}


def all_figures(engines: dict[str, dict[str, dict[str, Any]]], runs: dict[str, dict[str, Requests]]
                ) -> dict[str, dict[str, Any]]:
    """Per mode, its geometry and each pass's summary. The reference has HMA on's geometry (the
    same model, budget and grouping: its block count is checked equal)."""
    figures = {}
    for mode, spec in MODES.items():
        cache = geometry(engines["HMA on" if mode == REFERENCE else mode]["cold"])
        figures[mode] = {**cache, **{phase: summary(runs[mode][phase], engines[mode][phase]["num_blocks"],
                                                    cache["block_bytes"]) for phase in spec.passes}}
    return figures


def print_table(figures: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'mode':<22}{'pass':<6}{'groups':>7}{'blocks':>8}{'block KiB':>10}{'peak blocks':>12}"
          f"{'peak MiB':>10}{'of budget':>10}{'TTFT mean':>11}{'p50':>8}{'loaded':>8}")
    for mode, fig in figures.items():
        for phase in MODES[mode].passes:
            f = fig[phase]
            print(f"{mode:<22}{phase:<6}{fig['kv_cache_groups']:>7}{fig['num_blocks']:>8}"
                  f"{fig['block_bytes'] / 2**10:>10.0f}{f['peak_blocks']:>12}{f['peak_bytes'] / 2**20:>10.1f}"
                  f"{f['peak_usage']:>10.2%}{f['ttft_mean_ms']:>11.0f}{f['ttft_p50_ms']:>8.0f}"
                  f"{f['external_tokens_mean']:>8.0f}")


def plot(figures: dict[str, dict[str, Any]], runs: dict[str, dict[str, Requests]], path: Path) -> None:
    with figure(path, 1, 3, figsize=(15, 3.8)) as (ax1, ax2, ax3):
        width = 0.8 / len(figures)
        for i, (mode, f) in enumerate(figures.items()):
            passes = MODES[mode].passes
            in_use = (f["num_blocks"] - 1) * f["block_bytes"] / 2**20  # MiB per unit of usage
            ax3.plot([u * in_use for u in runs[mode]["cold"][0]["usage_steps"]], marker=".", label=mode)
            ax1.bar([PASSES.index(p) + i * width for p in passes],
                    [f[p]["peak_bytes"] / 2**20 for p in passes], width, label=mode)
            for phase in passes:
                first = PASSES.index(phase) * len(runs[mode]["cold"])
                ttft = [r["ttft_s"] * 1e3 for r in runs[mode][phase]]
                ax2.plot(range(first, first + len(ttft)), ttft, marker="o", markersize=3, color=f"C{i}",
                         label=mode if phase == passes[0] else None)
        ax1.set_xticks([x + width * (len(figures) - 1) / 2 for x in range(len(PASSES))],
                       [f"{p} pass" for p in PASSES])
        ax2.axvline(len(runs["HMA on"]["cold"]) - 0.5, color="grey", linewidth=0.8, linestyle=":")
        ax2.set_yscale("log")
        ax2.set_xlabel("request (cold pass, then warm pass right of the line)")
        ax3.set_xlabel("engine step (cold pass, first prompt: prefill, then decode)")
        for ax, label in ((ax1, "KV memory in use at the peak (MiB)"), (ax2, "TTFT (ms)"),
                          (ax3, "KV memory in use (MiB)")):
            ax.set_ylabel(label)
            ax.legend(fontsize=7)


def run_pass(phase: str, spec: dict[str, Any], urls: dict[str, str], out: Path
             ) -> tuple[dict[str, dict[str, Any]], dict[str, Requests]]:
    """One fresh engine per mode that has this pass, side by side in lock step (who goes first
    rotating every prompt). Per mode: its engine's cache size, what its log says (connector
    groups, HMA turned off), and its requests."""
    engines = {mode: EngineProcess(__file__, {**spec, "url": urls.get(mode), "hybrid": m.hybrid},
                                   out / f"hybrid-{phase}-{slug(mode)}.log", ENGINE_TIMEOUT_S)
               for mode, m in MODES.items() if phase in m.passes}
    order = list(engines)
    try:
        ready = {mode: e.result() for mode, e in engines.items()}
        runs: dict[str, Requests] = {mode: [] for mode in engines}
        for i in range(len(spec["prompts"])):
            for mode in order[i % len(order):] + order[:i % len(order)]:
                runs[mode].append(engines[mode].turn())
    finally:
        for e in engines.values():
            e.close()
    logs = {mode: e.log.read_text() for mode, e in engines.items()}
    info = {mode: {**ready[mode], "groups": connector_groups(log), "turned_off": TURNING_OFF in log}
            for mode, log in logs.items()}
    return info, runs


def log_checks(engines: dict[str, dict[str, dict[str, Any]]]) -> dict[str, bool]:
    """What each engine's log says: HMA stays on where asked, the connector's groups."""
    checks = {}
    for mode, spec in MODES.items():
        for phase in spec.passes:
            info = engines[mode][phase]
            groups = {role: len(layers) for role, layers in info["groups"].items()}
            if spec.hybrid:
                checks[f"{mode}, {phase}: vLLM keeps HMA on (no '{TURNING_OFF}')"] = not info["turned_off"]
            if not spec.connector:
                continue
            # Both roles logged the same groups, each group with its layer count (0: unreadable).
            agree = set(groups) == {"SCHEDULER", "WORKER"} and len(set(groups.values())) == 1
            counts = [len(layers) for layers in info["groups"].values()]
            readable = all(layers and min(layers) > 0 for layers in info["groups"].values())
            checks[f"{mode}, {phase}: the connector runs {groups} KV cache group(s) (scheduler, worker)"] = (
                agree and readable and (min(counts) > 1) == spec.hybrid)
    blocks = {mode: engines[mode]["cold"]["num_blocks"] for mode in ("HMA on", REFERENCE)}
    checks[f"{REFERENCE} has HMA on's KV cache ({blocks})"] = len(set(blocks.values())) == 1
    return checks


def correctness_checks(runs: dict[str, dict[str, Requests]], count: int) -> dict[str, bool]:
    tokens = {(mode, phase): [r["token_ids"] for r in runs[mode][phase]]
              for mode, spec in MODES.items() for phase in spec.passes}
    reference = tokens[(REFERENCE, "cold")]
    differ = sorted({i for seqs in tokens.values() for i, seq in enumerate(seqs) if seq != reference[i]})
    cold = [r for mode in MODES for r in runs[mode]["cold"]]
    warm = [r for mode, spec in MODES.items() if "warm" in spec.passes for r in runs[mode]["warm"]]
    return {
        f"every prompt answered by all {len(tokens)} engines ({count} each)":
            all(len(seqs) == count for seqs in tokens.values()),
        f"the same tokens for every prompt in every engine (prompts that differ: {differ})": not differ,
        f"no cold prompt finds cached tokens ({sum(r['cached_tokens'] for r in cold)} in all)":
            all(r["cached_tokens"] == 0 for r in cold),
        f"every warm prompt loads tokens from the daemon ({sum(r['external_tokens'] > 0 for r in warm)} "
        f"of {len(warm)})": all(r["external_tokens"] > 0 for r in warm),
    }


def run_modes(spec: dict[str, Any], tmp: Path, out: Path
              ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, Requests]]]:
    """Both passes; each connector mode's engines against a fresh daemon of its own. Per mode
    and pass: the engine's facts and its requests."""
    from lmcache_mp.testing.launcher import start_daemon

    daemons = {}
    try:
        for mode in (mode for mode, m in MODES.items() if m.connector):
            home = tmp / f"daemon-{slug(mode)}"
            home.mkdir()
            daemons[mode] = start_daemon(home, "--chunk-size", str(CHUNK), "--l1-size-gb", str(POOL_GB))
        urls = {mode: d.url for mode, d in daemons.items()}
        engines: dict[str, dict[str, dict[str, Any]]] = {mode: {} for mode in MODES}
        runs: dict[str, dict[str, Requests]] = {mode: {} for mode in MODES}
        for phase in PASSES:
            print(f"{phase} pass: a fresh engine per mode...", flush=True)
            info, requests = run_pass(phase, spec, urls, out)
            for mode in info:
                engines[mode][phase], runs[mode][phase] = info[mode], requests[mode]
        return engines, runs
    finally:
        for daemon in daemons.values():
            daemon.stop(timeout=30)


def main() -> int:
    args = engine_args(__doc__, "smoke run: 2 prompts of 2,000-2,500 tokens", {"prompts": 6}, run_engine)
    if args is None:
        return 0
    count, lengths = (2, (2000, 2500)) if args.quick else (args.prompts, (3000, 3900))
    prompts, warmup = make_prompts(count, lengths)
    print(f"{count} prompts of {min(map(len, prompts)):,}-{max(map(len, prompts)):,} tokens; "
          f"{len(LAYER_TYPES)} layers ({LAYER_TYPES.count('sliding')} sliding, window {WINDOW}); "
          f"prefill steps of {STEP_TOKENS} tokens", flush=True)
    with tempfile.TemporaryDirectory(prefix="lmc-hybrid-") as tmp:
        build_model(Path(tmp) / "model", DTYPE, MODEL_FLAGS)
        spec = {"model": str(Path(tmp) / "model"), "prompts": prompts, "warmup": warmup}
        engines, runs = run_modes(spec, Path(tmp), args.out)
    checks = log_checks(engines)
    # The groups the connector logged give each mode's block size in bytes: no figures without them.
    figures = all_figures(engines, runs) if all(checks.values()) else {}
    checks.update(correctness_checks(runs, count))
    correct = all(checks.values())
    if figures:
        print_table(figures)
        peaks = {mode: figures[mode]["cold"]["peak_bytes"] for mode in MODES}
        share = peaks["HMA on"] / peaks["HMA off"]
        checks[f"HMA on holds less KV memory at the cold pass's peak: {share:.1%} of HMA off's "
               f"({peaks[REFERENCE] / peaks['HMA off']:.1%} without the connector)"] = share < 1
    finish(args.out, "hybrid", checks,
           {"prompts": count, "prompt_tokens": [len(p) for p in prompts], "layer_types": LAYER_TYPES,
            "window": WINDOW, "step_tokens": STEP_TOKENS, "modes": figures, "checks": checks,
            "engines": engines, "requests": runs},
           lambda path: plot(figures, runs, path) if figures else None)
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
