"""Offline inference with vLLM and the lmcache-mp daemon as a KV cache shared across runs.

Run it twice. The first run computes the prompts and stores their KV chunks in the daemon;
the second run, a new vLLM process with an empty prefix cache of its own, loads those
chunks from the daemon: it reports cached prompt tokens and generates the same text.

    ./scripts/serve.sh &                                         # the daemon, default socket
    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny-llama  # or use any model you have
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 \\
        .venv/bin/python examples/offline_inference.py --model /tmp/tiny-llama
    # ...and the same command again

(The environment variables are for vLLM's CPU build: 1 GiB of KV cache, loopback only, no
usage reporting. A GPU build needs none of them.) `--url` points at another daemon.

It prints one JSON line per prompt. With the tiny model (vLLM's CPU block size 128, daemon
chunks of 256 tokens) the first run shows `"num_cached_tokens": 0` for the first prompt
(the second one shares its prefix, so vLLM may find it in its own cache), and the second
run shows 1536 for both: six whole chunks, loaded from the daemon.
"""

from __future__ import annotations

import argparse
import json

from lmcache_mp.config import default_url

PROMPTS = [
    "Describe the architecture of a key-value cache daemon for language model serving. " * 40,
    "Describe the architecture of a key-value cache daemon for language model serving. " * 40
    + "Then list its failure modes.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model name or local path")
    parser.add_argument("--url", default=default_url(), help="the daemon's URL (default: %(default)s)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    kv_transfer_config = {
        "kv_connector": "LMCacheMPDaemonConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a failed load is recomputed, not an error
        "kv_connector_extra_config": {"lmcache.mp.url": args.url},
    }
    llm = LLM(model=args.model, max_model_len=2048, enforce_eager=True,
              kv_transfer_config=kv_transfer_config)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32))
    for output in outputs:
        print(json.dumps({"prompt_tokens": len(output.prompt_token_ids or []),
                          "num_cached_tokens": output.num_cached_tokens,
                          "text": output.outputs[0].text}))


if __name__ == "__main__":  # vLLM starts its engine in new processes that import this file
    main()
