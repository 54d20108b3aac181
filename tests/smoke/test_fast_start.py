"""A fast start: the daemon answers HELLO, PING and STATUS before it imports torch; real daemons.

The engine (pool, tiers, attach socket) needs torch, whose import takes seconds; the daemon binds
first and builds the engine on a thread of its own. To look into that window deterministically,
these daemons run under `_GATE`, which holds the daemon's `import torch` until the test opens the
gate: the import itself is real and unchanged, only its start is delayed. A daemon that needed
torch before answering would never answer under the gate.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient, MessageQueueServer
from lmcache_mp.protocol import (
    PHASE_SERVING,
    PHASE_STARTING,
    ChunkOutcome,
    ErrorCode,
    KVCacheRegistration,
    ModelScope,
    RequestType,
    StatusReport,
)
from lmcache_mp.storage.tiers.disk import DiskTier
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess, start_daemon
from tests.support.helpers import chunk_hashes, count_lookup, lookup, refusal, status, store
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter
from vllm_adapter.registration import MAX_PROBE_INTERVAL_S

# A command prefix for `start_daemon`: `python -c _GATE GO_FILE PYTHON -m MODULE ARGS...` runs MODULE
# with ARGS in this interpreter, with `import torch` held until GO_FILE exists.
_GATE = """\
import importlib.abc, os, runpy, sys, time
go = sys.argv[1]
class Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            while not os.path.exists(go):
                time.sleep(0.01)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Gate())
