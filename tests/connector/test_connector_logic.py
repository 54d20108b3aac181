"""Both halves of LMCacheMPDaemonConnector driven step by step, without an engine.

The real daemon and the real scheduler/worker halves; only vLLM's request, block and
scheduler-output objects are stand-ins (the fields the connector reads, per
docs/dev/vllm-0.32-connector-notes.md). This pins down what an engine run cannot show
deterministically: the exact ops, a failed load, an absent or frozen daemon.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.sockets import default_url
from lmcache_mp.testing.blocks import BLOCK, CHUNK, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import pages
from lmcache_mp.testing.launcher import DaemonProcess, start_daemon
from lmcache_mp.testing.probes import freeze
from tests.support.connector_helpers import Blocks, Worker, match, request, step, store_prompt, until
from tests.support.helpers import status, wait_for
from vllm_adapter import connector_worker
from vllm_adapter.connector_common import ConnectorSettings, LMCacheMPConnectorMetadata
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.connector_worker import IDLE_STEP_PAUSE_S
from vllm_adapter.ops import LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


def clear_all(raw: MessageQueueClient, expected: int = 2) -> int:
    """CLEAR until `expected` chunks are gone; how many went. CLEAR leaves pinned chunks, and the
    pool's sealer pins each new chunk while it checksums it."""
    cleared = [0]

    def clear() -> bool:
        cleared[0] += raw.submit(RequestType.CLEAR, []).result(10)
        return cleared[0] >= expected

    wait_for(clear, f"{expected} chunks cleared")
    return cleared[0]


