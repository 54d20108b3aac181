"""Helpers the daemon tests share: chunk hashes (and a chat service's chains of them), raw requests
(STORE, LOOKUP), STATUS, example wire values, stand-in worker processes, running a script. What the
benchmarks and the soak use too (starting daemons and servers, the stand-in worker, its caches'
geometry and block hashes, /metrics) lives in `lmcache_mp.testing`.

Test modules never import each other: what two of them use lives here (or, for the connector's
halves driven step by step, in `connector_helpers.py`; for real vLLM engines, `vllm_engines.py`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lmcache_mp.chunks import ChunkFormat
from lmcache_mp.custom_types import CudaIPCWrapper, IPCCacheEngineKey, SharedMemoryTensor
from lmcache_mp.engine.dispatch import ARRIVAL
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ChunkOutcome, RequestType, StatusReport
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, block_hashes
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status
from lmcache_mp.testing.probes import scrape
from lmcache_mp.testing.servers import REDIS_CLI, REDIS_SERVER
from vllm_adapter import LMCacheMPSchedulerAdapter
from vllm_adapter.ops import striding_block_hashes

ADAPTER_LOG = "vllm_adapter.registration"  # the worker adapter's registration logger

# Example wire values, one of each kind of key and tensor handle (test_foundation round-trips
# them; test_wire_types pins their bytes).
HASH_KEY = IPCCacheEngineKey("m", 2, None, chunk_hash=b"\x01" * 32, request_id="req-1")
TOKEN_KEY = IPCCacheEngineKey("m", 1, 0, token_ids=(1, 2, 3), start=0, end=3, request_id="r")
SHM = SharedMemoryTensor(state=SharedMemoryTensor.State(0, 4096, "bfloat16", (2, 4, 8), (32, 8, 1), 0))
CUDA = CudaIPCWrapper(state=CudaIPCWrapper.State(
    "GPU-uuid", (0, b"\x00" * 64, 1024, 0, b"ref", 0, b"evt", True), "float16", (4, 4), (4, 1), 0))

status = daemon_status  # the tests' short name for one STATUS request
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server is not installed (scripts/setup.sh test installs it)")
# The lmcache door's tests drive LMCache's own client: without it they skip, and
# tests/unit/test_lmcache_peer.py fails with this line (a suite never passes without them).
LMCACHE_MISSING = ("lmcache is not installed: run `scripts/setup.sh test` (it installs lmcache==0.5.6 "
                   "--no-deps, the peer the lmcache door is tested against)")


def chunk_hashes(tokens: list[int]) -> list[bytes]:
    """The chunk keys of `tokens`' full chunks: the hash of each chunk's last block."""
    return list(striding_block_hashes(block_hashes(tokens), CHUNK // BLOCK))


def conversation_trace(conversations: int, lookups: int, seed: int, *, turn_chunks: int = 2,
                       max_chunks: int = 24, system_prompts: int = 4, system_chunks: int = 3,
                       zipf: float = 1.0) -> list[list[bytes]]:
    """The chunk chains a chat service LOOKUPs: `conversations` on a few shared system prompts,
    picked by a Zipf-like popularity (the k-th most popular 1 / k**zipf as often as the first);
    each LOOKUP asks for its conversation so far and its next turn (`turn_chunks` new chunks), and
    a conversation that would pass `max_chunks` starts over (a new chat on the same prompt)."""
    rng = random.Random(seed)

    def extend(chain: list[bytes], label: str) -> None:
        chain.append(hashlib.blake2b((chain[-1] if chain else b"") + label.encode(), digest_size=32).digest())

    systems: list[list[bytes]] = []
    for s in range(system_prompts):
        systems.append([])
        for i in range(system_chunks):
            extend(systems[-1], f"system prompt {s}, chunk {i}")
    chats = [list(systems[c % system_prompts]) for c in range(conversations)]
    restarts = [0] * conversations
    popularity = list(itertools.accumulate(1 / (k + 1) ** zipf for k in range(conversations)))
    trace = []
    for c in rng.choices(range(conversations), cum_weights=popularity, k=lookups):
        if len(chats[c]) + turn_chunks > max_chunks:
            restarts[c] += 1
            chats[c] = list(systems[c % system_prompts])
        for _ in range(turn_chunks):
            extend(chats[c], f"conversation {c}.{restarts[c]}, chunk {len(chats[c])}")
        trace.append(list(chats[c]))
    return trace


def fmt(layout: str = "CPU_ATTN", model: str = "m") -> ChunkFormat:
    """The format the daemon gives a chunk stored from SHAPE caches (page: 2 heads x 16 x 64)."""
    return ChunkFormat(model, 1, 0, layout, "bfloat16", LAYERS, (2, BLOCK, 64), CHUNK)


def store(client: MessageQueueClient, instance_id: int, hashes: list[bytes], request_id: str,
          first_block: int = 0) -> list[ChunkOutcome]:
    """One raw STORE of len(hashes) chunks from consecutive blocks."""
    keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id=request_id) for h in hashes]
    blocks = list(range(first_block, first_block + len(hashes) * (CHUNK // BLOCK)))
    return client.submit(RequestType.STORE, [keys, instance_id, blocks, b""]).result(10).outcomes


def lease(client: MessageQueueClient, hashes: list[bytes], request_id: str | None) -> int:
    """A raw LOOKUP that leases its hits to `request_id` (None: to nobody)."""
    keys = [IPCCacheEngineKey("m", 1, None, chunk_hash=h, request_id=request_id) for h in hashes]
    return client.submit(RequestType.LOOKUP, [keys]).result(10)


def count_lookup(client: MessageQueueClient, hashes: list[bytes]) -> int:
    """Leading chunks present, leasing nothing (no request id)."""
    return lease(client, hashes, None)


def lookup(scheduler: LMCacheMPSchedulerAdapter, request_id: str, **kw) -> int:
    scheduler.maybe_submit_lookup_request(request_id, **kw)
    deadline = time.monotonic() + 10
    while (hit := scheduler.check_lookup_result(request_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    scheduler.cleanup_lookup_result(request_id)
    return hit


def refusal(client: MessageQueueClient, request_type: RequestType, payload: list) -> ServerError:
    """The typed error the daemon answers this request with (a hang would be a timeout)."""
    with pytest.raises(ServerError) as refused:
        client.submit(request_type, payload).result(10)
    return refused.value


def register_requests(port: int) -> float:
    """REGISTER_KV_CACHE requests the daemon has answered, whatever the answer."""
    return sum(value for series, value in scrape(port).items()
               if series.startswith("lmcache_mp_requests_total{") and 'type="REGISTER_KV_CACHE"' in series)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Until `condition()` holds, asked every 10 ms up to a deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.01)


def wait_for_status(url: str, reached: Callable[[StatusReport], bool], what: str,
                    timeout_s: float = 60, daemon: DaemonProcess | None = None) -> StatusReport:
    """The first STATUS for which `reached` holds, asked until a deadline: what a worker sent
    (a STORE, a release) takes effect in the daemon later, by an amount a busy machine stretches.
    One connection, one request at a time, 50 ms apart: a new connection per request at 100 Hz
    took enough of a busy machine's CPU to starve the daemon it was waiting for. If a STATUS goes
    unanswered, the failure shows what `daemon`'s threads were doing (`DaemonProcess.threads`)."""
    deadline = time.monotonic() + timeout_s
    client = MessageQueueClient(url)
    try:
        while True:
            # Each STATUS may take what is left of the deadline: a starved daemon answers late.
            future = client.submit(RequestType.STATUS, [])
            if not future.wait(max(1.0, deadline - time.monotonic())):
                threads = daemon.threads() if daemon is not None else "(no daemon process given)"
                raise AssertionError(f"STATUS unanswered until the deadline ({timeout_s} s), waiting "
                                     f"for {what}; the daemon's threads:\n{threads}")
            report = future.result()
            if reached(report):
                return report
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}; STATUS {report}"
            time.sleep(0.05)
    finally:
        client.close()


