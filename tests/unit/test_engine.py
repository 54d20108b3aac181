"""The engine (`engine.Engine`) in process: its operations' contracts, with no ZeroMQ and no daemon.

A real `Engine`, built from a `ServerConfig` as the daemon builds it (a small pool, its attach
socket in a temporary directory), with CPU KV caches registered the way a worker registers
them: moved into shared memory (`kv_export.export_kv_caches`), their descriptors handed over
the engine's real attach socket (`AttachChannel`), then REGISTER_KV_CACHE called directly. Each
request is a direct call of its handler (`Engine.handlers()`), on the test's thread; where the
server would set `dispatch.ARRIVAL` around a handler, the test sets it the same way. What the
engine holds is read from its typed status (`status.engine_status`) and its pool's counters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmcache_mp.config import ServerConfig
from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.engine import status
from lmcache_mp.engine.dispatch import PEER, ReplyThen
from lmcache_mp.engine.engine import Engine
from lmcache_mp.errors import ServerError
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import ChunkOutcome, ErrorCode, KVCacheRegistration, ModelScope, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.transfer.attach_channel import AttachChannel
from tests.support.helpers import arrived, wait_for
from vllm_adapter.kv_export import export_kv_caches

MODEL = "m"
LAYOUT = "CPU_ATTN"
POOL_GB = 16 / 1024  # 16 MiB: room for hundreds of the tests' 16 KiB chunks
STORED, LANDED = [0, 1, 2, 3], [10, 11, 12, 13]  # two chunks' blocks, and where they are retrieved to
STORED_, ALREADY = ChunkOutcome.STORED, ChunkOutcome.ALREADY_PRESENT


def chunk_hash(i: int) -> bytes:
    return hashlib.sha256(f"chunk {i}".encode()).digest()


def keys(n: int, request_id: str | None, *, worker_id: int | None = 0, world_size: int = 1,
         model: str = MODEL, first: int = 0) -> list[IPCCacheEngineKey]:
    """Hash-mode keys of chunks `first` .. `first + n - 1` of the test chain (`worker_id=None`:
    every rank, as the scheduler looks up)."""
    return [IPCCacheEngineKey(model, world_size, worker_id, chunk_hash=chunk_hash(i), request_id=request_id)
            for i in range(first, first + n)]


@dataclass
class CpuRank:
    """One registered worker's CPU caches, and the attach channel that keeps its registration."""

    instance_id: int
    caches: dict[str, torch.Tensor]
    channel: AttachChannel

    def pages(self, block_ids: list[int]) -> torch.Tensor:
        return pages(self.caches, LAYOUT, SHAPE, block_ids)


class EngineUnderTest:
    """An `Engine` and the ranks registered with it; `close` closes it, then the ranks' channels."""

    def __init__(self, directory: Path):
        self.config = ServerConfig(listen=[f"ipc://{directory}/daemon.sock"], chunk_size=CHUNK,
                                   l1_size_gb=POOL_GB, pool_file="")  # warm restart: test_warm_restart
        self.engine = Engine(self.config, Metrics())
        self.handle = self.engine.handlers()
        # The pool is prepared in the background (milliseconds at this size); STOREs find
        # NO_SPACE beyond what is ready.
        wait_for(lambda: self.report().pool_ready, "the pool prepared", timeout_s=10)
        self.ranks: list[CpuRank] = []

    def register(self, instance_id: int, *, worker_id: int = 0, world_size: int = 1,
                 seed: int | None = 1) -> CpuRank:
        caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=seed)
        handles, fds = export_kv_caches(caches)
        channel = AttachChannel.open(str(self.config.attach_socket), fds)
        registration = KVCacheRegistration(MODEL, world_size, worker_id, LAYOUT, channel.token,
                                           block_size=BLOCK)
        self.handle[RequestType.REGISTER_KV_CACHE](instance_id, handles, registration)
        rank = CpuRank(instance_id, caches, channel)
        self.ranks.append(rank)
        return rank

    def lookup(self, lookup_keys: list[IPCCacheEngineKey]) -> int:
        """A LOOKUP answered on the socket thread: its reply, then its bookkeeping (the leases)
        before the next request, as the server runs a `ReplyThen`."""
        answer = self.handle[RequestType.LOOKUP](lookup_keys)
        if isinstance(answer, ReplyThen):
            answer.then()
            return answer.result
        assert isinstance(answer, int), answer  # no lower tier here: never a promotion's Future
        return answer

    def store(self, rank: CpuRank, store_keys: list[IPCCacheEngineKey],
              block_ids: list[int] = STORED) -> list[ChunkOutcome]:
        return self.handle[RequestType.STORE](store_keys, rank.instance_id, block_ids, b"").outcomes

    def retrieve(self, rank: CpuRank, retrieve_keys: list[IPCCacheEngineKey],
                 block_ids: list[int] = LANDED) -> tuple[bool, str]:
        result = self.handle[RequestType.RETRIEVE](retrieve_keys, rank.instance_id, block_ids, b"")
        return result.ok, result.reason

    def report(self) -> status.EngineStatus:
        """The engine's part of STATUS."""
        return status.engine_status(self.engine)

    def leases(self) -> tuple[int, int]:
        """(lease sessions, leases), as STATUS reports them."""
        report = self.report()
        return report.sessions, report.leases

    def pinned(self) -> int:
        """Pool objects pinned now: by leases, or by copies running."""
        return self.engine.storage.pool_stats().num_pinned

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            for rank in self.ranks:
                rank.channel.close()


