"""The Mooncake Store tier against a real store: `mooncake_master` with its HTTP metadata service
and one storage node (`mooncake_client`) on loopback, real daemons as processes. Byte-exact round
trips keyed by model, writes straight from registered memory, damaged values as misses, restarts,
two daemons sharing a store, a master killed and restarted under load, an unreachable master at
start, and a missing extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.testing.blocks import CHUNK, block_hashes
from lmcache_mp.testing.servers import MOONCAKE_MASTER, MOONCAKE_NODE, MooncakeStore, free_port
from tests.support.helpers import count_lookup, fmt, status, store
from tests.support.tier_helpers import (
    beside,
    check_down_at_start,
    check_refused_at_start,
    check_restart_survival,
    check_two_daemons_share,
    chunks,
    drop_and_clear,
    empties,
    round_trip,
    tier_daemon_args,
    wait_shared,
    wait_until,
)

pytestmark = pytest.mark.skipif(
    None in (MOONCAKE_MASTER, MOONCAKE_NODE) or importlib.util.find_spec("mooncake") is None,
    reason="the [mooncake] extra is not installed (scripts/setup.sh test installs it)")


@pytest.fixture
def mooncake() -> Iterator[MooncakeStore]:
    cluster = MooncakeStore()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def object_name(prefix: str, chunk_hash: bytes, model: str = "m") -> str:
    return f"{prefix}/{model}/{fmt(model=model).fingerprint.hex()}/{chunk_hash.hex()}"


# ---- the tier ----------------------------------------------------------------------------------------


def test_round_trip_is_byte_exact_and_keys_are_namespaced(mooncake: MooncakeStore, tier_at) -> None:
    tier = tier_at(mooncake.url("team-a"))
    keys, data = round_trip(tier)
    client = mooncake.client()
    try:
        assert client.batch_is_exist([object_name("team-a", k.chunk_hash) for k in keys]) == [1] * 20
    finally:
        client.close()
    s = tier.stats()
    assert (s.up, s.hits_total, s.misses_total, s.writes_total, s.errors_total) == (1, 20, 1, 20, 0)
    assert s.read_bytes_total == s.written_bytes_total == 20 * (64 << 10)
    assert s.name == mooncake.url("team-a")
    drop_and_clear(tier, tier_at(mooncake.url("team-b")), keys, data)


def test_writes_from_the_shared_memory_go_straight_from_it(mooncake: MooncakeStore, tier_at) -> None:
    """With register_pool, the pool's memory, once shared, is registered: a chunk in it is sent from
    where it is, and read back into another slot byte for byte."""
    tier = tier_at(mooncake.url("direct", register_pool="true"))
    memory = torch.zeros(4 << 20, dtype=torch.uint8)
    tier.share_memory(memory)
    keys, data = chunks(8)
    for i, chunk in enumerate(data):
        memory[i * (64 << 10):(i + 1) * (64 << 10)] = chunk
    slots = [memory[i * (64 << 10):(i + 1) * (64 << 10)] for i in range(8)]
    assert tier.batched_put(list(zip(keys, slots, strict=True))) == 8
    outs = [memory[(32 + i) * (64 << 10):(33 + i) * (64 << 10)] for i in range(8)]
    got = tier.batched_get(keys, outs)
    assert all(g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=True))


def test_a_dead_master_costs_misses_within_the_deadline(mooncake: MooncakeStore, tier_at) -> None:
    tier = tier_at(mooncake.url("outage", timeout_s="0.5"))
    keys, data = chunks(8)
    assert tier.batched_put(list(zip(keys, data, strict=True))) == 8
    mooncake.kill_master()  # the client would wait ~4 s per call for it
    started = time.monotonic()
    assert tier.batched_get(keys, empties(8)) == [None] * 8
    assert time.monotonic() - started < 2
    assert not tier.is_up
    started = time.monotonic()
    assert tier.batched_put(list(zip(keys, data, strict=True))) == 0  # down: at once
    assert time.monotonic() - started < 0.5
    mooncake.start_master()
    mooncake.wait_ready()
    wait_until(lambda: tier.is_up)
    # A restarted master knows no object written before (no HA): misses, then hits once rewritten.
    assert tier.batched_get(keys, empties(8)) == [None] * 8
    assert tier.batched_put(list(zip(keys, data, strict=True))) == 8
    got = tier.batched_get(keys, empties(8))
    assert all(g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=True))


# ---- daemons ------------------------------------------------------------------------------------------


def test_chunks_survive_a_daemon_restart_with_an_empty_pool(mooncake: MooncakeStore, daemons, worker_for,
                                                            short_tmp: Path) -> None:
    check_restart_survival(daemons, worker_for, mooncake.url("restart"), {}, short_tmp / "pages.pt")


def test_two_daemons_share_one_store(mooncake: MooncakeStore, daemons, worker_for) -> None:
    check_two_daemons_share(daemons, worker_for, mooncake.url("fleet"), {})


def _damage(mooncake: MooncakeStore, name: str, change: Callable[[bytearray], bytes]) -> None:
    client = mooncake.client()
    try:
        value = change(bytearray(client.get(name)))
        assert client.remove(name, True) == 0
        assert client.put(name, value) == 0
    finally:
        client.close()


def test_damaged_values_are_misses_never_wrong_bytes(mooncake: MooncakeStore, daemons, worker_for) -> None:
    url = mooncake.url("damaged")
    writer_node = daemons(*tier_daemon_args(url))
    writer = worker_for(writer_node.url)
    flipped_prompt = block_hashes(list(range(2 * CHUNK)))[1::2]
    truncated_prompt = block_hashes(list(range(7000, 7000 + 2 * CHUNK)))[1::2]
    store(writer.mq_client, writer.instance_id, flipped_prompt, "p")
    store(writer.mq_client, writer.instance_id, truncated_prompt, "q")
    wait_shared(writer_node.url, 4)

    def flip(value: bytearray) -> bytes:
        value[-100] ^= 0x01  # one bit of the payload
        return bytes(value)

    flipped = object_name("damaged", flipped_prompt[1])
    truncated = object_name("damaged", truncated_prompt[1])
    _damage(mooncake, flipped, flip)
    _damage(mooncake, truncated, lambda value: bytes(value[:len(value) // 2]))

    reader_node = daemons(*tier_daemon_args(url), url=beside(writer_node, "reader"))
    reader = worker_for(reader_node.url)
    assert count_lookup(reader.mq_client, flipped_prompt) == 1  # the intact first chunk only
    assert count_lookup(reader.mq_client, truncated_prompt) == 1
    (t,) = status(reader_node.url).tiers
    assert (t.corrupt_total, t.hits_total, t.promotions_total) == (2, 2, 2)
    client = mooncake.client()
    try:  # the damaged ones were removed, the intact ones kept
        intact = [object_name("damaged", h) for h in (flipped_prompt[0], truncated_prompt[0])]
        assert client.batch_is_exist([flipped, truncated, *intact]) == [0, 0, 1, 1]
    finally:
        client.close()


def test_a_master_stopped_and_started_under_load_costs_misses_then_hits(mooncake: MooncakeStore, daemons,
                                                                         worker_for) -> None:
    url = mooncake.url("outage", timeout_s="0.5")
    node_a = daemons(*tier_daemon_args(url))
    writer = worker_for(node_a.url)
    hashes = block_hashes(list(range(8 * CHUNK)))[1::2]
    assert store(writer.mq_client, writer.instance_id, hashes, "s0") == [ChunkOutcome.STORED] * 8
    wait_shared(node_a.url, 8)
    node_b = daemons(*tier_daemon_args(url), url=beside(node_a, "node-b"))
    reader = worker_for(node_b.url)
    assert count_lookup(reader.mq_client, hashes[:2]) == 2

    mooncake.kill_master()
    for i in range(1, 6):  # node A keeps storing: answered at once, its writes to the store skipped
        fresh = block_hashes(list(range(i * 10_000, i * 10_000 + 2 * CHUNK)))[1::2]
        started = time.monotonic()
        assert store(writer.mq_client, writer.instance_id, fresh, f"s{i}") == [ChunkOutcome.STORED] * 2
        assert time.monotonic() - started < 5
        started = time.monotonic()
        assert count_lookup(reader.mq_client, hashes) == 2  # its pool's two; misses, not a stall
        assert time.monotonic() - started < 5
    wait_until(lambda: status(node_a.url).tiers[0].unavailable_total >= 1)
    assert status(node_b.url).tiers[0].up == 0

    mooncake.start_master()  # the same ports; it knows no object written before
    mooncake.wait_ready()
    wait_until(lambda: all(status(n.url).tiers[0].up == 1 for n in (node_a, node_b)))
    again = block_hashes(list(range(90_000, 90_000 + 4 * CHUNK)))[1::2]
    written = status(node_a.url).tiers[0].writes_total
    assert store(writer.mq_client, writer.instance_id, again, "s6") == [ChunkOutcome.STORED] * 4
    wait_until(lambda: status(node_a.url).tiers[0].writes_total == written + 4)
    assert count_lookup(reader.mq_client, again) == 4  # hits again, through the store
    (t,) = status(node_b.url).tiers
    assert (t.promotions_total, t.corrupt_total) == (6, 0)
    for node in (node_a, node_b):
        assert node.stop() == 0
        assert "Traceback" not in node.log(), node.log()


def test_an_unreachable_master_is_one_clear_error_and_the_daemon_serves(mooncake: MooncakeStore, daemons,
                                                                        worker_for) -> None:
    url = mooncake.url("nowhere").replace(mooncake.master_address, f"127.0.0.1:{free_port()}")
    said, _ = check_down_at_start(daemons, worker_for, url, "no master answers at")
    assert "mooncake_master" in said


def test_a_bad_url_or_a_missing_extra_is_one_clear_error_at_start(short_tmp: Path) -> None:
    without_mooncake = ("-c", "import sys; sys.modules['mooncake'] = None; "
                              "from lmcache_mp.cli.main import main; sys.exit(main(sys.argv[1:]))")
    check_refused_at_start(short_tmp, [
        ("mooncake://127.0.0.1:9", without_mooncake, "needs the [mooncake] extra"),
        ("mooncake://127.0.0.1:9?password=x", ("-m", "lmcache_mp.cli"), "unknown parameter"),
        ("mooncake://127.0.0.1", ("-m", "lmcache_mp.cli"), "port is missing"),
        ("mooncake://127.0.0.1:9?protocol=udp", ("-m", "lmcache_mp.cli"), "tcp or rdma"),
        ("mooncake://127.0.0.1:9?register_pool=maybe", ("-m", "lmcache_mp.cli"), "true or false")])


def test_the_base_daemon_does_not_import_mooncake() -> None:
    code = "import sys, lmcache_mp.storage.manager, lmcache_mp.cli.main; print('mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr

