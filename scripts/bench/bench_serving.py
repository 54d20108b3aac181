#!/usr/bin/env python
"""Serving benchmark: multi-turn users whose contexts vLLM's own KV cache cannot keep.

    .venv/bin/python scripts/bench/bench_serving.py [--out bench-out] [--quick] [--users N] [--rounds N]

Workload: USERS users (default 8), each with a private context of 1,024-2,048 random tokens (a
document or system prompt; fixed seed) and a conversation that grows every round: a round sends
the user's whole history (context, earlier messages and answers) plus a new message of 50-100
tokens, and appends the 16-token greedy answer to the history. Rounds interleave users (user 1
round 1, user 2 round 1, ..., user 1 round 2, ...), one request at a time. vLLM's KV cache is cut
(`num_gpu_blocks_override`) to the longest conversation, which is under a quarter of the working
set (every user's final conversation; checked before anything runs), so by the time a user
returns, the other users' turns have evicted their context from it.

Three modes, each a fresh vLLM engine process on the same random-weight Llama (fp32, 4 layers,
hidden 512, 8 heads, 4 KV heads of 64: 8 KiB of KV per token, as bench_e2e's bf16 model; fp32
because bf16 matmuls run ~150x slower on AVX2-only CPUs and because its near-ties would make a
prefix hit's greedy tokens differ from a full prefill's): no connector; the connector against a
fresh daemon whose pool holds the whole working set; and the floor, no connector with vLLM's own
cache large enough for the whole working set (what no offload can beat: every returning turn
finds all its history in vLLM's own prefix cache, at block granularity). The engines run side by
side, in lock step: each turn goes to each engine in turn (the order rotates every turn), so that
load from the rest of the machine falls on all alike. TTFT is vLLM's `first_token_latency`;
total time is an engine's busy time (the sum of its requests' wall times).

Checks (exit 1 if a correctness check fails): all modes answer every turn with the same tokens;
without the connector no returning turn finds any of its tokens in vLLM's cache (the workload
evicts as intended); with it every returning turn finds all of its history that vLLM's rules
allow (all but the last answer token, whose KV was never computed): the full chunks and the tail
past them (`vllm_adapter.tails`; the table shows both numbers per turn). Targets: returning turns'
mean TTFT at least 3x lower with the connector, and within 10% of the floor's. Prints a table,
writes serving.json and serving.png to --out. Three engine starts (~45 s each on 2 quiet cores,
minutes under load) dominate both the full run and --quick (6 users with 512-1,024-token
contexts, 2 rounds).
"""

from __future__ import annotations

import json
import random
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