@pytest.fixture
def engine(short_tmp: Path) -> Iterator[EngineUnderTest]:
    under_test = EngineUnderTest(short_tmp)
    yield under_test
    under_test.close()


def refused(code: ErrorCode, call, *args) -> ServerError:
    """The typed error `call(*args)` raises, checked to carry `code`."""
    with pytest.raises(ServerError) as err:
        call(*args)
    assert err.value.code is code, err.value
    return err.value


# ---- STORE, LOOKUP, RETRIEVE -------------------------------------------------------------------


def test_a_stored_prefix_is_found_and_retrieved_bit_exact(engine: EngineUnderTest) -> None:
    writer = engine.register(1, seed=1)
    reader = engine.register(2, seed=None)  # another worker of the same kind: zeroed caches
    assert engine.store(writer, keys(2, "s")) == [STORED_, STORED_]
    assert engine.report().objects == 2

    assert engine.lookup(keys(3, "r", worker_id=None)) == 2  # the third chunk was never stored
    expected = writer.pages(STORED)
    assert not torch.equal(reader.pages(LANDED), expected)
    assert engine.retrieve(reader, keys(2, "r")) == (True, "")
    assert torch.equal(reader.pages(LANDED), expected)
    assert not reader.pages([b for b in range(SHAPE[0]) if b not in LANDED]).any()  # nothing else written


