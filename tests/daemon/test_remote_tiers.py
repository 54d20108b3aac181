"""Tiers behind a network, real servers only: Valkey/Redis (standalone and a 3-master
cluster) and the v1 remote server. KV shared between daemons byte for byte, damaged values
rejected, and a server or node that dies turns into misses and skipped writes, never errors."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import redis
import torch

from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.storage.chunk_format import header_size_of
from lmcache_mp.storage.tiers.v1 import _key_string
from lmcache_mp.testing.blocks import CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.testing.probes import scrape
from lmcache_mp.testing.servers import (
    RedisServer,
    ServerProcess,
    free_port,
    redis_cluster,
    redis_cluster_url,
    redis_server,
    redis_url,
    start_v1_server,
)
from tests.support.helpers import count_lookup, fmt, needs_redis, status, store
from tests.support.tier_helpers import (
    beside,
    chunks,
    empties,
    retrieve_into,
    round_trip,
    tier_daemon_args,
    wait_shared,
    wait_until,
)

pytestmark = needs_redis
PASSWORD = "s3cret-pw"


@contextmanager
def v1_server(tmp: Path, port: int = 0) -> Iterator[ServerProcess]:
    server = start_v1_server(tmp, "--listen", f"tcp://127.0.0.1:{port}")
    try:
        yield server
    finally:
        server.stop()


# ---- one tier, three kinds of server --------------------------------------------------------------

Server = Callable[[Path], AbstractContextManager[str]]  # a running server, as a tier URL


@contextmanager
def v1(tmp: Path) -> Iterator[str]:
    with v1_server(tmp) as server:
        yield f"lmcache://127.0.0.1:{server.port}"


SERVERS = [pytest.param(redis_url, id="redis"), pytest.param(redis_cluster_url, id="redis-cluster"),
           pytest.param(v1, id="v1")]


@pytest.mark.parametrize("server", SERVERS)
def test_round_trip_is_byte_exact_and_pipelined(server: Server, tmp_path: Path, tier_at) -> None:
    with server(tmp_path) as url:
        tier = tier_at(url)
        round_trip(tier)
        s = tier.stats()
        assert (s.up, s.hits_total, s.misses_total, s.writes_total, s.errors_total) == (1, 20, 1, 20, 0)
        assert s.read_bytes_total == s.written_bytes_total == 20 * (64 << 10)
        assert s.read_latency_p50_ms > 0 and s.write_latency_p99_ms >= s.write_latency_p50_ms > 0


@pytest.mark.parametrize("server", SERVERS)
def test_clear_empties_only_its_own_namespace(server: Server, tmp_path: Path, tier_at) -> None:
    with server(tmp_path) as url:
        tier = tier_at(url)
        keys, data = chunks(30)
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 30
        if url.startswith("lmcache://"):
            with pytest.raises(NotImplementedError, match="no DELETE"):
                tier.clear()
            assert tier.batched_contains(keys) == [True] * 30
            return
        neighbour = tier_at(url + "?prefix=neighbour")  # another deployment on the same server
        assert neighbour.batched_put(list(zip(keys[:3], data[:3], strict=True))) == 3
        assert tier.clear() == 30
        assert tier.batched_contains(keys) == [False] * 30
        assert neighbour.batched_contains(keys[:3]) == [True] * 3
        assert tier.batched_put([(keys[0], data[0])]) == 1 and tier.stats().up == 1


def test_redis_keys_are_namespaced_and_damaged_values_are_misses_and_deleted(tmp_path: Path,
                                                                              tier_at) -> None:
    with redis_server(tmp_path) as server:
        ours = tier_at(f"redis://{server.address}/0?prefix=team-a")
        theirs = tier_at(f"redis://{server.address}/0?prefix=team-b")
        keys, data = chunks(3)
        ours.batched_put(list(zip(keys, data, strict=True)))
        assert theirs.batched_contains(keys) == [False] * 3  # another deployment's namespace
        names = sorted(server.cli("--scan", "--pattern", "team-a:*").split())
        assert len(names) == 3 and all(n.startswith(f"team-a:m:{fmt().fingerprint.hex()}:") for n in names)
        raw = redis.Redis(port=server.port)
        name = f"team-a:m:{fmt().fingerprint.hex()}:{keys[1].chunk_hash.hex()}"
        value = bytearray(raw.get(name))
        value[-1] ^= 0xFF  # one flipped bit in the payload
        raw.set(name, bytes(value))
        raw.set(f"team-a:m:{fmt().fingerprint.hex()}:{keys[2].chunk_hash.hex()}", b"junk")
        got = ours.batched_get(keys, empties(3))
        assert torch.equal(got[0], data[0]) and got[1] is None and got[2] is None
        assert ours.stats().corrupt_total == 2
        assert raw.exists(name) == 0  # removed, so write-behind stores a good copy again
        raw.close()


def test_v1_damaged_values_are_misses_until_rewritten(tmp_path: Path, tier_at) -> None:
    with v1_server(tmp_path) as server:
        tier = tier_at(f"lmcache://127.0.0.1:{server.port}")
        keys, data = chunks(2)
        tier.batched_put(list(zip(keys, data, strict=True)))
        assert tier.batched_contains(keys) == [True, True]  # the PUTs are in (one connection, in order)
        with server.client() as raw:  # foreign values under our keys: the right size, and not
            raw.put(_key_string(keys[0]), [bytes(header_size_of(keys[0]) + len(data[0]))])
            raw.put(_key_string(keys[1]), [b"short"])
            assert raw.health()  # answered after the PUTs before it (one connection, in order)
        assert tier.batched_get(keys, empties(2)) == [None, None]
        assert tier.stats().corrupt_total == 2
        # No DELETE in the protocol: the tier denies holding them, so write-behind rewrites them.
        assert tier.batched_contains(keys) == [False, False]
        tier.batched_put(list(zip(keys, data, strict=True)))
        assert tier.batched_contains(keys) == [True, True]
        got = tier.batched_get(keys, empties(2))
        assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))


def test_v1_tier_reconnects_after_the_server_closed_its_idle_connection(tmp_path: Path, tier_at) -> None:
    # The server closes connections idle for --idle-timeout-s. The tier's pooled connection died
    # that way during a quiet spell: the next batch failed on it (the tier went down) or, a PUT
    # having no reply, was lost silently.
    server = start_v1_server(tmp_path, "--idle-timeout-s", "1")
    try:
        tier = tier_at(f"lmcache://127.0.0.1:{server.port}?timeout_s=5")
        keys, data = chunks(2)
        assert tier.batched_put([(keys[0], data[0])]) == 1
        assert tier.batched_contains(keys[:1]) == [True]  # landed; the connection back in the pool
        wait_until(lambda: "idle for 1 s, closing the connection" in server.log())
        assert tier.batched_put([(keys[1], data[1])]) == 1
        got = tier.batched_get(keys, empties(2))
        assert all(g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=True))
        s = tier.stats()
        assert (s.up, s.errors_total, s.unavailable_total, s.write_errors_total) == (1, 0, 0, 0), s
        assert (s.writes_total, s.hits_total, s.misses_total, s.corrupt_total) == (2, 2, 0, 0), s
    finally:
        assert server.stop() == 0, server.log()


def _restartable(kind: str, tmp: Path) -> tuple[str, Callable[[], None], Callable[[], None]]:
    """A URL, and how to kill and restart its server on the same port."""
    port = free_port()
    if kind == "redis":
        server = RedisServer(port, tmp / "redis").start()
        return f"redis://127.0.0.1:{port}/0?timeout_s=0.5", server.kill, server.start
    holder: list[ServerProcess] = [start_v1_server(tmp, "--listen", f"tcp://127.0.0.1:{port}")]
    return (f"lmcache://127.0.0.1:{port}?timeout_s=0.5", lambda: holder[0].stop(),
            lambda: holder.__setitem__(0, start_v1_server(tmp, "--listen", f"tcp://127.0.0.1:{port}")))


@pytest.mark.parametrize("kind", ["redis", "v1"])
def test_a_dead_server_is_misses_and_skipped_writes_then_comes_back(kind: str, tmp_path: Path,
                                                                     tier_at) -> None:
    url, kill, restart = _restartable(kind, tmp_path)
    try:
        tier = tier_at(url)
        keys, data = chunks(4)
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 4
        kill()
        started = time.monotonic()
        assert tier.batched_get(keys, empties(4)) == [None] * 4  # no exception
        assert tier.batched_contains(keys) == [False] * 4
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 0
        assert time.monotonic() - started < 3  # down: answered at once, not a timeout per call
        s = tier.stats()
        assert s.up == 0 and s.errors_total >= 1 and s.unavailable_total >= 8
        restart()
        wait_until(lambda: tier.is_up)  # the background probe found it again
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 4
        got = tier.batched_get(keys, empties(4))
        assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
    finally:
        kill()


def test_a_tier_url_never_shows_its_password(tmp_path: Path, tier_at) -> None:
    with redis_server(tmp_path, "--requirepass", PASSWORD) as server:
        tier = tier_at(f"redis://:{PASSWORD}@{server.address}/0")
        keys, data = chunks(1)
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 1  # authenticated
        assert PASSWORD not in tier.stats().name and "***" in tier.stats().name
        wrong = tier_at(f"redis://:wrong-{PASSWORD}@{server.address}/0")
        assert wrong.batched_contains(keys) == [False] and wrong.stats().up == 0


# ---- daemons sharing one store ----------------------------------------------------------------------


@pytest.mark.parametrize("server", SERVERS)
def test_a_second_daemon_serves_what_only_the_first_stored(server: Server, tmp_path: Path, daemons,
                                                           worker_for) -> None:
    """Two nodes: separate daemons, pools and workers; one shared store between them."""
    tokens = list(range(4 * CHUNK))
    hashes = block_hashes(tokens)
    with server(tmp_path) as url:
        node_a = daemons(*tier_daemon_args(url))
        writer = worker_for(node_a.url)
        assert store(writer.mq_client, writer.instance_id, hashes[1::2], "s", first_block=0) == \
            [ChunkOutcome.STORED] * 4
        wait_shared(node_a.url, 4)
        node_b = daemons(*tier_daemon_args(url), url=beside(node_a, "node-b"))  # another machine
        assert status(node_b.url).objects == 0
        got = retrieve_into(node_b, hashes, tmp_path / "pages.pt")
        assert got["hit"] == 4 * CHUNK and got["failed"] == []
        stored = pages(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1), "CPU_ATTN", SHAPE, list(range(8)))
        assert torch.equal(got["pages"].view(torch.uint8), stored.view(torch.uint8))
        (t,) = status(node_b.url).tiers
        assert (t.promotions_total, t.hits_total, t.up, t.errors_total) == (4, 4, 1, 0)
        for node in (node_a, node_b):
            assert node.stop() == 0
            assert "Traceback" not in node.log(), node.log()


def _redis_name(chunk_hash: bytes) -> str:
    return f"lmcache-mp:m:{fmt().fingerprint.hex()}:{chunk_hash.hex()}"


def _holders(nodes: list[RedisServer], chunk_hashes: list[bytes]) -> list[int]:
    """For each chunk, the index of the cluster node that holds it."""
    return [next(i for i, n in enumerate(nodes) if n.cli("EXISTS", _redis_name(h)).strip() == "1")
            for h in chunk_hashes]


def test_a_dead_cluster_node_costs_only_its_own_chunks(tmp_path: Path, tier_at) -> None:
    with redis_cluster(tmp_path / "cluster") as nodes:
        tier = tier_at(f"redis+cluster://{nodes[0].address}?timeout_s=0.5")
        keys, data = chunks(24)
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 24
        holders = _holders(nodes, [k.chunk_hash for k in keys])
        assert len(set(holders)) == 3  # spread over every node (no hash tag)
        nodes[1].kill()
        for _ in range(3):  # the first batch finds the node dead; the next ones skip it at once
            got = tier.batched_get(keys, empties(24))
            assert [g is not None for g in got] == [h != 1 for h in holders]
            assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True) if g is not None)
            assert tier.is_up  # the tier serves the other nodes' chunks
        assert tier.batched_put(list(zip(keys, data, strict=True))) == holders.count(0) + holders.count(2)
        assert tier.stats().errors_total >= 1


def test_a_killed_cluster_node_is_misses_not_errors(tmp_path: Path, daemons, worker_for) -> None:
    with redis_cluster(tmp_path / "cluster") as nodes:
        url = f"redis+cluster://{nodes[0].address}?timeout_s=0.5"
        node_a = daemons(*tier_daemon_args(url))
        writer = worker_for(node_a.url)
        hashes = block_hashes(list(range(6 * CHUNK)))[1::2]
        store(writer.mq_client, writer.instance_id, hashes, "s1")
        wait_shared(node_a.url, 6)
        holders = _holders(nodes, hashes)
        dead = holders[-1]  # a node that holds some chunk
        nodes[dead].kill()
        node_b = daemons(*tier_daemon_args(url), url=beside(node_a, "node-b"))
        reader = worker_for(node_b.url)
        started = time.monotonic()
        # The prefix ends at the first chunk the dead node held; the chunks before it are hits.
        assert count_lookup(reader.mq_client, hashes) == holders.index(dead)
        assert time.monotonic() - started < 5
        fresh = block_hashes(list(range(10_000, 10_000 + 2 * CHUNK)))[1::2]
        assert store(reader.mq_client, reader.instance_id, fresh, "s3") == [ChunkOutcome.STORED] * 2
        wait_until(lambda: status(node_b.url).tiers[0].errors_total >= 1)
        (t,) = status(node_b.url).tiers
        assert t.up == 1 and t.unavailable_total >= 1
        for node in (node_a, node_b):
            assert node.stop() == 0
            log = node.log()
            assert "Traceback" not in log, log
        assert f"node {nodes[dead].address} failed" in node_b.log()


def test_the_daemon_never_shows_a_tier_password(tmp_path: Path, daemons) -> None:
    port = free_port()
    with redis_server(tmp_path, "--requirepass", PASSWORD) as server:
        daemon = daemons(*tier_daemon_args(f"redis://:{PASSWORD}@{server.address}/0"),
                         "--metrics-port", str(port))
        (t,) = status(daemon.url).tiers
        assert PASSWORD not in t.name and t.name == f"redis://:***@{server.address}/0"
        metrics = scrape(port)
        assert metrics[f'lmcache_mp_tier_up{{tier="{t.name}"}}'] == 1
        assert not [name for name in metrics if PASSWORD in name]
        assert daemon.stop() == 0
        assert PASSWORD not in daemon.log() and "***" in daemon.log()


def test_a_hung_server_times_out_into_misses(tmp_path: Path, tier_at) -> None:
    with redis_server(tmp_path) as server:
        tier = tier_at(f"redis://{server.address}/0?timeout_s=0.3")
        keys, data = chunks(2)
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 2
        server.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        try:
            started = time.monotonic()
            assert tier.batched_get(keys, empties(2)) == [None, None]
            assert time.monotonic() - started < 2  # one timeout (and one retry), not a hang
            assert not tier.is_up and tier.stats().errors_total == 1
        finally:
            server.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: tier.is_up)
        got = tier.batched_get(keys, empties(2))
        assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