def wait_for_leases(url: str, sessions: int, leases: int) -> None:
    """Until STATUS shows these many lease sessions and leases: RELEASE_LEASES and END_SESSION
    are fire and forget (and deferred by the scheduler adapter), so their effect shows later."""
    wait_for_status(url, lambda r: (r.sessions, r.leases) == (sessions, leases),
                    f"{sessions} sessions, {leases} leases")


def run_worker(spec: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.testing.kv_worker", json.dumps(spec)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out


def run_benchmark(script: str, args: list[str], timeout_s: float) -> str:
    """Run `scripts/bench/SCRIPT ARGS` to its end and return its output (stdout, then stderr), failing the
    test if it exits non-zero. It runs in a process group of its own, killed whole if it overruns
    `timeout_s`: a benchmark killed alone would leave its daemons running, holding their pools."""
    script_path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / script
    proc = subprocess.Popen([sys.executable, str(script_path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout_s} s:\n{stdout[-6000:]}{stderr[-3000:]}")
    output = stdout[-6000:] + stderr[-3000:]
    assert proc.returncode == 0, output
    return output


@contextmanager
def arrived(order: int) -> Iterator[None]:
    """Handle what follows as the request the server read `order`-th (as `server.py` does)."""
    token = ARRIVAL.set(order)
    try:
        yield
    finally:
        ARRIVAL.reset(token)


class Recorder:
    """A chunk copy for `CopyThreads.run` that notes which thread copied each chunk (and the
    `ARRIVAL` it saw), then returns `copy(i)`; each thread's first copy waits (up to 10 s) until
    `meet` threads have started one, so that a split is seen whichever thread starts first."""

    def __init__(self, copy: Callable[[int], bool] = lambda i: True, meet: int = 1):
        self.by_thread: dict[int, list[int]] = {}
        self.arrivals: dict[int, int] = {}
        self._copy = copy
        self._meet = threading.Barrier(meet)
        self._lock = threading.Lock()

    def __call__(self, i: int) -> bool:
        me = threading.get_ident()
        with self._lock:
            first = me not in self.by_thread
            self.by_thread.setdefault(me, []).append(i)
            self.arrivals[me] = ARRIVAL.get()
        if first:
            self._meet.wait(10)
        return self._copy(i)

    def chunks(self) -> list[int]:
        return sorted(i for done in self.by_thread.values() for i in done)

    def helped(self) -> int:
        """Chunks copied by threads other than the caller's."""
        return sum(len(done) for tid, done in self.by_thread.items() if tid != threading.get_ident())