@pytest.fixture
def halves(daemon: DaemonProcess) -> Iterator[tuple[SchedulerSide, Worker]]:
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode="async")
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    worker = Worker(settings, seed=1)
    yield scheduler, worker
    worker.side.shutdown()
    scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_stores_then_loads_exact_chunks(halves: tuple[SchedulerSide, Worker], daemon: DaemonProcess) -> None:
    scheduler, worker = halves
    rng = random.Random(7)
    tokens = [rng.randrange(1000) for _ in range(4 * CHUNK + 5)]
    hashes = block_hashes(tokens)
    tables = {"r1": list(range(10, 19))}

    # r1: a miss; prefill in two steps (70 + 63 tokens), then decoding.
    r1 = request("r1", tokens)
    assert match(scheduler, r1) == (0, False)
    scheduler.update_state_after_alloc(r1, Blocks(tables["r1"]), 0)
    first = scheduler.build_connector_meta(step(tables, new=((r1, 0, 70),)))
    second = scheduler.build_connector_meta(step(tables, cached=((r1, 70, 63),)))
    decode = scheduler.build_connector_meta(step(tables, cached=((r1, 133, 1),)))
    assert first.loads == {} and list(first.stores) == ["r1"]
    for meta, blocks in ((first, slice(0, 4)), (second, slice(4, 8))):  # this step's tokens count
        op = meta.stores["r1"]
        assert (op.block_ids, op.block_hashes) == (tables["r1"][blocks], hashes[blocks])
    assert decode.stores == {}  # the last, partial chunk is never stored
    for meta in (first, second, decode):
        worker.run(meta)
    assert scheduler.request_finished(r1) is True  # its stores may be in flight: keep the blocks
    worker.collect({"r1"})  # vLLM names a finished request once
    worker.wait_reported("sent", "r1")
    worker.collect()
    assert worker.reported["sent"] == {"r1": 1}
    assert status(daemon.url).objects == 4

    # r2 shares r1's 4 chunks; vLLM already holds its first 3 blocks (48 tokens).
    tokens2 = tokens[: 4 * CHUNK] + [rng.randrange(1000) for _ in range(20)]
    tables["r2"] = list(range(30, 40))
    for layer in worker.caches.values():
        layer[tables["r2"]] = 0
    r2 = request("r2", tokens2)
    assert match(scheduler, r2, local=48) == (4 * CHUNK - 48, True)
    scheduler.update_state_after_alloc(r2, Blocks(tables["r2"][:8]), 4 * CHUNK - 48)
    scheduler.update_state_after_alloc(r2, Blocks(tables["r2"]), 0)  # again, after the load
    meta = scheduler.build_connector_meta(step(tables))
    load = meta.loads["r2"]
    # From the chunk boundary (block 2); vLLM's own block 2 is -1: left alone.
    assert load.block_ids == [-1, *tables["r2"][3:8]] and load.block_hashes == block_hashes(tokens2)[2:8]
    worker.run(meta)
    worker.wait_reported("received", "r2")
    assert worker.reported["failed"] == {} and worker.load_errors == set()
    assert torch.equal(pages(worker.caches, "CPU_ATTN", SHAPE, tables["r2"][3:8]),
                       pages(worker.caches, "CPU_ATTN", SHAPE, tables["r1"][3:8]))
    assert not pages(worker.caches, "CPU_ATTN", SHAPE, tables["r2"][:3]).any()  # untouched
    assert scheduler.build_connector_meta(step(tables)).loads == {}  # one load per request
    assert scheduler.request_finished(r2) is False  # nothing stored: everything was a hit
    worker.collect({"r2"})
    worker.collect()
    assert "r2" not in worker.reported["sent"]  # vLLM no longer holds it: reporting it would crash


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_failed_load_is_reported_and_recomputed(halves: tuple[SchedulerSide, Worker],
                                                 daemon: DaemonProcess) -> None:
    scheduler, worker = halves
    tokens = list(range(2 * CHUNK + 1))
    tables = {"w": list(range(5)), "r": list(range(20, 25))}
    store_prompt(scheduler, worker, request("w", tokens), tables)

    reader = request("r", tokens)
    assert match(scheduler, reader) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(reader, Blocks(tables["r"][:4]), 2 * CHUNK)
    raw = MessageQueueClient(daemon.url)
    try:  # the chunks vanish between the lookup and the load
        raw.submit(RequestType.END_SESSION, ["r"]).result(10)
        assert clear_all(raw) == 2
    finally:
        raw.close()
    worker.run(scheduler.build_connector_meta(step(tables)))
    worker.wait_reported("received", "r")
    assert worker.reported["failed"] == {"r": 1}
    assert worker.load_errors == set(tables["r"][:4])

    # vLLM then restarts the request from scratch: no second load; it stores everything again.
    scheduler.update_connector_output(SimpleNamespace(failed_recving={"r"}))
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (0, False)
    scheduler.update_state_after_alloc(reader, Blocks(tables["r"]), 0)
    meta = scheduler.build_connector_meta(step(tables, new=((reader, 0, len(tokens)),)))
    assert meta.stores["r"].block_ids == tables["r"][:4]
    assert scheduler.request_finished(reader) is True


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_sync_loads_complete_before_the_forward_pass(daemon: DaemonProcess) -> None:
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode="sync")
    scheduler, worker = SchedulerSide(settings, "m", 1, 0, BLOCK), Worker(settings, seed=2)
    try:
        tokens = list(range(500, 500 + 2 * CHUNK + 1))
        tables = {"w": list(range(5)), "r": list(range(20, 25)), "x": list(range(40, 45))}
        store_prompt(scheduler, worker, request("w", tokens), tables)

        reader = request("r", tokens)
        assert match(scheduler, reader) == (2 * CHUNK, False)  # sync: vLLM loads before computing
        exact = request("x", tokens[: 2 * CHUNK])  # a whole-prompt hit leaves the last chunk to vLLM
        assert match(scheduler, exact) == (CHUNK, False)
        scheduler.update_state_after_alloc(reader, Blocks(tables["r"]), 2 * CHUNK)
        meta = scheduler.build_connector_meta(step(tables, new=((reader, 2 * CHUNK, 1),)))
        assert meta.sync_loads == {"r"} and list(meta.loads) == ["r"]
        worker.side.begin_step(meta)
        worker.side.start_load_kv()  # returns with the KV in place
        assert torch.equal(pages(worker.caches, "CPU_ATTN", SHAPE, tables["r"][:4]),
                           pages(worker.caches, "CPU_ATTN", SHAPE, tables["w"][:4]))
        worker.collect()
        assert "r" not in worker.reported["received"] and worker.load_errors == set()

        raw = MessageQueueClient(daemon.url)
        try:  # now the chunks vanish before the next sync load: its blocks are reported at once
            raw.submit(RequestType.END_SESSION, ["x"]).result(10)
            assert clear_all(raw) == 2
        finally:
            raw.close()
        scheduler.update_state_after_alloc(exact, Blocks(tables["x"][:4]), CHUNK)
        worker.side.begin_step(scheduler.build_connector_meta(step(tables, new=((exact, CHUNK, CHUNK),))))
        worker.side.start_load_kv()
        assert worker.side.take_load_errors() == set(tables["x"][:2])
    finally:
        worker.side.shutdown()
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_auto_loads_synchronously_where_nothing_else_computes_or_the_load_is_small(
        daemon: DaemonProcess) -> None:
    """load_mode "auto" (the default): a hit whose request comes to an engine that computes
    nothing else loads before its forward pass, one step sooner. A whole-prompt hit (which a
    sync load would cut a chunk short), and a hit over `sync_load_max_mb` while another request
    computes, load asynchronously; a smaller one, sync. Both kinds in one step: they go out as
    the step begins, before vLLM prepares its inputs (and, without sync loads, vLLM calls
    start_load_kv only after the forward pass); the sync load is in place when start_load_kv
    returns, the async one is reported done by transfer_results."""
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, sync_load_max_mb=1.0)
    assert ConnectorSettings().load_mode == "auto"
    # 2 chunks of 1 MiB each: over the 1 MiB limit; the same 2 chunks at a tenth of the bytes, under.
    big = 2**20 // CHUNK
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK, kv_bytes_per_token=big)
    worker = Worker(settings, seed=4)
    small = SchedulerSide(settings, "m", 1, 0, BLOCK, kv_bytes_per_token=big // 10)
    try:
        tokens = list(range(900, 900 + 2 * CHUNK + 1))
        tables = {"w": list(range(5)), "s": list(range(20, 25)), "x": list(range(40, 44))}
        store_prompt(scheduler, worker, request("w", tokens), tables)  # computed, then finished

        alone, whole = request("s", tokens), request("x", tokens[: 2 * CHUNK])
        assert match(scheduler, alone) == (2 * CHUNK, False)
        assert match(scheduler, whole) == (2 * CHUNK, True)
        scheduler.update_state_after_alloc(alone, Blocks(tables["s"]), 2 * CHUNK)
        scheduler.update_state_after_alloc(whole, Blocks(tables["x"]), 2 * CHUNK)
        meta = scheduler.build_connector_meta(step(tables, new=((alone, 2 * CHUNK, 1),)))
        assert meta.sync_loads == {"s"} and set(meta.loads) == {"s", "x"}
        worker.side.begin_step(meta)  # both loads go out, before any start_load_kv
        for loaded in (tables["s"][:4], tables["x"]):
            until(lambda blocks=loaded: torch.equal(pages(worker.caches, "CPU_ATTN", SHAPE, blocks),
                                                    pages(worker.caches, "CPU_ATTN", SHAPE, tables["w"][:4])))
        worker.side.start_load_kv()
        assert worker.side.take_load_errors() == set()
        worker.side.wait_for_save(meta)
        worker.wait_reported("received", "x")
        assert "s" not in worker.reported["received"] and worker.reported["failed"] == {}

        assert match(scheduler, request("b", tokens)) == (2 * CHUNK, True)  # "s" computes: 2 MiB
        small.build_connector_meta(step(tables, new=((request("other", tokens), 0, 1),)))
        assert match(small, request("b2", tokens)) == (2 * CHUNK, False)  # "other" computes: 0.2 MiB
        scheduler.request_finished(alone)
        assert match(scheduler, request("c", tokens)) == (2 * CHUNK, False)  # nothing computes
    finally:
        worker.side.shutdown()
        scheduler.shutdown()
        small.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_leases_outside_the_planned_load_are_released_at_once(daemon: DaemonProcess, load_mode: str) -> None:
    """The lookup leases all 4 hit chunks. Async: vLLM holds the first 2 itself, the load reads
    chunks 2-3. Sync: vLLM holds chunk 0 and computes the last chunk itself, the load reads
    chunks 1-2. Either way 2 leases are released as the load is planned, not at the request's end."""
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode=load_mode)
    scheduler, worker = SchedulerSide(settings, "m", 1, 0, BLOCK), Worker(settings, seed=3)
    try:
        tokens = list(range(700, 700 + 4 * CHUNK))
        tables = {"w": list(range(9)), "r": list(range(20, 28))}
        store_prompt(scheduler, worker, request("w", [*tokens, 1]), tables)
        reader = request("r", tokens)
        local = 2 * CHUNK if load_mode == "async" else CHUNK
        assert match(scheduler, reader, local=local) == (2 * CHUNK, load_mode == "async")
        assert status(daemon.url).leases == 4
        scheduler.update_state_after_alloc(reader, Blocks(tables["r"]), 2 * CHUNK)
        until(lambda: status(daemon.url).leases == 2)
        meta = scheduler.build_connector_meta(step(tables, new=((reader, local + 2 * CHUNK, 1),)))
        worker.run(meta)
        if load_mode == "async":
            worker.wait_reported("received", "r")
        assert worker.reported["failed"] == {} and worker.load_errors == set()
        assert status(daemon.url).leases == 0  # the load spent the rest
    finally:
        worker.side.shutdown()
        scheduler.shutdown()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_an_idle_step_reports_the_load_it_started(halves: tuple[SchedulerSide, Worker],
                                                   daemon: DaemonProcess,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In a step that computes nothing (the request waits for its load), the worker
    waits for the load it started, so that this very step reports it and the next computes the
    request (not vLLM spinning empty steps until one sees the reply). The wait is bounded, and a
    step that computes never waits. (The bound is made 2 s here, from 50 ms: a busy machine
    answers a load within it, and a step that waited is told from one that did not.)"""
    wait_s = 2.0
    monkeypatch.setattr(connector_worker, "IDLE_LOAD_WAIT_S", wait_s)
    scheduler, worker = halves
    tokens = list(range(900, 900 + 2 * CHUNK + 1))
    tables = {"w": list(range(5)), "r": list(range(20, 25)), "f": list(range(40, 45))}
    store_prompt(scheduler, worker, request("w", tokens), tables)
    reader = request("r", tokens)
    assert match(scheduler, reader) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(reader, Blocks(tables["r"][:4]), 2 * CHUNK)
    meta = scheduler.build_connector_meta(step(tables))
    assert meta.idle and list(meta.loads) == ["r"]
    worker.run(meta)
    assert worker.reported["received"] == {"r": 1} and worker.reported["failed"] == {}
    assert torch.equal(pages(worker.caches, "CPU_ATTN", SHAPE, tables["r"][:4]),
                       pages(worker.caches, "CPU_ATTN", SHAPE, tables["w"][:4]))

    frozen = request("f", tokens)
    assert match(scheduler, frozen) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(frozen, Blocks(tables["f"][:4]), 2 * CHUNK)
    load = scheduler.build_connector_meta(step(tables)).loads
    freeze(daemon.proc)  # its answer will be late
    try:
        started = time.monotonic()
        worker.run(LMCacheMPConnectorMetadata(loads=load, idle=False))  # a step that computes
        busy_s = time.monotonic() - started
        started = time.monotonic()
        worker.run(LMCacheMPConnectorMetadata(idle=True))
        idle_s = time.monotonic() - started
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert busy_s < wait_s <= idle_s < wait_s + 5.0, (busy_s, idle_s)
    assert "f" not in worker.reported["received"]
    worker.wait_reported("received", "f")
    assert worker.reported["failed"] == {}


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_empty_steps_are_paced_while_stores_are_held(halves: tuple[SchedulerSide, Worker],
                                                     daemon: DaemonProcess) -> None:
    """A finished request whose store is held (the daemon is away) keeps vLLM stepping with
    nothing to compute: those steps are paced, not spun."""
    scheduler, worker = halves
    tokens = list(range(1200, 1200 + 2 * CHUNK + 1))
    tables = {"h": list(range(5))}
    req = request("h", tokens)
    assert match(scheduler, req) == (0, False)
    prefill = scheduler.build_connector_meta(step(tables, new=((req, 0, len(tokens)),)))
    assert not prefill.idle and list(prefill.stores) == ["h"]
    assert daemon.stop() == 0
    worker.run(prefill)
    assert scheduler.request_finished(req) is True
    idle = scheduler.build_connector_meta(step(tables))
    assert idle.idle
    started = time.monotonic()
    worker.run(idle, {"h"})
    for _ in range(19):
        worker.run(idle)
    assert time.monotonic() - started >= 20 * IDLE_STEP_PAUSE_S
    assert "h" not in worker.reported["sent"]  # its store is still held for the daemon's return


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_preempted_request_gets_no_reload_and_its_stores_land_first(
        halves: tuple[SchedulerSide, Worker], daemon: DaemonProcess) -> None:
    scheduler, worker = halves
    tokens = list(range(100, 100 + 2 * CHUNK + 3))
    tables = {"p": list(range(5))}
    req = request("p", tokens)
    assert match(scheduler, req) == (0, False)
    prefill = scheduler.build_connector_meta(step(tables, new=((req, 0, len(tokens)),)))
    preempted = scheduler.build_connector_meta(step(tables, preempted=("p",)))
    assert preempted.preempted == {"p"}
    freeze(daemon.proc)  # the store stays in flight until SIGCONT
    try:
        worker.run(prefill)
        threading.Timer(0.5, daemon.proc.send_signal, [signal.SIGCONT]).start()
        started = time.monotonic()
        worker.side.begin_step(preempted)  # vLLM may reuse the blocks right after this
        assert time.monotonic() - started >= 0.4
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert status(daemon.url).objects == 2
    resumed = request("p", tokens, preemptions=1)
    assert scheduler.get_num_new_matched_tokens(resumed, 0) == (0, False)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_save_decode_cache_stores_chunks_completed_while_decoding(daemon: DaemonProcess) -> None:
    scheduler = SchedulerSide(ConnectorSettings(url=daemon.url, save_decode_cache=True), "m", 1, 0, BLOCK)
    try:
        prompt = list(range(CHUNK + 1))
        tables = {"d": [1, 2, 3, 4]}
        req = request("d", prompt)
        assert match(scheduler, req) == (0, False)
        prefill = scheduler.build_connector_meta(step(tables, new=((req, 0, len(prompt)),)))
        assert prefill.stores["d"].block_ids == [1, 2]
        generated = prompt + list(range(CHUNK - 1))  # decoding fills the 2nd chunk
        req.block_hashes, req.num_tokens = block_hashes(generated), len(generated)
        meta = scheduler.build_connector_meta(step(tables, cached=((req, 2 * CHUNK - 1, 1),)))
        assert meta.stores["d"].block_ids == [3, 4]
        assert meta.stores["d"].block_hashes == block_hashes(generated)[2:4]
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_absent_daemon_then_appearing(short_tmp: Path, load_mode: str) -> None:
    """vLLM starts without the daemon: no hits, failed loads, skipped stores, and no long
    waits. Once the daemon starts, both halves connect and the worker registers."""
    url = f"ipc://{short_tmp / 'late.sock'}"
    settings = ConnectorSettings(url=url, reconnect_interval_s=0.3, load_mode=load_mode)
    started = time.monotonic()
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    worker = Worker(settings, seed=2)
    daemon = None
    try:
        assert time.monotonic() - started < 6  # each half waits up to 2 s for its first attempt
        tokens = list(range(2 * CHUNK))
        tables = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
        a = request("a", tokens)
        assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
        assert scheduler.build_connector_meta(step(tables, new=((a, 0, len(tokens)),))).stores == {}
        assert scheduler.request_finished(a) is False
        # A load planned before the daemon went away fails; vLLM recomputes.
        load = LoadStoreOp([-1, 6, 7, 8], block_hashes=block_hashes(tokens))
        worker.run(LMCacheMPConnectorMetadata(loads={"b": load}))
        assert worker.reported["received"] == worker.reported["failed"] == {"b": 1}
        assert worker.load_errors == {6, 7, 8}

        daemon = start_daemon(short_tmp, *DAEMON_ARGS, url=url)
        until(lambda: status(url).registered_instances or worker.run(LMCacheMPConnectorMetadata()))
        c = request("c", tokens)
        tables["c"] = [9, 10, 11, 12]
        assert match(scheduler, c) == (0, False)

        def store_planned() -> LMCacheMPConnectorMetadata | None:  # once the scheduler is connected
            meta = scheduler.build_connector_meta(step(tables, new=((c, 0, len(tokens)),)))
            return meta if meta.stores else None

        worker.run(until(store_planned))
        assert scheduler.request_finished(c) is True
        worker.collect({"c"})
        worker.wait_reported("sent", "c")
        # A sync load leaves the last chunk of a whole-prompt hit to vLLM.
        hit = (2 * CHUNK, True) if load_mode == "async" else (CHUNK, False)
        assert match(scheduler, request("d", tokens)) == hit

        # A frozen daemon: the lookup waits while the heartbeat still counts the daemon as
        # alive, then the scheduler stops waiting and counts a miss.
        freeze(daemon.proc)
        try:
            frozen = request("e", tokens)
            scheduler.on_new_request(frozen)
            assert scheduler.get_num_new_matched_tokens(frozen, 0) == (None, True)
            assert until(lambda: scheduler.get_num_new_matched_tokens(frozen, 0)[0] is not None, 5)
            assert scheduler.get_num_new_matched_tokens(frozen, 0) == (0, False)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert until(lambda: match(scheduler, request(f"f{time.monotonic()}", tokens)) == hit, 5)
    finally:
        worker.side.shutdown()
        scheduler.shutdown()
        if daemon is not None:
            daemon.stop()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_the_scheduler_waits_for_lookups_within_each_steps_budget(daemon: DaemonProcess) -> None:
    """`lookup_wait_ms`: a lookup answered within the step's budget is matched at the first ask
    (no step lost to "pending"); the budget is shared by the step's requests and renewed by the
    next step; 0 never waits."""
    tokens = list(range(2 * CHUNK))
    # A heartbeat slower than the test: the frozen daemon still counts as alive, its lookups pending.
    settings = ConnectorSettings(url=daemon.url, lookup_wait_ms=300, reconnect_interval_s=60)
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    never = SchedulerSide(dataclasses.replace(settings, lookup_wait_ms=0), "m", 1, 0, BLOCK)
    try:
        first = request("a", tokens)
        scheduler.on_new_request(first)
        assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)  # answered, not pending

        freeze(daemon.proc)
        try:
            late, later = request("b", tokens), request("c", tokens)
            start = time.monotonic()
            assert scheduler.get_num_new_matched_tokens(late, 0) == (None, True)
            waited = time.monotonic() - start
            start = time.monotonic()
            assert scheduler.get_num_new_matched_tokens(later, 0) == (None, True)
            assert waited > 0.25 and time.monotonic() - start < waited / 2  # the step's budget is spent
            scheduler.build_connector_meta(step({}))
            start = time.monotonic()
            assert scheduler.get_num_new_matched_tokens(later, 0) == (None, True)
            assert time.monotonic() - start > 0.25  # a new step, a new budget

            other = request("d", tokens)
            start = time.monotonic()
            assert never.get_num_new_matched_tokens(other, 0) == (None, True)
            assert time.monotonic() - start < 0.25
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        scheduler.shutdown()
        never.shutdown()


def test_settings() -> None:
    assert ConnectorSettings.from_extra_config({}) == ConnectorSettings(url=default_url())
    parsed = ConnectorSettings.from_extra_config({"lmcache.mp.url": "tcp://127.0.0.1:5555",
                                                  "lmcache.mp.timeout_s": "2.5",
                                                  "lmcache.mp.save_decode_cache": "false",
                                                  "other.connector.key": 1})
    assert (parsed.url, parsed.timeout_s, parsed.save_decode_cache) == ("tcp://127.0.0.1:5555", 2.5, False)
    assert ConnectorSettings.from_extra_config({"lmcache.mp.save_decode_cache": True}).save_decode_cache
    with pytest.raises(ValueError, match=r"lmcache\.mp\.time_out"):
        ConnectorSettings.from_extra_config({"lmcache.mp.time_out": 3})
    with pytest.raises(ValueError, match="positive"):
        ConnectorSettings.from_extra_config({"lmcache.mp.reconnect_interval_s": 0})
    assert ConnectorSettings.from_extra_config({"lmcache.mp.load_mode": "sync"}).load_mode == "sync"
    with pytest.raises(ValueError, match="load_mode"):
        ConnectorSettings.from_extra_config({"lmcache.mp.load_mode": "eager"})
    assert ConnectorSettings.from_extra_config({"lmcache.mp.lookup_wait_ms": "0.5"}).lookup_wait_ms == 0.5
    with pytest.raises(ValueError, match="lookup_wait_ms"):
        ConnectorSettings.from_extra_config({"lmcache.mp.lookup_wait_ms": -1})


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_kv_role_consumer_never_stores_and_producer_never_loads(daemon: DaemonProcess) -> None:
    """vLLM's `kv_role`: a "kv_consumer" loads what another engine stored but stores nothing of
    its own; a "kv_producer" stores, and neither looks up nor loads (no LOOKUP reaches the daemon)."""
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode="async")
    both = SchedulerSide(settings, "m", 1, 0, BLOCK)
    consumer = SchedulerSide(settings, "m", 1, 0, BLOCK, stores=False)
    producer = SchedulerSide(settings, "m", 1, 0, BLOCK, loads=False)
    worker = Worker(settings, seed=5)
    try:
        rng = random.Random(11)
        shared = [rng.randrange(1000) for _ in range(2 * CHUNK + 3)]
        store_prompt(both, worker, request("both", shared), {"both": list(range(1, 10))})
        assert status(daemon.url).objects == 2

        own = [rng.randrange(1000) for _ in range(2 * CHUNK + 3)]
        mine = request("consumer-own", own)
        assert match(consumer, mine) == (0, False)
        meta = consumer.build_connector_meta(step({"consumer-own": list(range(10, 19))},
                                                  new=((mine, 0, mine.num_prompt_tokens),)))
        assert meta.stores == {}  # nothing planned, so nothing can reach the daemon
        assert match(consumer, request("consumer-hit", shared)) == (2 * CHUNK, True)

        lookups_before = status(daemon.url).lookup_chunks_total
        hit = request("producer", shared)
        assert match(producer, hit) == (0, False)  # the daemon holds it, but a producer never loads
        meta = producer.build_connector_meta(step({"producer": list(range(20, 29))},
                                                  new=((hit, 0, hit.num_prompt_tokens),)))
        assert meta.loads == {} and meta.stores["producer"].block_hashes == block_hashes(shared)[:8]
        assert status(daemon.url).lookup_chunks_total == lookups_before
    finally:
        worker.side.shutdown()
        for side in (both, consumer, producer):
            side.shutdown()
