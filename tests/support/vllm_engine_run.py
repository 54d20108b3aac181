"""Run a real vLLM engine over rounds of token prompts and print what it reports.

    python -m tests.support.vllm_engine_run SPEC_JSON

SPEC: model, dtype, block_size, num_blocks (KV cache size; registering the cache with the
daemon moves it into shared memory, so small is quick), max_tokens, prefix_caching (bool),
connector (null, or the `kv_connector_extra_config` for LMCacheMPDaemonConnector), connector_module
(optional: another module holding a class of that name, instead of `vllm_adapter.connector`),
kv_connector (optional: a connector vLLM knows by name instead, e.g. "LMCacheMPConnector", which is
LMCache's own where the lmcache package is installed; `connector` is then its extra config),
kv_offloading (optional: {"backend", "size", "extra_config" (optional)}: vLLM's --kv-offloading-backend and
--kv-offloading-size, which choose the connector themselves; extra_config, its kv_connector_extra_config),
hybrid_kv_cache_manager (optional bool: vLLM's HMA on; off by default), hf_overrides (optional),
max_num_batched_tokens (optional), kv_events (optional: vLLM's `KVEventsConfig` fields, its KV event
publisher on), logprobs (optional bool: also report each generated token's
logprob), prompt_embeds (optional bool: vLLM's `enable_prompt_embeds`), max_lora_rank (optional:
LoRA on), rounds (a list of rounds, each a list of prompts, each a list of token ids or, with
prompt_embeds, `{"embeds_seed": s, "length": n}`: n rows of random embeddings drawn from seed s,
or `{"tokens": [...], "lora": [name, id, path]}`: token ids through that LoRA adapter; a prompt's
dict may also hold `kv_transfer_params`, the request's own connector settings), conversation
(optional bool: prompt j of round i > 0 is then the previous round's prompt j and its answer,
followed by these tokens: a multi-turn chat), barrier_dir (optional: before round i > 0, wait
until the file `go-i` exists there, so a test can act between rounds), hold_dir (optional: before
round 0, make the file `held` there, then wait until `go` exists there: the engine starts while
another runs), resets (optional: {"i": bool}: before round i, vLLM's
`reset_prefix_cache(reset_connector=bool)`, asked again until it succeeds: the stores of the round
before hold their blocks for a few more steps), results_dir (optional: where each round's result is
also written, whole, as `round-i.json`).

After each round it prints one line `RESULT {"round": i, "outputs": [{"num_cached_tokens":
n, "token_ids": [...]}, ...]}` (greedy decoding, fixed length). vLLM's own log goes to the
same stream, hence the prefix. A reader of the log can catch that line half written, so a test
reads `results_dir` instead: each file appears by a rename, complete or not at all. vLLM spawns
its processes, so the entry point is guarded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BARRIER_TIMEOUT_S = 300.0  # past the longest wait of a test between rounds (wait_for_status: 120 s)
RESET_TIMEOUT_S = 120.0


def kv_transfer_config(extra_config: dict[str, Any]) -> dict[str, Any]:
    """By the connector's name alone, as users write it: vLLM's plugin loader registers it."""
    return {"kv_connector": "LMCacheMPDaemonConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra_config}


def engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": spec["model"], "dtype": spec.get("dtype", "float32"), "max_model_len": 1024,
        "enforce_eager": True, "seed": 0, "max_num_seqs": 8, "block_size": spec["block_size"],
        "num_gpu_blocks_override": spec["num_blocks"],
        "enable_prefix_caching": spec.get("prefix_caching", True),
        "disable_hybrid_kv_cache_manager": not spec.get("hybrid_kv_cache_manager", False),
        "tensor_parallel_size": spec.get("tensor_parallel_size", 1),
    }
    if spec.get("hf_overrides"):  # another configuration of the same model
        args["hf_overrides"] = spec["hf_overrides"]
    if spec.get("max_num_batched_tokens"):  # small: a long prompt's prefill spans several steps
        args["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("prompt_embeds"):
        args["enable_prompt_embeds"] = True
    if spec.get("max_lora_rank"):
        args.update(enable_lora=True, max_lora_rank=spec["max_lora_rank"], max_loras=2)
    if spec.get("kv_events"):
        from vllm.config.kv_events import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    if spec.get("connector") is not None:
        args["kv_transfer_config"] = kv_transfer_config(spec["connector"])
        if spec.get("connector_module"):
            args["kv_transfer_config"]["kv_connector_module_path"] = spec["connector_module"]
        if spec.get("kv_connector"):  # a connector vLLM knows by name, e.g. LMCache's LMCacheMPConnector
            args["kv_transfer_config"]["kv_connector"] = spec["kv_connector"]
    if spec.get("kv_offloading"):
        offloading = spec["kv_offloading"]
        args.update(kv_offloading_backend=offloading["backend"], kv_offloading_size=offloading["size"])
        if offloading.get("extra_config"):
            args["kv_transfer_config"] = {"kv_connector_extra_config": offloading["extra_config"]}
    return args


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}")
        time.sleep(0.05)


def reset_prefix_cache(llm: Any, reset_connector: bool) -> None:
    """vLLM's reset, asked again while it fails: it succeeds only once every block is free, and a
    finished request's blocks wait for its stores, which the engine completes in its next steps."""
    deadline = time.monotonic() + RESET_TIMEOUT_S
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            raise RuntimeError(f"reset_prefix_cache(reset_connector={reset_connector}) failed for "
                               f"{RESET_TIMEOUT_S:g} s")
        time.sleep(0.05)


