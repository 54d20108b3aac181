"""A model's KV reset (RESET_MODEL: what vLLM's `reset_prefix_cache(reset_connector=True)` asks for
after a weight update): every chunk of that model leaves the daemon, from the pool, the pool file
and every lower tier, and no other model's; nothing in flight across it brings one back. Real
daemons, real disk, Valkey/Redis and v1 servers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.kv_events.log import CLEARED, STORED
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ChunkOutcome, ModelReset, ModelScope, RequestType, TailHit, TailNote
from lmcache_mp.storage.tiers import disk_file
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.remote import NetworkTier
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.servers import redis_cluster_url, redis_url, start_v1_server
from tests.support.helpers import chunk_hashes, needs_redis, status, wait_for_status
from vllm_adapter import LMCacheMPWorkerAdapter

BLOCKS_PER_CHUNK = CHUNK // BLOCK
TOKENS_A = list(range(3 * CHUNK))
TOKENS_B = list(range(10**5, 10**5 + 3 * CHUNK))


def daemon_args(disk: Path) -> tuple[str, ...]:
    return "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--l2", f"disk://{disk}?size_gb=0.05"


@pytest.fixture
def workers() -> Iterator[Callable[..., LMCacheMPWorkerAdapter]]:
    """workers(url, model, seed=1): a worker of `model` registered with the daemon at `url`."""
    made: list[LMCacheMPWorkerAdapter] = []

    def make(url: str, model: str, seed: int = 1) -> LMCacheMPWorkerAdapter:
        worker = LMCacheMPWorkerAdapter(url, None, model, 1, 0, BLOCK)
        worker.register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=seed), "CPU_ATTN")
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def keys(model: str, hashes: list[bytes], request_id: str | None = None,
         worker_id: int | None = 0) -> list[IPCCacheEngineKey]:
    return [IPCCacheEngineKey(model, 1, worker_id, chunk_hash=h, request_id=request_id) for h in hashes]


def store(worker: LMCacheMPWorkerAdapter, model: str, hashes: list[bytes], first_block: int = 0,
          request_id: str = "s") -> list[ChunkOutcome]:
    blocks = list(range(first_block, first_block + len(hashes) * BLOCKS_PER_CHUNK))
    return worker.mq_client.submit(RequestType.STORE, [keys(model, hashes, request_id), worker.instance_id,
                                                       blocks, b""]).result(10).outcomes


def held(client: MessageQueueClient, model: str, hashes: list[bytes], request_id: str | None = None) -> int:
    """Leading chunks of `model` the daemon holds, in any tier (leased to `request_id`, if given)."""
    return client.submit(RequestType.LOOKUP_CHUNKS, [model, 1, request_id, hashes]).result(10)


def reset(client: MessageQueueClient, *models: str) -> ModelReset:
    return client.submit(RequestType.RESET_MODEL, [ModelScope(list(models))]).result(30)


def disk_models(root: Path) -> list[str]:
    """The model of every chunk file in a disk tier's directory, from its header."""
    models = []
    for path in root.glob("??/*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            models.append(disk_file.read_key(fd).fmt.model_name)
        finally:
            os.close(fd)
    return sorted(models)


def written(url: str, objects: int) -> None:
    """Wait until the disk tier holds `objects` and has nothing left to write."""
    wait_for_status(url, lambda r: r.tiers[0].objects == objects and r.tiers[0].write_queue_chunks == 0,
                    f"{objects} chunks on disk")


@contextmanager
def connected(url: str) -> Iterator[MessageQueueClient]:
    client = MessageQueueClient(url)
    try:
        yield client
    finally:
        client.close()


def test_a_reset_drops_one_models_chunks_from_the_pool_and_the_disk_and_no_other(
        daemons, workers, short_tmp: Path) -> None:
    disk = short_tmp / "disk"
    daemon: DaemonProcess = daemons(*daemon_args(disk))
    a, b = workers(daemon.url, "a"), workers(daemon.url, "b")
    ha, hb = chunk_hashes(TOKENS_A), chunk_hashes(TOKENS_B)
    with connected(daemon.url) as client:
        assert store(a, "a", ha) == store(b, "b", hb) == [ChunkOutcome.STORED] * 3
        written(daemon.url, 6)
        assert disk_models(disk) == ["a"] * 3 + ["b"] * 3
        tail = TailHit(5, 1, b"tail of a conversation")
        for model in ("a", "b"):
            client.submit(RequestType.NOTE_TAILS, [model, 1, [TailNote(ha[-1], tail)], []]).result(10)
        since = client.submit(RequestType.KV_EVENTS, [-1, ["a", "b"], 1]).result(10).next_seq
        resyncs = status(daemon.url).kv_events_resyncs_total

        result = reset(client, "a")
        assert result.ok, result
        assert (result.pool_chunks, result.tails, [t.removed for t in result.tiers]) == (3, 1, [3])
        assert held(client, "a", ha) == 0 and held(client, "b", hb) == 3
        assert disk_models(disk) == ["b"] * 3
        report = status(daemon.url)
        assert (report.objects, report.tiers[0].objects, report.tails_indexed) == (3, 3, 1)
        # Routers following the KV events see it: a resync (cleared, then what is held) without a.
        wait_for_status(daemon.url, lambda r: r.kv_events_resyncs_total > resyncs, "the resync finished")
        events = client.submit(RequestType.KV_EVENTS, [since, ["a", "b"], 1000]).result(10).events
        kinds = [e.kind for e in events]
        assert CLEARED in kinds
        after = events[len(kinds) - kinds[::-1].index(CLEARED):]
        assert {e.model_name for e in after if e.kind == STORED} == {"b"}
        assert {e.chunk_hash for e in after if e.kind == STORED} == set(hb)

        # b's copies on disk are intact: read back into an emptied pool. a's are nowhere.
        assert client.submit(RequestType.CLEAR, []).result(10) == 3
        assert held(client, "b", hb) == 3 and held(client, "a", ha) == 0
        # What a stores after the reset is stored and served as usual.
        assert store(a, "a", ha) == [ChunkOutcome.STORED] * 3
        assert held(client, "a", ha) == 3
        written(daemon.url, 6)
        # By hand: the command line.
        cleared = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "clear", "--model", "a", "--url",
                                  daemon.url], capture_output=True, text=True, timeout=60)
        assert cleared.returncode == 0, cleared.stderr
        assert "CPU pool: 3 chunks dropped" in cleared.stdout and "3 chunks removed" in cleared.stdout
        assert held(client, "a", ha) == 0 and held(client, "b", hb) == 3