def test_a_second_store_of_the_same_chunks_finds_them_present(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    assert engine.store(rank, keys(2, "a")) == [STORED_, STORED_]
    assert engine.store(rank, keys(2, "b")) == [ALREADY, ALREADY]
    # A longer prefix copies only the chunk the pool lacks.
    assert engine.store(rank, keys(3, "c"), [*STORED, 4, 5]) == [ALREADY, ALREADY, STORED_]
    assert engine.report().objects == 3


def test_a_lookup_hits_only_chunks_stored_on_every_rank(engine: EngineUnderTest) -> None:
    rank0 = engine.register(1, worker_id=0, world_size=2)
    assert engine.lookup(keys(1, "r", worker_id=None, world_size=2)) == 0  # rank 1 not registered
    rank1 = engine.register(2, worker_id=1, world_size=2)
    assert engine.store(rank0, keys(2, "s", worker_id=0, world_size=2)) == [STORED_, STORED_]
    assert engine.lookup(keys(2, "r", worker_id=None, world_size=2)) == 0  # rank 1 stored nothing yet
    assert engine.store(rank1, keys(1, "s", worker_id=1, world_size=2)) == [STORED_]
    assert engine.lookup(keys(2, "r", worker_id=None, world_size=2)) == 1
    assert engine.lookup(keys(2, "r", world_size=1, worker_id=None)) == 0  # another world's keys


def test_keys_of_another_rank_or_model_are_refused(engine: EngineUnderTest) -> None:
    rank = engine.register(1, worker_id=0, world_size=2)
    for wrong, words in ((keys(1, "s", worker_id=1, world_size=2), "keys of worker 1"),
                         (keys(1, "s", world_size=1), "world size 1"),
                         (keys(1, "s", model="other", world_size=2), "(other,")):
        assert words in refused(ErrorCode.INVALID_ARGUMENT, engine.store, rank, wrong).message
        assert words in refused(ErrorCode.INVALID_ARGUMENT, engine.retrieve, rank, wrong).message
    refused(ErrorCode.UNKNOWN_INSTANCE, engine.store, CpuRank(99, rank.caches, rank.channel), keys(1, "s"))
    assert engine.report().objects == 0


# ---- leases ------------------------------------------------------------------------------------


def test_a_lookup_leases_its_hits_and_the_retrieve_spends_them(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(2, "s"))
    assert engine.leases() == (0, 0) and engine.pinned() == 0

    assert engine.lookup(keys(2, "r", worker_id=None)) == 2
    assert engine.leases() == (1, 2) and engine.pinned() == 2
    assert engine.lookup(keys(2, "q", worker_id=None)) == 2  # another request's lease on the same chunks
    assert engine.leases() == (2, 4)

    assert engine.retrieve(rank, keys(2, "r")) == (True, "")
    assert engine.leases() == (1, 2)  # r's spent, q's kept
    assert engine.retrieve(rank, keys(2, "q")) == (True, "")
    assert engine.leases() == (0, 0) and engine.pinned() == 0


def test_a_lookup_that_leases_nothing_opens_no_session(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(1, "s"))
    assert engine.lookup(keys(1, "r", worker_id=None, first=5)) == 0  # a miss
    assert engine.lookup(keys(1, None, worker_id=None)) == 1  # no request: counted, nothing leased
    assert engine.leases() == (0, 0) and engine.pinned() == 0
    report = engine.report()
    assert (report.lookup_chunks_total, report.lookup_hits_total) == (2, 1)


def test_a_failed_retrieve_still_spends_its_leases(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(2, "s"))
    assert engine.lookup(keys(2, "r", worker_id=None)) == 2
    refused(ErrorCode.INVALID_ARGUMENT, engine.retrieve, rank, keys(2, "r"), [0, 1, 2, SHAPE[0]])
    assert engine.leases() == (0, 0) and engine.pinned() == 0


def test_end_session_releases_everything_the_request_holds(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(2, "s"))
    engine.lookup(keys(2, "r", worker_id=None))
    engine.lookup(keys(1, "q", worker_id=None))
    assert engine.leases() == (2, 3)
    engine.handle[RequestType.END_SESSION]("r")
    assert engine.leases() == (1, 1) and engine.pinned() == 1
    engine.handle[RequestType.END_SESSION]("r")  # again, and for a request never seen: nothing to do
    engine.handle[RequestType.END_SESSION]("never")
    assert engine.leases() == (1, 1)
    # The chunks stay stored: a RETRIEVE without a lease still reads them.
    assert engine.retrieve(rank, keys(2, "r")) == (True, "")


def test_release_leases_releases_only_the_named_chunks(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(3, "s"), [*STORED, 4, 5])
    engine.lookup(keys(3, "r", worker_id=None))
    engine.lookup(keys(3, "q", worker_id=None))
    assert engine.leases() == (2, 6)
    engine.handle[RequestType.RELEASE_LEASES](keys(2, "r", first=1))  # r will not read chunks 1 and 2
    assert engine.leases() == (2, 4)
    engine.handle[RequestType.RELEASE_LEASES](keys(1, None))  # keys without a request release nothing
    assert engine.leases() == (2, 4)
    engine.handle[RequestType.RELEASE_LEASES](keys(1, "r"))
    assert engine.leases() == (1, 3) and engine.pinned() == 3  # q's three


# ---- CANCEL_TRANSFERS --------------------------------------------------------------------------


def test_a_store_sent_before_a_cancel_of_its_request_publishes_nothing(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    with arrived(2):
        assert engine.handle[RequestType.CANCEL_TRANSFERS](rank.instance_id, ["r"]) == 0  # nothing copying
    with arrived(1):  # read before the CANCEL, run after it (it waited in the queue)
        refused(ErrorCode.CANCELLED, engine.store, rank, keys(2, "r"))
    assert engine.report().objects == 0 and engine.lookup(keys(2, None, worker_id=None)) == 0
    with arrived(3):  # sent after the CANCEL (what vLLM recomputed): stored as usual
        assert engine.store(rank, keys(2, "r")) == [STORED_, STORED_]
    with arrived(3):  # another request of the same instance was never cancelled
        assert engine.store(rank, keys(1, "other", first=5)) == [STORED_]


def test_a_cancel_while_a_store_copies_stops_it_and_publishes_nothing(
        engine: EngineUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    rank = engine.register(1)
    context = engine.engine.registry.instance(rank.instance_id).context
    real_chunk_view = context.chunk_view
    answers: list[int | Future[int]] = []

    def cancel_during_the_first_copy(data: torch.Tensor) -> torch.Tensor:
        if not answers:  # the STORE is copying its first chunk: the worker gives up on it
            with arrived(2):
                answers.append(engine.handle[RequestType.CANCEL_TRANSFERS](rank.instance_id, ["r"]))
            assert engine.report().transfers_running == 1
        return real_chunk_view(data)

    monkeypatch.setattr(context, "chunk_view", cancel_during_the_first_copy)
    with arrived(1):
        refused(ErrorCode.CANCELLED, engine.store, rank, keys(3, "r"), [*STORED, 4, 5])
    [answer] = answers
    # The CANCEL was answered once the STORE had stopped: one request was copying.
    assert isinstance(answer, Future) and answer.done() and answer.result() == 1
    report = engine.report()
    assert (report.objects, report.pool_used_bytes, report.transfers_running) == (0, 0, 0)
    assert engine.lookup(keys(3, None, worker_id=None)) == 0


def test_a_retrieve_sent_before_a_cancel_loads_nothing_and_spends_its_leases(
        engine: EngineUnderTest) -> None:
    writer, reader = engine.register(1), engine.register(2, seed=None)
    engine.store(writer, keys(2, "s"))
    with arrived(1):
        assert engine.lookup(keys(2, "r", worker_id=None)) == 2
    with arrived(3):
        engine.handle[RequestType.CANCEL_TRANSFERS](reader.instance_id, ["r"])
    with arrived(2):
        assert engine.retrieve(reader, keys(2, "r")) == (False, "cancelled")
    assert not reader.pages(LANDED).any()
    assert engine.leases() == (0, 0) and engine.pinned() == 0


def test_only_the_registering_connection_may_cancel(engine: EngineUnderTest) -> None:
    rank = engine.register(1)  # registered outside a server: its connection is b""
    token = PEER.set(b"another connection")
    try:
        refused(ErrorCode.FORBIDDEN, engine.handle[RequestType.CANCEL_TRANSFERS], rank.instance_id, ["r"])
    finally:
        PEER.reset(token)
    assert engine.report().cancelled_transfers == 0
    assert engine.handle[RequestType.CANCEL_TRANSFERS](rank.instance_id, ["r"]) == 0
    assert engine.report().cancelled_transfers == 1


# ---- CLEAR -------------------------------------------------------------------------------------


def test_clear_drops_every_chunk_no_lease_holds(engine: EngineUnderTest) -> None:
    rank = engine.register(1)
    engine.store(rank, keys(3, "s"), [*STORED, 4, 5])
    assert engine.lookup(keys(1, "r", worker_id=None)) == 1  # r leases chunk 0
    assert engine.handle[RequestType.CLEAR]() == 2
    assert engine.report().objects == 1
    assert engine.lookup(keys(3, None, worker_id=None)) == 1
    assert engine.retrieve(rank, keys(1, "r")) == (True, "")  # the leased chunk survived
    assert engine.handle[RequestType.CLEAR]() == 1
    report = engine.report()
    assert (report.objects, report.pool_used_bytes) == (0, 0)
    assert engine.lookup(keys(1, "r", worker_id=None)) == 0
    ok, reason = engine.retrieve(rank, keys(1, "r"))
    assert not ok and "no longer stored" in reason


# ---- RESET_MODEL (more in tests/daemon/test_reset.py) ---------------------------------------------------


def test_a_store_that_arrived_before_a_reset_of_its_model_stores_nothing(engine: EngineUnderTest) -> None:
    """Read before the reset, run after it (the work queue's threads take requests in any order):
    its KV may be the old weights', so nothing of it is stored, and its worker has nothing to send
    again. One read after the reset is stored."""
    rank = engine.register(1)
    with arrived(5):
        reset = engine.handle[RequestType.RESET_MODEL](ModelScope([MODEL]))
    assert reset.ok and reset.pool_chunks == 0
    with arrived(4):
        assert engine.store(rank, keys(2, "s")) == [ALREADY, ALREADY]
    assert (engine.report().objects, engine.lookup(keys(2, None, worker_id=None))) == (0, 0)
    with arrived(6):
        assert engine.store(rank, keys(2, "s")) == [STORED_, STORED_]
    assert engine.lookup(keys(2, None, worker_id=None)) == 2
