"""KV events from the real daemon's PUB endpoint, decoded with vLLM's own classes: a
subscriber that replays from seq 0 holds exactly what each tier holds, after a randomized run of
stores, evictions, promotions and clears; a stalled subscriber slows no STORE and catches up
through replay; KV_EVENTS hands a connector its models' chunks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mp.cli.status_text import render_status
from lmcache_mp.kv_events.log import CLEARED, REMOVED, STORED, EventsReply, external_hash
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType, StatusReport
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import count_lookup, fmt, status, store, wait_for, wait_for_status
from tests.support.kv_event_subscriber import Subscriber

CHUNK_ARGS = ("--chunk-size", "32")
# ~13 chunks of 16 KiB in the pool, ~15 on disk: the random run evicts from both.
SMALL = ("--l1-size-gb", "0.0002")
DISK_GB = "0.0003"


def events_args(tmp: Path) -> tuple[str, ...]:
    return ("--kv-events-listen", f"ipc://{tmp / 'kv-events.sock'}")


def published_all(report: StatusReport) -> bool:
    """Every record the log holds is out (the disk's writes and any resync done first)."""
    queued = sum(t.write_queue_chunks for t in report.tiers)
    return (queued == 0 and not report.kv_events_resyncing
            and report.kv_events_published_total == report.kv_events_seq)


def subscribe(report: StatusReport) -> Subscriber:
    pub, replay = report.kv_events_endpoints
    return Subscriber(pub, replay)


def random_run(client: MessageQueueClient, instance_id: int, rng: random.Random, steps: int,
               url: str) -> list[list[bytes]]:
    """Stores of new chains and of chains extended, lookups (promoting from disk), clears; the
    chains stored. Each store's disk writes are waited for: a busy machine's writer would
    otherwise skip most (its queue full), and the disk would never evict."""
    chains: list[list[bytes]] = []
    for step in range(steps):
        roll = rng.random()
        if roll < 0.6 or not chains:
            base = rng.choice(chains) if chains and rng.random() < 0.5 else []
            chain = base + [rng.randbytes(32) for _ in range(rng.randint(1, 4))]
            store(client, instance_id, chain, f"r{step}")
            chains.append(chain)
            wait_for_status(url, lambda r: r.tiers[0].write_queue_chunks == 0, "disk writes done")
        elif roll < 0.9:
            count_lookup(client, rng.choice(chains))
        elif roll < 0.97:
            client.submit(RequestType.CLEAR, []).result(10)
        else:
            client.submit(RequestType.CLEAR_TIERS, []).result(10)
    return chains


def replayed(daemon: DaemonProcess) -> tuple[StatusReport, dict]:
    """STATUS once every event is out, and what a subscriber replaying from 0 holds."""
    report = wait_for_status(daemon.url, published_all, "every event published")
    subscriber = subscribe(report)
    try:
        assert subscriber.replay(0) > 0
        assert subscriber.holdings.gaps == 0
        return report, subscriber.holdings.held
    finally:
        subscriber.close()


def test_a_replay_from_zero_holds_exactly_what_each_tier_holds(daemons, short_tmp: Path, worker_for) -> None:
    disk = short_tmp / "disk"
    disk_url = f"disk://{disk}?size_gb={DISK_GB}"
    args = (*CHUNK_ARGS, *SMALL, "--l2", disk_url, *events_args(short_tmp))
    daemon: DaemonProcess = daemons(*args)
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    seed = int.from_bytes(os.urandom(4), "big")
    cpu, on_disk = ("CPU", None), ("STORAGE", f"disk://{disk}")
    fingerprint = fmt().fingerprint.hex()
    try:
        chains = random_run(client, worker.instance_id, random.Random(seed), 120, daemon.url)
        report, held = replayed(daemon)
        assert report.tiers[0].evictions_total, f"seed {seed}: the disk evicted nothing"
        assert set(held) <= {cpu, on_disk}
        assert len(held[cpu]) == report.objects, f"seed {seed}"
        files = len(list(disk.glob("??/*.kv")))
        assert len(held[on_disk]) == report.tiers[0].objects == files, f"seed {seed}"
        # LOOKUP agrees chunk by chunk: what the pool holds hits at once, what no tier holds
        # misses, and what only the disk holds hits by promotion (asked last: it evicts).
        hashes = {h for chain in chains for h in chain}
        where = {h: {w for w in (cpu, on_disk) if (external_hash(h), fingerprint) in held[w]} for h in hashes}
        for h in sorted(hashes, key=lambda h: cpu not in where[h]):
            assert count_lookup(client, [h]) == int(bool(where[h])), f"seed {seed}: {where[h]}"
        store(client, worker.instance_id, [os.urandom(32), os.urandom(32)], "last")  # for the restart
        wait_for_status(daemon.url, lambda r: r.tiers[0].write_queue_chunks == 0, "disk writes done")
    finally:
        client.close()
    # The next daemon (warm restart, same disk): its stream starts from nothing and announces
    # what it adopted (once verified) and the disk's files (their keys read from their headers).
    assert daemon.stop(keep_pool=True) == 0
    again: DaemonProcess = daemons(*args)
    wait_for_status(again.url, lambda r: r.pool_unverified == 0, "adopted chunks verified")
    report, held = replayed(again)
    assert len(held[cpu]) == report.objects > 0
    assert len(held[on_disk]) == report.tiers[0].objects > 0


def test_the_pool_events_name_the_chunk_by_its_hash_and_its_parent(daemons, short_tmp: Path,
                                                                    worker_for) -> None:
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.05", *events_args(short_tmp))
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    try:
        chain = [os.urandom(32) for _ in range(3)]
        store(client, worker.instance_id, chain, "r")
        report = wait_for_status(daemon.url, published_all, "every event published")
        subscriber = subscribe(report)
        try:
            subscriber.replay(0)
            assert subscriber.holdings.held[("CPU", None)] == {(external_hash(h), fmt().fingerprint.hex())
                                                               for h in chain}
        finally:
            subscriber.close()
        # What a connector asks for: its model's chunks, each with its parent, from a seq on.
        reply: EventsReply = client.submit(RequestType.KV_EVENTS, [0, ["m"], 100]).result(10)
        assert reply.epoch == status(daemon.url).epoch and not reply.missed
        stored = [e for e in reply.events if e.kind == STORED]
        assert [(e.chunk_hash, e.parent_hash, e.medium, e.model_name) for e in stored] == [
            (chain[0], None, "CPU", "m"), (chain[1], chain[0], "CPU", "m"), (chain[2], chain[1], "CPU", "m")]
        assert reply.events[0].kind == CLEARED  # the stream starts from nothing
        other: EventsReply = client.submit(RequestType.KV_EVENTS, [0, ["another model"], 100]).result(10)
        assert [e.kind for e in other.events] == [CLEARED]
        # CLEAR leaves pinned chunks, and the pool file's sealer pins each new chunk while it
        # checksums it (at nice 19: a while on a busy machine).
        wait_for_status(daemon.url, lambda r: r.pool_unsealed == 0, "every chunk sealed")
        client.submit(RequestType.CLEAR, []).result(10)
        after: EventsReply = client.submit(RequestType.KV_EVENTS, [reply.next_seq, ["m"], 100]).result(10)
        assert {e.chunk_hash for e in after.events if e.kind == REMOVED} == set(chain)
        assert CLEARED in [e.kind for e in after.events]
        now: EventsReply = client.submit(RequestType.KV_EVENTS, [-1, ["m"], 100]).result(10)
        assert now.events == [] and now.next_seq == after.next_seq
        report = wait_for_status(daemon.url, published_all, "the clear published")
        assert f"kv events published on {report.kv_events_endpoints[0]}" in render_status(daemon.url, report)
        # What an operator sees of it: `lmcache-mp kv-events`, one JSON line per event.
        out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "kv-events", "--url", daemon.url,
                              "--from-start", "--count", "4"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [line["type"] for line in lines] == ["AllBlocksCleared"] + ["BlockStored"] * 3
        assert [line["block_hashes"] for line in lines[1:]] == [[external_hash(h)] for h in chain]
        assert {line["medium"] for line in lines[1:]} == {"CPU"} and lines[1]["model_name"] == "m"
    finally:
        client.close()


def test_a_stalled_subscriber_slows_no_store_and_catches_up_by_replay(daemons, short_tmp: Path,
                                                                      worker_for) -> None:
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.05", *events_args(short_tmp))
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    report = status(daemon.url)
    stalled = Subscriber(*report.kv_events_endpoints, rcvhwm=1)  # never reads
    live = subscribe(report)
    try:
        chains = [[os.urandom(32) for _ in range(4)] for _ in range(60)]
        for i, chain in enumerate(chains):
            store(client, worker.instance_id, chain, f"r{i}")
            live.poll(0)
        report = wait_for_status(daemon.url, published_all, "every event published")
        assert report.kv_events_dropped_total == 0
        # Every STORE was answered while the stalled subscriber read nothing (past its buffers
        # ZeroMQ drops a slow subscriber's messages, never blocking the daemon). Whatever of the
        # live stream it still gets, replay fills in the rest.
        stalled.poll(0.2)
        stalled.replay(stalled.holdings.next_seq)
        expected = {(external_hash(h), fmt().fingerprint.hex()) for chain in chains for h in chain}
        assert stalled.holdings.held[("CPU", None)] == expected
        # A subscriber that joined late: replay from 0, then the live stream goes on.
        live.replay(0)
        assert live.holdings.held[("CPU", None)] == expected
        client.submit(RequestType.CLEAR, []).result(10)
        wait_for_status(daemon.url, published_all, "the clear published")
        for _ in range(50):
            if not live.poll(0.2) and not live.holdings.held[("CPU", None)]:
                break
        assert not live.holdings.held[("CPU", None)]
    finally:
        stalled.close()
        live.close()
        client.close()


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_the_events_endpoint_follows_the_listen_rules(daemons, short_tmp: Path, where: str) -> None:
    """tcp:// needs CURVE or --allow-unauthenticated-tcp, as --listen does; ipc:// is 0600."""
    from lmcache_mp.config import ServerConfig

    if where == "tcp":
        config = ServerConfig(listen=[f"ipc://{short_tmp / 'd.sock'}"], kv_events_listen="tcp://127.0.0.1:5599")
        with pytest.raises(ValueError, match="without authentication"):
            config.validate()
        return
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.05", *events_args(short_tmp))
    pub, replay = status(daemon.url).kv_events_endpoints
    for url in (pub, replay):
        assert os.stat(url.removeprefix("ipc://")).st_mode & 0o777 == 0o600


def test_the_connector_follows_its_chunks_through_clears_and_restarts(daemons, short_tmp: Path,
                                                                       worker_for) -> None:
    """`vllm_adapter.kv_events.EngineEvents`, the connector's follower, against the real daemon:
    vLLM's BlockStored for the chunks it tracks once the daemon holds them (others' chunks left
    out), BlockRemoved at a CLEAR, and after a warm restart the removal of everything, then the
    adopted chunks announced again."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from vllm_adapter.kv_events import EngineEvents

    args = (*CHUNK_ARGS, "--l1-size-gb", "0.05")
    daemon: DaemonProcess = daemons(*args)
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    follower = EngineEvents(block_size=16)
    blocks = [[os.urandom(32), os.urandom(32)] for _ in range(3)]  # 2 vLLM blocks per chunk
    chunks = [pair[-1] for pair in blocks]  # a chunk's key: its last block's hash
    for i, pair in enumerate(blocks):
        follower.track("m", 0, chunks[i], pair, blocks[i - 1][-1] if i else None, list(range(32)))
    seen: list = []

    def until(what: str, done) -> None:
        wait_for(lambda: (seen.extend(follower.take(client)), done())[1], what)

    quiet = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "kv-events", "--url", daemon.url],
                           capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 1 and "publishes no KV events" in quiet.stderr
    try:
        store(client, worker.instance_id, [*chunks, os.urandom(32)], "r")  # and one untracked
        until("3 stored", lambda: len(seen) >= 3)
        assert [type(e) for e in seen] == [BlockStored] * 3
        # As vLLM publishes block hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
        assert [e.block_hashes for e in seen] == [[external_hash(h) for h in pair] for pair in blocks]
        assert [e.parent_block_hash for e in seen] == [None, *(external_hash(p[-1]) for p in blocks[:2])]
        assert {e.medium for e in seen} == {"CPU"} and {e.block_size for e in seen} == {16}
        wait_for_status(daemon.url, lambda r: r.pool_unsealed == 0, "every chunk sealed")  # unpinned
        client.submit(RequestType.CLEAR, []).result(10)
        until("3 removed", lambda: len(seen) >= 6)
        assert [type(e) for e in seen[3:]] == [BlockRemoved] * 3
        store(client, worker.instance_id, chunks, "again")
        until("stored again", lambda: len(seen) >= 9)
    finally:
        client.close()
    assert daemon.stop(keep_pool=True) == 0
    again: DaemonProcess = daemons(*args)
    client = MessageQueueClient(again.url, request_timeout_s=30)
    client.handshake("tests")
    try:
        until("removed, then adopted and announced again", lambda: len(seen) >= 15)
        assert [type(e) for e in seen[9:]] == [BlockRemoved] * 3 + [BlockStored] * 3
    finally:
        client.close()


def test_a_disk_file_lost_or_damaged_is_removed_from_the_stream(daemons, short_tmp: Path,
                                                                 worker_for) -> None:
    """The disk tier's removals that no eviction makes: a file deleted behind the daemon's back,
    and one damaged, both found by the LOOKUP that tries to promote them."""
    from lmcache_mp.chunks import ChunkKey
    from lmcache_mp.storage.tiers.disk import object_name

    disk = short_tmp / "disk"
    daemon: DaemonProcess = daemons(*CHUNK_ARGS, "--l1-size-gb", "0.05", "--l2", f"disk://{disk}?size_gb=0.01",
                                    *events_args(short_tmp))
    worker = worker_for(daemon.url)
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    client.handshake("tests")
    lost, damaged = os.urandom(32), os.urandom(32)
    try:
        store(client, worker.instance_id, [lost], "a")
        store(client, worker.instance_id, [damaged], "b")
        wait_for_status(daemon.url, lambda r: r.tiers[0].objects == 2, "both written to disk")
        # A LOOKUP must now read them from disk. CLEAR leaves pinned chunks (the pool file's sealer
        # pins each new chunk while it checksums it, the disk writer while it writes): clear again.
        def cleared() -> bool:
            client.submit(RequestType.CLEAR, []).result(10)
            return status(daemon.url).objects == 0

        wait_for(cleared, "both chunks out of the pool")
        files = {h: disk / object_name(ChunkKey(h, fmt()))[:2] / f"{object_name(ChunkKey(h, fmt()))}.kv"
                 for h in (lost, damaged)}
        files[lost].unlink()
        with open(files[damaged], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        assert count_lookup(client, [lost]) == 0 and count_lookup(client, [damaged]) == 0
        report, held = replayed(daemon)
        assert report.tiers[0].objects == 0 and report.tiers[0].corrupt_total == 1
        assert not held[("STORAGE", f"disk://{disk}")] and not held[("CPU", None)]
    finally:
        client.close()