module, sys.argv = sys.argv[4], [sys.argv[4], *sys.argv[5:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
# Requests answered while starting, and one well-formed request of each other type: refused STARTING.
_EARLY = {RequestType.HELLO, RequestType.PING, RequestType.GET_CHUNK_SIZE, RequestType.STATUS}
_KEY = IPCCacheEngineKey("m", 1, 0, chunk_hash=b"\1" * 32, request_id="r")
_ANY_RANK = IPCCacheEngineKey("m", 1, None, chunk_hash=b"\1" * 32, request_id="r")  # LOOKUP's keys
_REFUSED: dict[RequestType, list] = {
    RequestType.REGISTER_KV_CACHE: [7, [], KVCacheRegistration("m", 1, 0)],
    RequestType.UNREGISTER_KV_CACHE: [7],
    RequestType.LOOKUP: [[_ANY_RANK]],
    RequestType.LOOKUP_CHUNKS: ["m", 1, "r", [b"\1" * 32]],
    RequestType.STORE: [[_KEY], 7, [0, 1], b""],
    RequestType.RETRIEVE: [[_KEY], 7, [0, 1], b""],
    RequestType.END_SESSION: ["r"],
    RequestType.CLEAR: [],
    RequestType.CLEAR_TIERS: [],
    RequestType.CANCEL_TRANSFERS: [7, ["r"]],
    RequestType.RELEASE_LEASES: [[_ANY_RANK]],
    RequestType.KV_EVENTS: [0, ["m"], 10],
    RequestType.LOOKUP_PREFIX: ["m", 1, "r", [b"\1" * 32], []],
    RequestType.NOTE_TAILS: ["m", 1, [], []],
    RequestType.RESET_MODEL: [ModelScope(["m"])],
}
assert set(_REFUSED) == set(RequestType) - _EARLY


class GatedDaemon:
    """A daemon whose torch import waits for `open_gate`."""

    def __init__(self, tmp: Path, args: tuple[str, ...]):
        self._go = tmp / "go"
        prefix = (sys.executable, "-c", _GATE, str(self._go))
        # Returns on the first HELLO answer: the daemon is starting.
        self.daemon = start_daemon(tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", *args,
                                   command_prefix=prefix, serving=False, pool_ready=False)

    def open_gate(self) -> None:
        self._go.touch()

    def wait_serving(self, timeout: float = 120) -> StatusReport:
        deadline = time.monotonic() + timeout
        while (report := status(self.daemon.url)).phase != PHASE_SERVING:
            assert self.daemon.proc.poll() is None and time.monotonic() < deadline, self.daemon.log()
            time.sleep(0.01)
        return report


@pytest.fixture
def gated(short_tmp: Path) -> Iterator[Callable[..., GatedDaemon]]:
    made: list[GatedDaemon] = []

    def make(*args: str) -> GatedDaemon:
        made.append(GatedDaemon(short_tmp, args))
        return made[-1]

    yield make
    for gate in made:
        gate.open_gate()  # a daemon stopped while its import waits would wait out BUILD_JOIN_TIMEOUT_S
        if gate.daemon.proc.poll() is None:
            gate.daemon.stop(signal.SIGKILL)


def test_daemon_modules_load_no_torch() -> None:
    code = ("import sys\n"
            "import lmcache_mp.cli.main, lmcache_mp.daemon.daemon, lmcache_mp.daemon.server\n"
            "import lmcache_mp.observability.metrics\n"
            "import lmcache_mp.testing.launcher, lmcache_mp.testing.blocks, lmcache_mp.testing.probes\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_torch_libraries_are_preloaded_without_importing_torch() -> None:
    code = ("import sys\n"
            "from lmcache_mp.daemon.daemon import preload_torch_libraries\n"
            "preload_torch_libraries()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('torch' in sys.modules, 'libtorch_cpu.so' in maps, 'libc10.so' in maps)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


def test_hello_ping_status_are_answered_before_torch_and_the_rest_is_refused_starting(gated) -> None:
    gate = gated()
    client = MessageQueueClient(gate.daemon.url)
    try:
        hello = client.handshake("tests")
        assert hello.phase == PHASE_STARTING and hello.chunk_size == CHUNK
        assert client.submit(RequestType.PING, [41]).result(10) == 41
        assert client.submit(RequestType.GET_CHUNK_SIZE, []).result(10) == CHUNK
        early = client.submit(RequestType.STATUS, []).result(10)
        assert early.phase == PHASE_STARTING and not early.pool_ready and early.pool_bytes == 0
        for request_type, payload in _REFUSED.items():
            refused = refusal(client, request_type, payload)
            assert refused.code is ErrorCode.STARTING and "starting" in refused.message, request_type
        assert status(gate.daemon.url).phase == PHASE_STARTING  # still: the gate holds torch

        gate.open_gate()
        serving = gate.wait_serving()
        assert serving.pool_bytes > 0 and client.handshake("tests").phase == PHASE_SERVING
        assert client.submit(RequestType.LOOKUP, _REFUSED[RequestType.LOOKUP]).result(10) == 0
        unknown = refusal(client, RequestType.STORE, _REFUSED[RequestType.STORE])
        assert unknown.code is ErrorCode.UNKNOWN_INSTANCE  # the engine's answer now
    finally:
        client.close()
    assert gate.daemon.stop() == 0
    log = gate.daemon.log()
    assert log.index("starting pid=") < log.index("ready (node-local)") and "Traceback" not in log, log


def test_adapters_started_against_a_starting_daemon_register_once_it_serves(
        gated, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="vllm_adapter")
    gate = gated()
    url = gate.daemon.url
    worker = LMCacheMPWorkerAdapter(url, None, "m", 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(url, None, "m", 1, 0, BLOCK)
    try:
        with pytest.raises(ServerError) as refused:
            worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN")
        assert refused.value.code is ErrorCode.STARTING
        tokens = list(range(4 * CHUNK))
        assert lookup(scheduler, "early", block_hashes=block_hashes(tokens)) == 0  # a miss, not a hang
        assert not worker.ensure_registered()

        gate.open_gate()
        serving_at = None
        deadline = time.monotonic() + 120
        while not worker.ensure_registered():
            if serving_at is None and status(url).phase == PHASE_SERVING:
                serving_at = time.monotonic()
            assert time.monotonic() < deadline, gate.daemon.log()
            time.sleep(0.01)
        registered_at = time.monotonic()
        # Probed at the probe interval while it started, not backed off: registered soon after.
        assert serving_at is not None and registered_at - serving_at < 4 * MAX_PROBE_INTERVAL_S
        failures = [r.getMessage() for r in caplog.records
                    if r.levelno >= logging.WARNING and "regist" in r.getMessage()]
        assert not failures, failures

        while not status(url).pool_ready:  # a STORE before that may find NO_SPACE
            time.sleep(0.01)
        hashes = chunk_hashes(tokens)
        stored = store(worker.mq_client, worker.instance_id, hashes, "r1")
        assert stored == [ChunkOutcome.STORED] * len(hashes)
        assert lookup(scheduler, "late", block_hashes=block_hashes(tokens)) == len(tokens)
        assert count_lookup(worker.mq_client, hashes) == len(hashes)
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_a_failing_engine_build_exits_non_zero_with_one_line(gated, short_tmp: Path) -> None:
    # The disk tier's directory passes the checks before the start (it is writable), but this
    # process holds its lock: the engine's build fails, as with a second daemon on it.
    root = short_tmp / "disk"
    holder = DiskTier(root, 2**30)
    try:
        gate = gated("--l2", f"disk://{root}?size_gb=1")
        assert status(gate.daemon.url).phase == PHASE_STARTING  # answering, half-started
        gate.open_gate()
        assert gate.daemon.proc.wait(120) == 2
    finally:
        holder.close()
    log = gate.daemon.log()
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot start" in errors[0] and "in use by another" in errors[0], log
    assert "Traceback" not in log and "ready (node-local)" not in log, log
    assert not gate.daemon.socket_path.exists()


def test_sigterm_while_the_engine_is_built_stops_cleanly(gated) -> None:
    gate = gated()
    daemon: DaemonProcess = gate.daemon
    attach = daemon.socket_path.with_name(daemon.socket_path.name + ".attach")
    daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while daemon.socket_path.exists():  # it stops answering at once
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.01)
    assert daemon.proc.poll() is None  # and waits for the build, to close what it opened
    gate.open_gate()
    assert daemon.proc.wait(120) == 0
    log = daemon.log()
    assert "stopped" in log and "ready (node-local)" not in log and "Traceback" not in log, log
    assert not attach.exists()


def test_message_queue_server_stops_after_its_thread_has_closed(short_tmp: Path) -> None:
    # The I/O thread closes its doorbell once it sees `stop`'s flag, which it may do before `stop`
    # rings that doorbell (it wakes every tick): ringing a closed doorbell made a daemon exit 1.
    server = MessageQueueServer([f"ipc://{short_tmp / 'mq.sock'}"], lambda identity, frames: None)
    server.start()
    server.stop()
    server.stop()  # the doorbell is closed by now
