"""Tails through a real daemon: a request's KV past its last full chunk stored as one
short chunk, noted (NOTE_TAILS), found after its anchor chunk (LOOKUP_PREFIX, leased like the
chunks), loaded byte for byte into another worker's blocks; never read as a chunk of another
length; freed when superseded. Real daemon, real sockets and shared memory, the real adapters;
tests/vllm/test_vllm_tails.py runs a real engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, RequestType, TailHit, TailNote
from lmcache_mp.testing.blocks import BLOCK, CHUNK, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import pages, wait_done
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.helpers import refusal, status, wait_for, wait_for_leases
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
BPC = CHUNK // BLOCK
HISTORY = list(range(10, 10 + 2 * CHUNK + BLOCK + 5))  # 2 chunks, then a tail of 1 block and 5 tokens
HASHES = block_hashes(HISTORY)
CHUNKS = HASHES[:2 * BPC]
ANCHOR = HASHES[2 * BPC - 1]  # the key of chunk 1, which the tail follows
TAIL = TailHit(BLOCK + 5, 2, b"tail-of-history".ljust(32, b"."))
SHORTER = TailHit(5, 1, b"a-shorter-tail".ljust(32, b"."))
Scheduler = LMCacheMPSchedulerAdapter


@pytest.fixture
def scheduler(daemon: DaemonProcess) -> Iterator[LMCacheMPSchedulerAdapter]:
    adapter = LMCacheMPSchedulerAdapter(daemon.url, None, "m", 1, 0, BLOCK)
    yield adapter
    adapter.shutdown()


def _op(blocks: list[int], chunks: list[bytes] | None = None, tail: TailHit = TAIL) -> LoadStoreOp:
    """Blocks of whole chunks (`chunks` their vLLM block hashes), then those of `tail`."""
    return LoadStoreOp(blocks, block_hashes=chunks or [], tail_hash=tail.tail_hash)


def _store(worker: LMCacheMPWorkerAdapter, request_id: str, op: LoadStoreOp) -> None:
    worker.submit_store_request(request_id, op, None)
    wait_done(worker, request_id, retrieve=False)


def _lookup(scheduler: LMCacheMPSchedulerAdapter, request_id: str, hashes: list[bytes],
            keep: bool = True) -> tuple[int, list[TailHit]]:
    """LOOKUP_PREFIX: the chunk hit and the tails after it; leased to `request_id` if `keep`."""
    scheduler.maybe_submit_lookup_request(request_id, block_hashes=hashes, tails=True)
    wait_for(lambda: scheduler.check_lookup_result(request_id) is not None, "the lookup answered")
    found = scheduler.check_lookup_result(request_id), scheduler.lookup_tails(request_id)
    scheduler.cleanup_lookup_result(request_id)
    if not keep:
        scheduler.end_session(request_id)
    return found


def _note(daemon: DaemonProcess, scheduler: LMCacheMPSchedulerAdapter, stored: list[TailNote],
          superseded: list[TailNote], until: TailHit, found: bool) -> None:
    """NOTE_TAILS (fire and forget), then wait until a lookup finds `until` (or no longer does)."""
    scheduler.note_tails(stored, superseded)
    wait_for(lambda: (until in _lookup(scheduler, "probe", CHUNKS, keep=False)[1]) == found,
             "NOTE_TAILS taken")
    wait_for_leases(daemon.url, 0, 0)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_tail_is_found_after_its_anchor_and_loads_byte_for_byte(daemon: DaemonProcess, worker_for,
                                                                 scheduler: Scheduler) -> None:
    source = worker_for(daemon.url, seed=1)
    # A finished request's store: its 2 chunks (blocks 0-3) and its tail (blocks 4-5), one STORE.
    _store(source, "turn-1", _op(list(range(6)), CHUNKS))
    assert status(daemon.url).objects == 3
    _note(daemon, scheduler, [TailNote(ANCHOR, SHORTER), TailNote(ANCHOR, TAIL)], [], TAIL, found=True)
    offered = status(daemon.url).tails_offered_total
    # SHORTER was noted but never stored: not offered. A lookup of one chunk has another anchor.
    assert _lookup(scheduler, "turn-2", CHUNKS) == (2 * CHUNK, [TAIL])
    assert _lookup(scheduler, "other", CHUNKS[:BPC], keep=False) == (CHUNK, [])
    wait_for_leases(daemon.url, 1, 3)  # turn-2 holds its 2 chunks and its tail
    report = status(daemon.url)
    assert (report.tails_indexed, report.tails_offered_total - offered) == (2, 1)
    target = worker_for(daemon.url, seed=2)
    before = pages(target.kv_caches, "CPU_ATTN", SHAPE, list(range(64)))
    into = [20, 21, 22, 23, 30, -1]  # the tail's second block is one vLLM holds already: skipped
    target.submit_retrieve_request("turn-2", _op(into, CHUNKS), None)
    wait_done(target, "turn-2", retrieve=True)
    assert target.take_failed_retrieves() == {}
    loaded = pages(target.kv_caches, "CPU_ATTN", SHAPE, [20, 21, 22, 23, 30])
    assert torch.equal(loaded, pages(source.kv_caches, "CPU_ATTN", SHAPE, [0, 1, 2, 3, 4]))
    untouched = [b for b in range(64) if b not in into]
    assert torch.equal(pages(target.kv_caches, "CPU_ATTN", SHAPE, untouched), before[:, untouched])
    wait_for_leases(daemon.url, 0, 0)  # the RETRIEVE spent them


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_short_chunk_is_never_read_as_a_chunk_of_another_length(daemon: DaemonProcess, worker_for) -> None:
    """The tail's key with a whole chunk's blocks, or with another short length, is another
    chunk: not stored, so a RETRIEVE of it fails (a miss, never bytes the tail never had). More
    blocks than a chunk's is refused outright."""
    source = worker_for(daemon.url, seed=1)
    _store(source, "store", _op([4]))  # 1 block
    target = worker_for(daemon.url, seed=2)
    for request_id, blocks in (("as-whole", [7, 8]), ("as-one", [7])):
        target.submit_retrieve_request(request_id, _op(blocks), None)
        wait_done(target, request_id, retrieve=True)
    assert set(target.take_failed_retrieves()) == {"as-whole"}
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    try:
        too_long = [IPCCacheEngineKey("m", 1, 0, chunk_hash=TAIL.tail_hash, num_blocks=BPC + 1)]
        error = refusal(client, RequestType.STORE, [too_long, source.instance_id, [1, 2, 3], b""])
        assert error.code == ErrorCode.INVALID_ARGUMENT and "short chunk of 3 blocks" in str(error)
    finally:
        client.close()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_superseded_tail_is_freed_unless_a_request_holds_it(daemon: DaemonProcess, worker_for,
                                                              scheduler: Scheduler) -> None:
    source = worker_for(daemon.url, seed=1)
    _store(source, "turn-1", _op(list(range(6)), CHUNKS))
    _store(source, "turn-1b", _op([8], tail=SHORTER))
    notes = [TailNote(ANCHOR, TAIL), TailNote(ANCHOR, SHORTER)]
    _note(daemon, scheduler, notes, [], TAIL, found=True)
    assert _lookup(scheduler, "reader", CHUNKS) == (2 * CHUNK, [SHORTER, TAIL])  # newest first, both leased
    # Both superseded: forgotten at once; the one nobody holds is freed, the leased ones stay stored.
    scheduler.note_tails([], notes)
    wait_for(lambda: _lookup(scheduler, "probe", CHUNKS, keep=False)[1] == [], "the tails forgotten")
    assert status(daemon.url).objects == 4  # leased by "reader": kept until it is done
    scheduler.end_session("reader")
    wait_for_leases(daemon.url, 0, 0)
    scheduler.note_tails([], notes)  # superseded again (a tail a request held when it was): freed
    wait_for(lambda: status(daemon.url).objects == 2, "the superseded tails freed")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_tail_from_token_0_is_found_and_leased_without_any_chunk(daemon: DaemonProcess, worker_for,
                                                                   scheduler: Scheduler) -> None:
    """A conversation shorter than a chunk: its tail follows no chunk (anchor b""), and a
    lookup of no chunk at all finds it, leased until the request ends."""
    source = worker_for(daemon.url, seed=1)
    _store(source, "short", _op([9], tail=SHORTER))
    scheduler.note_tails([TailNote(b"", SHORTER)], [])
    wait_for(lambda: _lookup(scheduler, "probe", [], keep=False)[1] == [SHORTER], "NOTE_TAILS taken")
    wait_for_leases(daemon.url, 0, 0)
    assert _lookup(scheduler, "again", []) == (0, [SHORTER])
    wait_for_leases(daemon.url, 1, 1)
    scheduler.end_session("again")
    wait_for_leases(daemon.url, 0, 0)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_among_many_conversations_after_one_chunk_each_turn_gets_its_own(daemon: DaemonProcess, worker_for,
                                                                        scheduler: Scheduler) -> None:
    """Shared first chunks (a system prompt) and many conversations after them: each tail of a
    full block or more is found by its last block, which the lookup's window holds (its prompt's
    last chunk and past it), however many others were noted after the same chunk since."""
    source = worker_for(daemon.url, seed=1)
    mine = TailHit(BLOCK + 5, 2, b"my-tail".ljust(32, b"."), last_block=HASHES[2 * BPC])
    _store(source, "turn-1", _op(list(range(6)), CHUNKS, tail=mine))
    others = [TailNote(ANCHOR, TailHit(BLOCK + 1, 2, b"%d" % i * 4, last_block=b"%d" % i * 8))
              for i in range(50)]
    scheduler.note_tails([TailNote(ANCHOR, mine), *others], [])
    wait_for(lambda: _lookup(scheduler, "probe", HASHES, keep=False)[1] == [mine], "NOTE_TAILS taken")
    wait_for_leases(daemon.url, 0, 0)
    # A prompt without that block (another conversation's) is offered nothing.
    other_prompt = block_hashes(HISTORY[:2 * CHUNK] + [7] * BLOCK)
    assert _lookup(scheduler, "other", other_prompt, keep=False) == (2 * CHUNK, [])
