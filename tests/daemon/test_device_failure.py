"""A failing GPU: one whose copies fail (a sticky CUDA error: a worker died mid-copy and its memory
went away) or never complete cannot hang or poison the daemon: the request that met it gets a
typed error, one CRITICAL line says why, and the daemon exits non-zero for its supervisor to
restart it (systemd: Restart=on-failure). The failure itself is made by
`tests/support/fatal_daemon.py`; the bounded wait that raises it on a GPU is tested in
unit/test_transfer_context.py."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from lmcache_mp.cli.main import EXIT_FAILED
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import ServerError
from lmcache_mp.protocol import ErrorCode, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.fatal_daemon import MESSAGE
from vllm_adapter import LMCacheMPWorkerAdapter


def test_a_fatal_copy_error_is_answered_then_the_daemon_exits_non_zero(daemons: Callable) -> None:
    daemon: DaemonProcess = daemons("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
                                    command_prefix=[sys.executable, "-m", "tests.support.fatal_daemon"])
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    try:
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        hashes = block_hashes(list(range(CHUNK)))[CHUNK // BLOCK - 1::CHUNK // BLOCK]
        keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id="r") for h in hashes]
        with pytest.raises(ServerError) as failed:
            worker.mq_client.submit(RequestType.STORE, [keys, worker.instance_id, [0, 1], b""]).result(10)
        assert failed.value.code is ErrorCode.INTERNAL
        assert MESSAGE in failed.value.message and "restarted" in failed.value.message
        assert daemon.proc.wait(30) == EXIT_FAILED
    finally:
        worker.shutdown()
    log = daemon.log()
    critical = [line for line in log.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1 and MESSAGE in critical[0], log
    assert "Traceback" not in log, log
    assert not daemon.socket_path.exists()  # removed: the next daemon binds at once