DTYPE = "float32"
LAYERS, KV_HEADS, HEAD_DIM = 4, 4, 64
MODEL_FLAGS = ["--hidden", "512", "--intermediate", "1536", "--layers", str(LAYERS), "--heads", "8",
               "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM), "--max-pos", "8192"]
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, fp32
MESSAGE_TOKENS, ANSWER_TOKENS, VOCAB_IDS = (50, 100), 16, (3, 1000)
POOL_GB = 0.5  # GiB: the full run's working set is ~115 MiB
TARGET_SPEEDUP, MAX_CACHE_SHARE, FLOOR_MARGIN = 3.0, 0.25, 1.10
Turns = list[dict[str, Any]]  # one engine's turns, in the order sent, as its RESULT lines give them


@dataclass(frozen=True)
class Workload:
    contexts: list[list[int]]  # per user
    messages: list[list[list[int]]]  # per user, per round
    warmup: list[int]  # one untimed request first (as long as the shortest context), shared with no user

    @property
    def users(self) -> int:
        return len(self.contexts)

    @property
    def rounds(self) -> int:
        return len(self.messages[0])

    def final_tokens(self, user: int) -> int:
        """Length of the user's conversation after its last answer (answers have a fixed length)."""
        return len(self.contexts[user]) + sum(map(len, self.messages[user])) + self.rounds * ANSWER_TOKENS

    def order(self) -> list[tuple[int, int]]:
        """(round, user) in the order sent: every user's round r before anyone's round r + 1."""
        return [(r, u) for r in range(self.rounds) for u in range(self.users)]


def make_workload(users: int, rounds: int, context: tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(*VOCAB_IDS) for _ in range(rng.randint(low, high))]

    contexts = [tokens(*context) for _ in range(users)]
    messages = [[tokens(*MESSAGE_TOKENS) for _ in range(rounds)] for _ in range(users)]
    return Workload(contexts, messages, tokens(context[0], context[0]))


def run_engine(spec: dict[str, Any]) -> None:
    """Child process: one engine serves the conversation workload one request at a time, each
    when a line arrives on stdin; a RESULT line with its cache size once ready, then one per turn."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = Workload(spec["contexts"], spec["messages"], spec["warmup"])
    llm = LLM(**{**llm_args(spec["model"], DTYPE, spec["url"]), "max_model_len": spec["max_model_len"],
                 "num_gpu_blocks_override": spec["gpu_blocks"]})
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    # First-use costs (allocations, the first store's registration path) belong to neither mode's figures.
    llm.generate([TokensPrompt(prompt_token_ids=work.warmup)], params, use_tqdm=False)
    print("RESULT " + json.dumps({"gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}),
          flush=True)
    history: list[list[int]] = [list(c) for c in work.contexts]
    for (rnd, user), _go in zip(work.order(), sys.stdin, strict=False):
        prompt = history[user] + work.messages[user][rnd]
        before, start = external_hits(), time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        answer = list(out.outputs[0].token_ids)
        history[user] = prompt + answer
        print("RESULT " + json.dumps({
            "round": rnd, "user": user, "prompt_tokens": len(prompt), "token_ids": answer,
            "ttft_s": out.metrics.first_token_latency, "cached_tokens": out.num_cached_tokens,
            "external_tokens": external_hits() - before, "wall_s": wall}), flush=True)


def summary(turns: Turns) -> dict[str, float]:
    ttft = sorted(t["ttft_s"] * 1e3 for t in turns)
    return {"n": len(ttft), "mean_ms": statistics.fmean(ttft), "p50_ms": statistics.median(ttft),
            "p90_ms": statistics.quantiles(ttft, n=10, method="inclusive")[8],
            "cached_tokens_mean": statistics.fmean(t["cached_tokens"] for t in turns),
            "external_tokens_mean": statistics.fmean(t["external_tokens"] for t in turns)}


def mode_figures(turns: Turns) -> dict[str, Any]:
    total_s = sum(t["wall_s"] for t in turns)  # the engine's busy time: it idles while the other one runs
    return {"first": summary([t for t in turns if t["round"] == 0]),
            "returning": summary([t for t in turns if t["round"] > 0]),
            "total_s": total_s, "requests_per_s": len(turns) / total_s,
            "prompt_tokens_per_s": sum(t["prompt_tokens"] for t in turns) / total_s}


def print_table(figures: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'mode':<14}{'turns':<11}{'n':>4}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}"
          f"{'cached':>9}{'external':>10}")
    for mode, fig in figures.items():
        for kind in ("first", "returning"):
            s = fig[kind]
            print(f"{mode:<14}{kind:<11}{s['n']:>4}{s['mean_ms']:>10.0f}{s['p50_ms']:>10.0f}{s['p90_ms']:>10.0f}"
                  f"{s['cached_tokens_mean']:>9.0f}{s['external_tokens_mean']:>10.0f}")
    for mode, fig in figures.items():
        print(f"{mode}: total {fig['total_s']:.1f} s, {fig['requests_per_s']:.2f} requests/s, "
              f"{fig['prompt_tokens_per_s']:.0f} prompt tokens/s")


def plot(runs: dict[str, Turns], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 3.8)) as (ax1, ax2):
        for mode, turns in runs.items():
            ax1.plot([t["ttft_s"] * 1e3 for t in turns], marker="o", markersize=3, label=mode)
        first_return = next(i for i, t in enumerate(next(iter(runs.values()))) if t["round"] > 0)
        ax1.axvline(first_return - 0.5, color="grey", linewidth=0.8, linestyle=":")
        ax1.set_yscale("log")
        ax1.set_xlabel("turn, in the order sent (users interleaved; returning turns right of the line)")
        ax1.set_ylabel("TTFT (ms)")
        ax1.legend(fontsize=7)
        groups = {f"{mode}\n{kind}": [t["ttft_s"] * 1e3 for t in turns if (t["round"] > 0) == returning]
                  for mode, turns in runs.items()
                  for kind, returning in (("first", False), ("returning", True))}
        ax2.boxplot(list(groups.values()), whis=(0, 100))
        ax2.set_xticks(range(1, len(groups) + 1), list(groups), fontsize=7)
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT (ms)")


def reusable_tokens(turns: Turns) -> list[int]:
    """Per turn, the tokens of its prompt an engine could find cached: all of the user's previous
    turn (its prompt and answer) but the answer's last token, whose KV was never computed."""
    last_prompt: dict[int, int] = {}
    reusable = []
    for t in turns:
        previous = last_prompt.get(t["user"])
        reusable.append(0 if previous is None else previous + ANSWER_TOKENS - 1)
        last_prompt[t["user"]] = t["prompt_tokens"]
    return reusable


def print_reuse(turns: Turns) -> None:
    print("\nwith the connector, per returning turn: tokens found (vLLM's cache + the daemon's) / reusable")
    reusable = reusable_tokens(turns)
    print("  " + ", ".join(f"{t['cached_tokens']}/{r}" for t, r in zip(turns, reusable, strict=True)
                           if t["round"] > 0))


def correctness_checks(work: Workload, runs: dict[str, Turns]) -> dict[str, bool]:
    plain, cached = runs["no connector"], runs["connector"]
    returning = [i for i, t in enumerate(plain) if t["round"] > 0]
    diverged = [i for i, turns in enumerate(zip(*runs.values(), strict=True))
                if any(t["token_ids"] != turns[0]["token_ids"] for t in turns)]
    reusable = reusable_tokens(cached)
    whole = [i for i in returning if cached[i]["cached_tokens"] == reusable[i]]
    return {
        f"every turn answered in every mode ({', '.join(str(len(t)) for t in runs.values())} of "
        f"{len(work.order())})": all(len(t) == len(work.order()) for t in runs.values()),
        f"outputs identical between the modes ({len(diverged)} turns differ)": not diverged,
        "without the connector, returning turns find nothing in vLLM's cache (evicted): "
        f"{sum(plain[i]['cached_tokens'] for i in returning)} tokens":
            all(plain[i]["cached_tokens"] == 0 for i in returning),
        "with the connector, every returning turn finds all its reusable history "
        f"({len(whole)} of {len(returning)}; {sum(cached[i]['external_tokens'] for i in returning):,} tokens "
        f"from the daemon)": len(whole) == len(returning),
    }


def cache_plan(work: Workload) -> tuple[int, int]:
    """(working set, vLLM's cache) in tokens: the cache holds the longest conversation, no more."""
    working_set = sum(work.final_tokens(u) for u in range(work.users))
    return working_set, -(-max(work.final_tokens(u) for u in range(work.users)) // BLOCK) * BLOCK


def run_modes(spec: dict[str, Any], floor_blocks: int, turns: int, tmp: Path,
              out: Path) -> dict[str, tuple[int, Turns]]:
    """The engines side by side, one request at a time: each turn goes to each engine in turn (the
    first rotating every turn), so that all meet the same load from the rest of the machine
    (`floor_blocks`: the floor's cache). Per mode, its engine's cache size in blocks and its turns."""
    from lmcache_mp.testing.launcher import start_daemon

    daemon = start_daemon(tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", str(POOL_GB))
    engines: dict[str, EngineProcess] = {}
    try:
        print("starting three engines: without the connector, with it (fresh daemon), and the floor "
              "(no connector, vLLM's cache holding everything)...", flush=True)
        for mode, url, log, blocks in (("no connector", None, "serving-plain.log", spec["gpu_blocks"]),
                                       ("connector", daemon.url, "serving-connector.log", spec["gpu_blocks"]),
                                       ("floor", None, "serving-floor.log", floor_blocks)):
            engines[mode] = EngineProcess(__file__, {**spec, "url": url, "gpu_blocks": blocks}, out / log,
                                          ENGINE_TIMEOUT_S)
        sizes = {mode: e.result()["gpu_blocks"] for mode, e in engines.items()}
        runs: dict[str, Turns] = {mode: [] for mode in engines}
        modes = list(engines)
        for i in range(turns):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                runs[mode].append(engines[mode].turn())
        return {mode: (sizes[mode], runs[mode]) for mode in engines}
    finally:
        for e in engines.values():
            e.close()
        daemon.stop(timeout=30)


def main() -> int:
    args = engine_args(__doc__, "smoke run: 6 users, short contexts, 2 rounds", {"users": 8, "rounds": 3},
                       run_engine)
    if args is None:
        return 0
    users, rounds, context = (6, 2, (512, 1024)) if args.quick else (args.users, args.rounds, (1024, 2048))
    work = make_workload(users, rounds, context)
    working_set, cache_tokens = cache_plan(work)
    share = cache_tokens / working_set
    print(f"{users} users x {rounds} rounds; working set {working_set:,} tokens "
          f"({working_set * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB of KV); "
          f"vLLM's cache {cache_tokens:,} tokens: {share:.1%} of it", flush=True)
    if share >= MAX_CACHE_SHARE or working_set * KV_BYTES_PER_TOKEN > POOL_GB * 2**30:
        print(f"FAIL: vLLM's cache must hold under {MAX_CACHE_SHARE:.0%} of the working set "
              f"and the daemon's {POOL_GB} GiB pool all of it: more users, please")
        return 1
    with tempfile.TemporaryDirectory(prefix="lmc-serving-") as tmp:
        build_model(Path(tmp) / "model", DTYPE, MODEL_FLAGS)
        # The cache holds `cache_tokens` in blocks, plus the null block vLLM keeps empty.
        spec = {"model": str(Path(tmp) / "model"), "contexts": work.contexts, "messages": work.messages,
                "warmup": work.warmup, "max_model_len": cache_tokens, "gpu_blocks": cache_tokens // BLOCK + 1,
                "url": None}
        # The floor's cache: every conversation, each block of it, the warmup's and the null block.
        floor_blocks = (sum(-(-work.final_tokens(u) // BLOCK) for u in range(work.users))
                        + cache_tokens // BLOCK + 2)
        results = run_modes(spec, floor_blocks, len(work.order()), Path(tmp), args.out)
    blocks = {mode: r[0] for mode, r in results.items()}
    runs = {mode: r[1] for mode, r in results.items()}
    figures = {mode: mode_figures(turns) for mode, turns in runs.items()}
    print_table(figures)
    print_reuse(runs["connector"])
    correctness = {f"vLLM's cache {cache_tokens:,} tokens ({share:.1%} of the working set) in the engines "
                   f"without and with the connector ({blocks['no connector']}, {blocks['connector']} blocks "
                   f"incl. the null block), the floor's {blocks['floor']} blocks":
                       blocks["no connector"] == blocks["connector"] == spec["gpu_blocks"]
                       and blocks["floor"] == floor_blocks,
                   **correctness_checks(work, runs)}
    speedup = figures["no connector"]["returning"]["mean_ms"] / figures["connector"]["returning"]["mean_ms"]
    # First turns are the same full prefills in both modes: their ratio is what the connector costs on a
    # miss (its lookup, its stores), plus whatever the other load on the machine did not even out.
    first_ratio = figures["no connector"]["first"]["mean_ms"] / figures["connector"]["first"]["mean_ms"]
    print(f"first turns' mean TTFT, without / with the connector: {first_ratio:.2f} (the same full prefills)")
    to_floor = figures["connector"]["returning"]["mean_ms"] / figures["floor"]["returning"]["mean_ms"]
    target = f"returning turns' mean TTFT {speedup:.1f}x lower with the connector (>= {TARGET_SPEEDUP:.0f}x)"
    near_floor = (f"returning turns' mean TTFT with the connector {to_floor:.2f}x the floor's "
                  f"(<= {FLOOR_MARGIN:.2f}x)")
    checks = {**correctness, target: speedup >= TARGET_SPEEDUP, near_floor: to_floor <= FLOOR_MARGIN}
    finish(args.out, "serving", checks,
           {"users": users, "rounds": rounds, "context_tokens": context, "working_set_tokens": working_set,
            "vllm_cache_tokens": cache_tokens, "cache_share": share, "speedup_returning_mean": speedup,
            "connector_to_floor_returning_mean": to_floor,
            "first_turn_ratio": first_ratio,
            "modes": figures, "checks": checks, "turns": runs},
           lambda path: plot(runs, path))
    return 0 if all(correctness.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