def test_a_reset_outlives_a_restart_of_the_daemon(daemons, workers, short_tmp: Path) -> None:
    """Neither the pool file nor the disk tier brings a reset model's chunks back to the next daemon,
    those leased at the reset (still in the pool when the daemon stopped) included."""
    disk = short_tmp / "disk"
    first: DaemonProcess = daemons(*daemon_args(disk))
    ha, hb = chunk_hashes(TOKENS_A), chunk_hashes(TOKENS_B)
    assert store(workers(first.url, "a"), "a", ha) == [ChunkOutcome.STORED] * 3
    assert store(workers(first.url, "b"), "b", hb) == [ChunkOutcome.STORED] * 3
    written(first.url, 6)
    with connected(first.url) as client:
        assert held(client, "a", ha, request_id="r") == 3
        assert reset(client, "a").ok
    assert first.stop(keep_pool=True) == 0

    second: DaemonProcess = daemons(*daemon_args(disk), url=first.url)
    assert status(second.url).pool_adopted_chunks == 3
    for model in ("a", "b"):  # a LOOKUP counts only the models registered
        workers(second.url, model)
    with connected(second.url) as client:
        assert held(client, "a", ha) == 0 and held(client, "b", hb) == 3
        assert client.submit(RequestType.CLEAR, []).result(10) == 3  # b from the disk, then
        assert held(client, "a", ha) == 0 and held(client, "b", hb) == 3


def test_a_chunk_in_use_at_the_reset_is_never_served_again(daemons, workers, short_tmp: Path) -> None:
    """A chunk leased at the reset is out of sight at once (a RETRIEVE of it fails: vLLM recomputes)
    and freed once released; its key is free meanwhile for the new weights' KV, which is what is
    served then."""
    daemon: DaemonProcess = daemons(*daemon_args(short_tmp / "disk"))
    a = workers(daemon.url, "a")
    ha = chunk_hashes(TOKENS_A)[:2]
    blocks = 2 * BLOCKS_PER_CHUNK  # of the two chunks
    with connected(daemon.url) as client:
        assert store(a, "a", ha, first_block=0) == [ChunkOutcome.STORED] * 2
        assert held(client, "a", ha, request_id="old") == held(client, "a", ha, request_id="older") == 2
        assert status(daemon.url).leases == 4

        assert reset(client, "a").pool_chunks == 2
        assert held(client, "a", ha) == 0
        old = client.submit(RequestType.RETRIEVE, [keys("a", ha, "old"), a.instance_id,
                                                   list(range(4 * blocks, 5 * blocks)), b""]).result(10)
        assert not old.ok and "no longer stored" in old.reason
        # The new weights' KV of the same tokens, from other blocks, while "older" leases the old.
        assert store(a, "a", ha, first_block=blocks) == [ChunkOutcome.STORED] * 2
        assert status(daemon.url).leases == 2
        assert held(client, "a", ha, request_id="new") == 2
        target = list(range(2 * blocks, 3 * blocks))
        assert client.submit(RequestType.RETRIEVE, [keys("a", ha, "new"), a.instance_id, target, b""]
                             ).result(10).ok
        for layer in a.kv_caches.values():
            assert torch.equal(layer[2 * blocks:3 * blocks], layer[blocks:2 * blocks])
            assert not torch.equal(layer[2 * blocks:3 * blocks], layer[:blocks])
        used = status(daemon.url).pool_used_bytes  # the old chunks' slots too, until released
        client.submit(RequestType.END_SESSION, ["older"]).result(10)
        # Freed once nothing holds them (the disk tier's writer or the pool file's sealer may, briefly).
        report = wait_for_status(daemon.url, lambda r: r.leases == 0 and r.pool_used_bytes == used // 2,
                                 "the old chunks freed", timeout_s=30)
        assert report.objects == 2