def _chosen_logprobs(completion: Any) -> list[float]:
    """The log-probability of each generated token: far more sensitive to wrong KV than the
    tokens of a tiny random model, which often repeat one token whatever the context."""
    steps = zip(completion.token_ids, completion.logprobs, strict=True)
    return [step[token].logprob for token, step in steps]


def prompt(p: list[int] | dict[str, Any], hidden_size: int) -> Any:
    """vLLM's prompt of token ids, or of embeddings (the same rows for the same seed)."""
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    if isinstance(p, list) or "tokens" in p:
        return TokensPrompt(prompt_token_ids=p if isinstance(p, list) else p["tokens"])
    import torch

    rows = torch.Generator().manual_seed(p["embeds_seed"])
    return EmbedsPrompt(prompt_embeds=torch.randn(p["length"], hidden_size, generator=rows))


def lora(p: list[int] | dict[str, Any]) -> Any:
    """The prompt's LoRA adapter, if it names one."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(*p["lora"]) if isinstance(p, dict) and "lora" in p else None


def publish(result: dict[str, Any], results_dir: str | None) -> None:
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if results_dir:
        path = Path(results_dir) / f"round-{result['round']}.json"
        path.with_suffix(".tmp").write_text(line)
        os.replace(path.with_suffix(".tmp"), path)


def main() -> int:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(spec))
    hidden_size = llm.llm_engine.model_config.get_hidden_size()

    def params(p: list[int] | dict[str, Any]) -> SamplingParams:
        transfer = p.get("kv_transfer_params") if isinstance(p, dict) else None
        return SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                              logprobs=0 if spec.get("logprobs") else None,
                              extra_args={"kv_transfer_params": transfer} if transfer else None)

    histories: list[list[int]] = []  # a conversation's: each prompt and its answer so far
    for i, prompts in enumerate(spec["rounds"]):
        if not i and spec.get("hold_dir"):
            (Path(spec["hold_dir"]) / "held").touch()
            wait_for(Path(spec["hold_dir"]) / "go")
        if i and spec.get("barrier_dir"):
            wait_for(Path(spec["barrier_dir"]) / f"go-{i}")
        if str(i) in spec.get("resets", {}):
            reset_prefix_cache(llm, spec["resets"][str(i)])
        if spec.get("conversation") and histories:
            prompts = [history + p for history, p in zip(histories, prompts, strict=True)]
        outputs = llm.generate([prompt(p, hidden_size) for p in prompts], [params(p) for p in prompts],
                               use_tqdm=False,
                               lora_request=[lora(p) for p in prompts])
        if spec.get("conversation"):
            histories = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
        results = [{"num_cached_tokens": o.num_cached_tokens, "token_ids": list(o.outputs[0].token_ids),
                    **({"logprobs": _chosen_logprobs(o.outputs[0])} if spec.get("logprobs") else {})}
                   for o in outputs]
        publish({"round": i, "outputs": results}, spec.get("results_dir"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
