"""LMCache's `engine_driven` mode (its default on CPU) through the lmcache door: LMCache's OWN worker-side
transfer context (`EngineDrivenTransferContext`: its registration, its gathers and scatters of vLLM's
paged KV, its prepare/commit requests) against the real daemon, which hands it a staging segment of
its own registration's, never the pool, and never loads a pickle."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import LMCACHE_MISSING, status, wait_for_status

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.transfer_context.shm import EngineDrivenContextShm
from lmcache.v1.multiprocess.transfer_context.worker_transfer import EngineDrivenTransferContext

from tests.support.lmcache_peer import (
    BLOCK,
    BLOCKS,
    CHUNK,
    HEADS,
    LAYERS,
    MODEL,
    TIMEOUT_S,
    TOKENS,
    WIDTH,
    door_fixture,  # noqa: F401 (a fixture)
    key,
    lmcache_client_fixture,  # noqa: F401 (a fixture)
    lookup,
    request_client,
)

BLOCKS_IN_CHUNK = CHUNK // BLOCK


class Worker:
    """A CPU worker of vLLM 0.32 as LMCache's connector drives it in engine_driven mode: its per-layer
    caches `[blocks, heads, block tokens, 2 * head size]`, and LMCache's own transfer context."""

    def __init__(self, client: Any, instance_id: int, world_size: int = 1, rank: int = 0):
        self.kv = {f"layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BLOCK, WIDTH, dtype=torch.bfloat16)
                   for i in range(LAYERS)}
        self.world_size, self.rank = world_size, rank
        self.context = EngineDrivenTransferContext(instance_id, client)
        self.context.register(self.kv, MODEL, world_size, BLOCKS_IN_CHUNK, TIMEOUT_S, layout_hints={},
                              engine_group_infos=[EngineGroupInfo(0, tuple(range(LAYERS)), BLOCK)])

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.kv.values())

    def store(self, request_id: str, blocks: list[int], end: int = 64, tokens: list[int] = TOKENS,
              salt: str = "") -> bool:
        return self.context.submit_store(request_id, self._key(request_id, end, tokens, salt), self.kv,
                                         [blocks], None, BLOCKS_IN_CHUNK).result(TIMEOUT_S)

    def retrieve(self, request_id: str, blocks: list[int], skip: int = 0, tokens: list[int] = TOKENS,
                 salt: str = "", end: int = 64) -> bool:
        return self.context.submit_retrieve(request_id, self._key(request_id, end, tokens, salt), self.kv,
                                            [blocks], None, BLOCKS_IN_CHUNK,
                                            skip_first_n_tokens=skip).result(TIMEOUT_S)


    def _key(self, request_id: str, end: int, tokens: list[int], salt: str) -> Any:
        return key(request_id, self.rank, 0, end, tokens, salt, self.world_size)


def test_a_store_and_a_load_go_through_the_registration_s_own_staging_segment(
        door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    daemon, _ = door
    worker = Worker(lmcache_client, 48)
    shm = worker.context.engine_driven_context
    assert isinstance(shm, EngineDrivenContextShm), "the worker fell back to pickle"
    staging = Path("/dev/shm") / shm._shm_name.lstrip("/")
    assert staging.exists() and staging.stat().st_mode & 0o777 == 0o600
    assert staging.resolve().parent == Path("/dev/shm") and daemon.pool_path != staging
    generator = torch.Generator().manual_seed(7)
    for layer in worker.layers:
        layer[0:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH, generator=generator))

    assert worker.store("first", [0, 1, 2, 3]) is True
    lmcache_client.end_session("first").result(TIMEOUT_S)
    assert status(daemon.url).objects == 2
    assert lookup(lmcache_client, "again", 64) == 2
    assert worker.retrieve("again", [8, 9, 10, 11]) is True
    assert all(torch.equal(layer[8:12], layer[0:4]) for layer in worker.layers)
    lmcache_client.end_session("again").result(TIMEOUT_S)

    # A load whose first block vLLM holds already: LMCache's worker leaves it alone.
    assert lookup(lmcache_client, "skip", 64) == 2
    for layer in worker.layers:
        layer[12:16].fill_(7)
    assert worker.retrieve("skip", [12, 13, 14, 15], skip=BLOCK) is True
    for layer in worker.layers:
        assert torch.equal(layer[13:16], layer[1:4]) and bool((layer[12] == 7).all())
    lmcache_client.end_session("skip").result(TIMEOUT_S)

    report = status(daemon.url)
    assert [(i.instance_id, i.layout, i.door) for i in report.instances] == [
        (48, "LMCACHE_ENGINE_DRIVEN", "lmcache")]
    assert report.leases == 0
    # The daemon copies with preadv/pwritev: it never maps the staging segment (a worker that cut it
    # short could not fault it).
    assert staging.name not in Path(f"/proc/{daemon.proc.pid}/maps").read_text()

    worker.context.unregister().result(TIMEOUT_S)
    worker.context.close()
    assert not staging.exists()
    wait_for_status(daemon.url, lambda r: r.registered_instances == [], "the registration gone")


