"""Real vLLM engines with LMCache's own connector (`"kv_connector": "LMCacheMPConnector"`, which vLLM
0.32 resolves to lmcache's `lmcache_mp_connector` when the lmcache package is installed) against our
daemon's lmcache door: in its `lmcache_driven` mode on CPU (caches in POSIX shared memory), and as
vLLM's `--kv-offloading-backend lmcache` sets it up, with nothing else set (its default on CPU:
`engine_driven`, through a staging segment of the daemon's). With vLLM's KV events on, the door's event
stream reaches vLLM's: the chunks engine 1 stored, in LMCache's own names, on engine 2's stream."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from lmcache_mp.testing.launcher import DaemonProcess, free_port, start_daemon
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import LMCACHE_MISSING, status
from tests.support.vllm_engines import (
    CHUNK,
    ENGINE_TIMEOUT_S,
    ENV,
    PROMPTS,
    cached,
    engine_spec,
    make_tiny_llama,
    run_engine,
    tokens,
    tracebacks,
    work_dir_fixture,  # noqa: F401 (a fixture)
)

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.v1.multiprocess.token_hasher import TokenHasher
from vllm.distributed.kv_events import BlockStored, KVEventBatch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3 * ENGINE_TIMEOUT_S + 60)]  # up to 3 engines each


@pytest.fixture(scope="module")
def model(work_dir: Path) -> Path:
    return make_tiny_llama(work_dir / "tiny-llama")


@pytest.fixture(scope="module")
def baseline(model: Path, work_dir: Path) -> list[dict[str, Any]]:
    """What an engine without a connector makes of the prompts."""
    return run_engine(engine_spec(model, None, [PROMPTS]), work_dir / "baseline.log")[0]


def _door_loads(metrics_port: int) -> float:
    """The loads the lmcache door has served (either mode's), answered or refused."""
    return sum(value for name, value in scrape(metrics_port).items()
               if name.startswith("lmcache_mp_lmcache_door_requests_total{")
               and ('op="retrieve"' in name or 'op="prepare_retrieve"' in name))


@contextmanager
def _following(pub: str) -> Iterator[list[Any]]:
    """A router's subscriber on an engine's KV event stream: every event published while the engine
    runs, read on a thread (in order of arrival; a router would also replay what it missed)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)  # before the engine binds it: nothing it publishes is missed
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[Any] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if sub.poll(100):
                events.extend(decoder.decode(sub.recv_multipart()[-1]).events)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield events
    finally:
        stop.set()
        reader.join(10)
        sub.close(linger=0)
        context.term()


def test_a_fresh_engine_hits_what_another_stored_through_lmcache_s_connector(
        work_dir: Path, model: Path, baseline: list[dict[str, Any]]) -> None:
    door, metrics_port = f"ipc://{work_dir / 'lmcache.sock'}", free_port()
    daemon = start_daemon(work_dir, "--lmcache-listen", door, "--chunk-size", str(CHUNK),
                          "--l1-size-gb", "0.05", "--metrics-port", str(metrics_port))
    env = dict(ENV, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="0")  # LMCache's names as they are: bytes

    def spec_publishing_on(pub: str) -> dict[str, Any]:
        spec = engine_spec(model, None, [PROMPTS], kv_events={"enable_kv_cache_events": True,
                                                               "publisher": "zmq", "endpoint": pub})
        spec["connector"] = {"lmcache.mp.server_urls": door, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
        spec["kv_connector"] = "LMCacheMPConnector"
        return spec

    try:
        pub1, pub2 = f"ipc://{work_dir / 'events-1'}", f"ipc://{work_dir / 'events-2'}"
        first = run_engine(spec_publishing_on(pub1), work_dir / "first.log", env)[0]
        stored, loads_of_first = status(daemon.url).objects, _door_loads(metrics_port)
        with _following(pub2) as events:
            second = run_engine(spec_publishing_on(pub2), work_dir / "second.log", env)[0]
        for name in ("first", "second"):
            log = (work_dir / f"{name}.log").read_text(errors="replace")
            assert not tracebacks(log), log[-6000:]
            assert "lmcache_mp_connector" in log or "LMCache" in log, "not LMCache's own connector"
            assert "does not advertise" not in log and "Disabling server KV event" not in log, log[-6000:]
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()
    # A fresh daemon has nothing to load: engine 1 hits only its own prefix cache. (Which of two prompts
    # with a common prefix hits the other's depends on the order its scheduler takes them in, which
    # the connector's asynchronous lookups change with the machine's load: not compared.)
    assert loads_of_first == 0
    assert stored > 0
    # Engine 2, fresh, loads every full chunk engine 1 stored of each prompt: 3 chunks of the first
    # two (they share 2), 1 of the third, none of the short one, and all 4 of the prompt of exactly 4
    # chunks, of which vLLM counts all but the last token (it computes that one again).
    assert cached(second) == [3 * CHUNK, 3 * CHUNK, CHUNK, 0, 4 * CHUNK - 1]
    assert tokens(second) == tokens(baseline) == tokens(first)
    # Engine 2's connector followed the door's event stream from its start: the chunks the pool holds,
    # each named by LMCache's own hasher, with its tokens, on vLLM's KV event stream (medium CPU).
    hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3")
    loaded = {h: tuple(p[i * CHUNK:(i + 1) * CHUNK]) for p, hit in zip(PROMPTS, cached(second), strict=True)
              for i, h in enumerate(hasher.compute_chunk_hashes(p)[:-(-hit // CHUNK)])}
    published = {h: tuple(e.token_ids) for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
                 for h in e.block_hashes}
    assert loaded and all(published.get(h) == chunk for h, chunk in loaded.items()), (loaded, published)


# Where vLLM's `--kv-offloading-backend lmcache` points LMCache's connector when nothing else is set.
DEFAULT_PORT = 5555


def _door_on_the_default_port(work_dir: Path, *more: str) -> tuple[DaemonProcess, dict[str, Any]]:
    """A daemon (with `more` arguments) whose lmcache door listens where vLLM's default points, and the
    connector settings the engine then needs: none. If another process holds that port (a benchmark's
    `lmcache server`), a free port and the one setting that names it."""
    args = ("--allow-unauthenticated-tcp", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", *more)
    try:
        return start_daemon(work_dir, "--lmcache-listen", f"tcp://127.0.0.1:{DEFAULT_PORT}", *args), {}
    except RuntimeError as err:
        if "Address already in use" not in str(err):
            raise
    port = free_port()
    print(f"port {DEFAULT_PORT} is taken: the engine is pointed at port {port} (lmcache.mp.port)")
    daemon = start_daemon(work_dir, "--lmcache-listen", f"tcp://127.0.0.1:{port}", *args)
    return daemon, {"lmcache.mp.port": port}


def test_kv_offloading_backend_lmcache_hits_with_no_other_setting(
        work_dir: Path, model: Path, baseline: list[dict[str, Any]]) -> None:
    metrics_port = free_port()
    daemon, extra_config = _door_on_the_default_port(work_dir, "--metrics-port", str(metrics_port))
    try:
        spec = engine_spec(model, None, [PROMPTS],
                           kv_offloading={"backend": "lmcache", "size": 1, "extra_config": extra_config})
        first = run_engine(spec, work_dir / "offload-first.log")[0]
        stored, loads_of_first = status(daemon.url), _door_loads(metrics_port)
        second = run_engine(spec, work_dir / "offload-second.log")[0]
        logs = [(work_dir / f"offload-{n}.log").read_text(errors="replace") for n in ("first", "second")]
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()
    for log in logs:
        assert not tracebacks(log), log[-6000:]
        # LMCache's connector on CPU by default: engine_driven, through the daemon's staging segment.
        assert "engine-driven context registered" in log and "mode=SHM" in log, log[-6000:]
    assert stored.objects > 0 and "engine_driven: chunks of" in daemon.log()
    assert loads_of_first == 0  # a fresh daemon: nothing to load (as above)
    assert cached(second) == [3 * CHUNK, 3 * CHUNK, CHUNK, 0, 4 * CHUNK - 1]
    assert tokens(second) == tokens(baseline) == tokens(first)