def test_a_store_copying_across_the_reset_stores_nothing(daemons, workers, short_tmp: Path,
                                                         tmp_path: Path) -> None:
    """A STORE reserved before the reset and committed after it (held mid-copy at a gate:
    `tests/support/gated_daemon.py`) leaves nothing: not in the pool, not on disk."""
    disk = short_tmp / "disk"
    gated = [sys.executable, "-m", "tests.support.gated_daemon", str(tmp_path)]
    daemon: DaemonProcess = daemons(*daemon_args(disk), command_prefix=gated)
    a = workers(daemon.url, "a")
    ha = chunk_hashes(TOKENS_A)
    (tmp_path / "store").touch()
    try:
        copying = a.mq_client.submit(RequestType.STORE, [keys("a", ha, "s"), a.instance_id,
                                                          list(range(3 * BLOCKS_PER_CHUNK)), b""])
        wait_for_status(daemon.url, lambda r: r.transfers_running == 1, "the STORE copying", daemon=daemon)
        with connected(daemon.url) as client:
            result = reset(client, "a")  # answered while the STORE still copies
            assert result.ok and (result.pool_chunks, result.tiers[0].removed) == (0, 0)
            assert not copying.query()
            (tmp_path / "store").unlink()
            assert copying.result(10).outcomes == [ChunkOutcome.STORED] * 3  # as its worker sees it
            assert held(client, "a", ha) == 0
            report = wait_for_status(daemon.url, lambda r: r.tiers[0].write_queue_chunks == 0, "writes done")
            assert (report.objects, report.tiers[0].objects, disk_models(disk)) == (0, 0, [])
            # A STORE sent after the reset is stored.
            assert store(a, "a", ha, request_id="t") == [ChunkOutcome.STORED] * 3
            assert held(client, "a", ha) == 3
    finally:
        with contextlib.suppress(FileNotFoundError):
            (tmp_path / "store").unlink()


# ---- the network tiers, one at a time ---------------------------------------------------------------


def fmt(model: str) -> ChunkFormat:
    return ChunkFormat(model, 1, 0, "CPU_ATTN", "bfloat16", LAYERS, (2, BLOCK, 64), CHUNK)


@contextmanager
def v1(tmp: Path) -> Iterator[str]:
    server = start_v1_server(tmp, "--listen", "tcp://127.0.0.1:0")
    try:
        yield f"lmcache://127.0.0.1:{server.port}"
    finally:
        server.stop()


@pytest.mark.parametrize("server", [pytest.param(redis_url, id="redis", marks=needs_redis),
                                    pytest.param(redis_cluster_url, id="redis-cluster", marks=needs_redis),
                                    pytest.param(v1, id="v1")])
def test_a_network_tier_drops_a_models_chunks_and_no_other(
        server: Callable[[Path], AbstractContextManager[str]], tmp_path: Path) -> None:
    """Redis deletes them (a model whose name extends this one's with a colon is another model);
    a v1 server cannot (no DELETE): the tier then keys the model afresh, so that it never reads the
    old chunks again, and says it could not drop them."""
    with server(tmp_path) as url:
        tier = open_tier(url)
        assert isinstance(tier, NetworkTier)
        try:
            models = ("a", "a:b", "b*")
            chunks = {m: [ChunkKey(bytes([i]) * 32, fmt(m)) for i in range(4)] for m in models}
            data = torch.arange(64 << 10, dtype=torch.int32).to(torch.uint8)
            assert tier.batched_put([(k, data) for m in models for k in chunks[m]]) == 12
            if url.startswith("lmcache://"):
                with pytest.raises(NotImplementedError, match="no DELETE"):
                    tier.drop_models({"a"})
            else:
                assert tier.drop_models({"a"}) == 4
            assert tier.batched_contains(chunks["a"]) == [False] * 4
            assert tier.batched_contains(chunks["a:b"] + chunks["b*"]) == [True] * 8
            assert tier.batched_put([(chunks["a"][0], data)]) == 1  # the new weights' KV
            got = tier.batched_get(chunks["a"], [torch.empty_like(data) for _ in range(4)])
            assert torch.equal(got[0], data) and got[1:] == [None] * 3
        finally:
            tier.close()