def test_each_rank_of_a_two_rank_world_stores_and_loads_its_own_bytes(
        door: tuple[DaemonProcess, str]) -> None:
    """LMCache's registration names no rank: each worker's is bound by its first transfer's key."""
    clients = [request_client(door[1]) for _ in range(2)]
    workers = [Worker(client, 70 + rank, world_size=2, rank=rank) for rank, client in enumerate(clients)]
    try:
        for worker in workers:
            generator = torch.Generator().manual_seed(20 + worker.rank)
            for layer in worker.layers:
                layer[0:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH, generator=generator))
        assert workers[0].store("tp", [0, 1, 2, 3]) is True
        assert lookup(clients[0], "half", 64, world_size=2) == 0  # rank 1 holds nothing yet
        assert workers[1].store("tp", [0, 1, 2, 3]) is True
        assert lookup(clients[0], "both", 64, world_size=2) == 2
        for worker in workers:
            assert worker.retrieve("both", [8, 9, 10, 11]) is True
            assert all(torch.equal(layer[8:12], layer[0:4]) for layer in worker.layers)
        assert not torch.equal(workers[0].layers[0][8:12], workers[1].layers[0][8:12])
        instances = status(door[0].url).instances
        assert sorted((i.instance_id, i.worker_id) for i in instances) == [(70, 0), (71, 1)]
    finally:
        for worker, client in zip(workers, clients, strict=True):
            worker.context.unregister().result(TIMEOUT_S)
            worker.context.close()
            client.close()


