#!/usr/bin/env python
"""What a cache miss costs: the connector's work for a prompt the daemon does not hold.

    .venv/bin/python scripts/bench/bench_miss_path.py [--out bench-out] [--quick] [--rounds N]

A miss is the path every first turn takes: a LOOKUP that finds nothing, then STOREs of the
prompt's chunks while vLLM computes it. Comparing fresh engine processes with and without the
connector cannot show a cost of a few percent: two processes of the same engine differ by that
much (one run saw 1.45 s and 1.32 s for one setup, 1.31 s and 1.40 s for the other). So two
engines run side by side, both alive the whole time, on the same random-weight Llama as
bench_e2e (8 layers, hidden 1024, fp32): C with the connector, against a fresh daemon, and B
without. Each round sends three fresh prompts of 2,049 tokens (a miss everywhere), one at a
time, in an order that rotates every round:
  C, miss     the connector at work: lookup (a miss), stores of the prompt's 8 chunks;
  C, skipped  the same engine, the request marked `lmcache.mp.skip_load` and `skip_save`
              (`kv_transfer_params`): the connector does nothing for it;
  B           no connector at all.
Paired ratios per round (each pair ran seconds apart, on the same machine state) separate what
a miss costs per request (C miss / C skipped: the lookup, the stores, the daemon's copies beside
the engine) from what the connector costs by being there (C skipped / B: its threads, its
registration, vLLM's connector hooks), and give the total (C miss / B). Target: the total's
median within 3%. Also checks that the daemon stored every miss's chunks and none of
the skipped ones'. Prints a table, writes miss_path.json to --out. About 4 minutes on 2 quiet
cores (--quick: 4 rounds).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_e2e import MODEL_FLAGS
from harness import figure, finish
from harness.engines import CHUNK, ENGINE_TIMEOUT_S, EngineProcess, build_model, engine_args, llm_args

DTYPE = "float32"  # bf16 matmuls crawl on CPUs without AVX512-BF16
PROMPT_TOKENS, MAX_TOKENS, VOCAB_IDS = 2049, 4, (3, 1000)
TARGET = 0.03
SKIP = {"kv_transfer_params": {"lmcache.mp.skip_load": True, "lmcache.mp.skip_save": True}}
VARIANTS = ("C, miss", "C, skipped", "B")


def run_engine(spec: dict[str, Any]) -> None:
    """Child process: one engine; a RESULT line once ready, then one per request read on stdin
    (a JSON line: the prompt and whether the connector skips it)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_args(spec["model"], DTYPE, spec["url"]))
    warmup = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], warmup, use_tqdm=False)
    print("RESULT {}", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                extra_args=SKIP if request["skip"] else None)
        out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)[0]
        print("RESULT " + json.dumps({"ttft_s": out.metrics.first_token_latency,
                                      "cached_tokens": out.num_cached_tokens}), flush=True)


def send(engine: EngineProcess, prompt: list[int], skip: bool) -> float:
    """One request; its TTFT in seconds."""
    result = engine.turn(json.dumps({"prompt": prompt, "skip": skip}))
    if result["cached_tokens"]:
        raise RuntimeError(f"a fresh prompt found {result['cached_tokens']} cached tokens: not a miss")
    return result["ttft_s"]


def measure(engines: dict[str, EngineProcess], rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """`rounds` rounds of the three variants, each a fresh prompt, the order rotating per round."""
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            prompt = [rng.randrange(*VOCAB_IDS) for _ in range(PROMPT_TOKENS)]
            engine = engines["B" if variant == "B" else "C"]
            ttft[variant].append(send(engine, prompt, skip=variant == "C, skipped"))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{v} {ttft[v][-1] * 1e3:.0f} ms" for v in VARIANTS),
              flush=True)
    return ttft


def paired(ttft: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over rounds of numerator / denominator, minus one."""
    return statistics.median(a / b for a, b in zip(ttft[numerator], ttft[denominator], strict=True)) - 1


def plot(ttft: dict[str, list[float]], path: Path) -> None:
    with figure(path, figsize=(6, 3.5)) as ax:
        for variant, values in ttft.items():
            ax.plot([t * 1e3 for t in values], marker="o", label=variant)
        ax.set_xlabel("round")
        ax.set_ylabel("TTFT (ms), a fresh 2,049-token prompt")
        ax.legend(fontsize=8)


def main() -> int:
    args = engine_args(__doc__, "4 rounds instead of --rounds", {"rounds": 16}, run_engine)
    if args is None:
        return 0
    from lmcache_mp.testing.launcher import daemon_status, start_daemon

    rounds = 4 if args.quick else args.rounds
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="lmc-miss-", dir="/tmp") as tmp:
        build_model(Path(tmp) / "model", DTYPE, MODEL_FLAGS)
        daemon = start_daemon(Path(tmp), "--l1-size-gb", "2", "--chunk-size", str(CHUNK))
        engines: dict[str, EngineProcess] = {}
        try:
            warmup = [rng.randrange(*VOCAB_IDS) for _ in range(PROMPT_TOKENS)]
            for name, url in (("C", daemon.url), ("B", None)):
                spec = {"model": str(Path(tmp) / "model"), "url": url, "warmup": warmup}
                engines[name] = EngineProcess(__file__, spec, args.out / f"miss-path-{name}.log",
                                              ENGINE_TIMEOUT_S)
            for engine in engines.values():
                engine.result()  # ready
            objects_before = daemon_status(daemon.url).objects
            start = time.monotonic()
            ttft = measure(engines, rounds, rng)
            elapsed = time.monotonic() - start
            stored = daemon_status(daemon.url).objects - objects_before
        finally:
            for engine in engines.values():
                engine.close()
            daemon.stop(timeout=30)
    per_request, presence, total = (paired(ttft, "C, miss", "C, skipped"), paired(ttft, "C, skipped", "B"),
                                    paired(ttft, "C, miss", "B"))
    print(f"\n{'variant':<14}{'TTFT p50 ms':>13}{'mean ms':>10}")
    for variant in VARIANTS:
        print(f"{variant:<14}{statistics.median(ttft[variant]) * 1e3:>13.1f}"
              f"{statistics.fmean(ttft[variant]) * 1e3:>10.1f}")
    print(f"\npaired medians over {rounds} rounds ({elapsed:.0f} s): a miss's work {per_request:+.1%} "
          f"(C miss / C skipped), the connector's presence {presence:+.1%} (C skipped / B), "
          f"total {total:+.1%} (C miss / B)")
    expected = rounds * (PROMPT_TOKENS // CHUNK)
    checks = {f"a miss costs at most {TARGET:.0%} over no connector ({total:+.1%}, paired median)":
                  total <= TARGET,
              f"the daemon stored every miss's chunks and none of the skipped ({stored} of {expected})":
                  stored == expected}
    finish(args.out, "miss_path", checks,
           {"ttft_ms": {v: [t * 1e3 for t in ts] for v, ts in ttft.items()}, "rounds": rounds,
            "per_request": per_request, "presence": presence, "total": total, "checks": checks},
           lambda path: plot(ttft, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
