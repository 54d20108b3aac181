"""The environment of every vLLM engine the tests and benchmarks start: offline, no usage stats,
loopback only, one reserved core (vLLM otherwise reserves one more when a connector is configured,
and runs with and without one would differ), and a directory of this process's own for what vLLM
puts in the temporary directory (its IPC sockets, named by UUID, and its `vllm_dist_*` rendezvous
files), removed when this process exits: an engine leaves those in /tmp, all of them when killed."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _engine_tmp() -> str:
    path = tempfile.mkdtemp(prefix="lmc-vllm-tmp-", dir="/tmp")  # short: a Unix socket path is <108 bytes
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def engine_env() -> dict[str, str]:
    """The variables an engine's process gets on top of the caller's environment."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "DO_NOT_TRACK": "1",
            "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONPATH": str(REPO),
            "VLLM_RPC_BASE_PATH": _engine_tmp(), "TMPDIR": _engine_tmp()}