def test_a_load_finds_the_chunks_a_store_left_and_a_missing_chunk_fails_it_whole(
        door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    worker = Worker(lmcache_client, 49)
    try:
        for layer in worker.layers:
            layer[0:2].copy_(torch.randn(2, HEADS, BLOCK, WIDTH))
        assert worker.store("one", [0, 1], end=32) is True  # the first chunk only
        lmcache_client.end_session("one").result(TIMEOUT_S)
        assert lookup(lmcache_client, "two", 64) == 1
        for layer in worker.layers:
            layer[8:12].fill_(3)
        # Both chunks asked for, one stored: nothing is written, the load fails (vLLM recomputes).
        assert worker.retrieve("two", [8, 9, 10, 11]) is False
        assert all(bool((layer[8:12] == 3).all()) for layer in worker.layers)
        lmcache_client.end_session("two").result(TIMEOUT_S)
    finally:
        worker.context.unregister().result(TIMEOUT_S)
        worker.context.close()


def test_a_salted_store_loads_for_its_salt_only(door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    worker = Worker(lmcache_client, 52)
    try:
        for layer in worker.layers:
            layer[0:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH))
        assert worker.store("salted", [0, 1, 2, 3], salt="tenant-a") is True
        lmcache_client.end_session("salted").result(TIMEOUT_S)
        assert lookup(lmcache_client, "plain", 64) == 0
        assert lookup(lmcache_client, "other", 64, salt="tenant-b") == 0
        assert lookup(lmcache_client, "same", 64, salt="tenant-a") == 2
        assert worker.retrieve("same", [8, 9, 10, 11], salt="tenant-a") is True
        assert all(torch.equal(layer[8:12], layer[0:4]) for layer in worker.layers)
        for request_id in ("plain", "other", "same"):
            lmcache_client.end_session(request_id).result(TIMEOUT_S)
    finally:
        worker.context.unregister().result(TIMEOUT_S)
        worker.context.close()


def test_transfers_one_after_another_reuse_the_same_staging_slots(
        door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    """The segment is sparse and a transfer gets the lowest free slots: transfers one at a time spend
    the memory of one transfer's slots, however many there were, and reuse pages already touched."""
    daemon, _ = door
    worker = Worker(lmcache_client, 51)
    staging = Path("/dev/shm") / worker.context.engine_driven_context._shm_name.lstrip("/")
    chunk_bytes = int(re.search(r"engine_driven: chunks of (\d+) bytes", daemon.log()).group(1))
    try:
        for round_no in range(6):
            for layer in worker.layers:
                layer[0:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH))
            tokens = list(range(100 * round_no, 100 * round_no + 64))
            store, load = f"store-{round_no}", f"load-{round_no}"
            assert worker.store(store, [0, 1, 2, 3], tokens=tokens) is True
            lmcache_client.end_session(store).result(TIMEOUT_S)
            assert lookup(lmcache_client, load, 64, tokens) == 2
            assert worker.retrieve(load, [8, 9, 10, 11], tokens=tokens) is True
            assert all(torch.equal(layer[8:12], layer[0:4]) for layer in worker.layers)
            lmcache_client.end_session(load).result(TIMEOUT_S)
        # 24 slots were prepared in all, two at a time: the file holds the two lowest, no more.
        assert staging.stat().st_blocks * 512 <= 2 * chunk_bytes
    finally:
        worker.context.unregister().result(TIMEOUT_S)
        worker.context.close()


def test_a_store_of_chunks_held_already_hands_out_slots_for_the_rest_only(
        door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    """As LMCache's server does: the prepare of a returning prompt's store names only the chunks the
    pool lacks (its worker gathers those alone), and none once all are held (it commits nothing)."""
    worker = Worker(lmcache_client, 52)
    tokens = list(range(7000, 7096))  # 3 chunks of 32
    try:
        for layer in worker.layers:
            layer[0:6].copy_(torch.randn(6, HEADS, BLOCK, WIDTH))
        assert worker.store("first", [0, 1, 2, 3], end=64, tokens=tokens) is True
        lmcache_client.end_session("first").result(TIMEOUT_S)

        longer = key("longer", 0, 0, 96, tokens)
        prepared = lmcache_client.prepare_store(longer, 52).result(TIMEOUT_S)
        assert prepared.context["chunk_indices"] == [2]  # chunks 0 and 1 are held
        assert len(prepared.context["slots"]) == 1
        assert lmcache_client.commit_retrieve(longer, 52).result(TIMEOUT_S) is False  # not a load's
        lmcache_client.end_session("longer").result(TIMEOUT_S)
        # The worker's own store of the longer prompt: only its third chunk goes through a slot.
        assert worker.store("longer", [0, 1, 2, 3, 4, 5], end=96, tokens=tokens) is True
        lmcache_client.end_session("longer").result(TIMEOUT_S)
        assert lookup(lmcache_client, "all", 96, tokens) == 3
        assert worker.retrieve("all", [8, 9, 10, 11, 12, 13], tokens=tokens, end=96) is True
        assert all(torch.equal(layer[8:14], layer[0:6]) for layer in worker.layers)
        lmcache_client.end_session("all").result(TIMEOUT_S)

        again = lmcache_client.prepare_store(key("again", 0, 0, 96, tokens), 52).result(TIMEOUT_S)
        assert again.context == {"slots": [], "chunk_indices": []}  # everything held: nothing to copy
    finally:
        worker.context.unregister().result(TIMEOUT_S)
        worker.context.close()


def test_a_staging_segment_cut_short_fails_the_commit_and_the_daemon_serves_on(
        door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    daemon, _ = door
    worker = Worker(lmcache_client, 50)
    staging = Path("/dev/shm") / worker.context.engine_driven_context._shm_name.lstrip("/")
    try:
        prepared = lmcache_client.prepare_store(key("cut", 0, 0, 64), 50).result(TIMEOUT_S)
        assert len(prepared.context["slots"]) == 2
        worker.context.close()  # unmapped here first: this process must not touch its pages once cut
        os.truncate(staging, 0)  # what a careless or hostile worker may do between prepare and commit
        assert lmcache_client.commit_store(key("cut", 0, 0, 64), 50, b"").result(TIMEOUT_S) is False
        assert daemon.proc.poll() is None and lmcache_client.ping(50).result(TIMEOUT_S) is True
        assert status(daemon.url).objects == 0
    finally:
        lmcache_client.unregister_kv_cache_engine_driven_context(50).result(TIMEOUT_S)
    assert not staging.exists()


def test_a_staging_segment_left_by_a_killed_daemon_goes_at_the_next_start(
        daemons: Any, short_tmp: Path) -> None:
    dead = subprocess.Popen(["true"])  # a process id no daemon holds any more
    dead.wait()
    orphan = Path(f"/dev/shm/lmcache_mp_staging_{dead.pid}_0123abcd")
    alive = Path(f"/dev/shm/lmcache_mp_staging_{os.getpid()}_0123abcd")  # a live process's: kept
    orphan.write_bytes(b"\0" * 64)
    alive.write_bytes(b"\0" * 64)
    try:
        daemon = daemons("--lmcache-listen", f"ipc://{short_tmp / 'lmcache.sock'}", "--l1-size-gb", "0.05")
        assert not orphan.exists() and alive.exists()
        assert f"removed 1 staging segments of daemons no longer running: {orphan.name}" in daemon.log()
    finally:
        orphan.unlink(missing_ok=True)
        alive.unlink()
