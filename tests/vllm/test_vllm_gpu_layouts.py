"""The caches vLLM 0.32 registers on a GPU, through the CPU's shared-memory path.

vLLM 0.32 hands the connector per-layer 4-D views of one int8 buffer
(`lmcache_mp/testing/vllm_caches.py`, checked here against vLLM's own allocation). One real daemon
serves every case: worker A stores through the worker adapter, the scheduler adapter looks up, and
worker B, a second registration of a freshly allocated identical cache, retrieves into other blocks
(some ids -1) bit-exact.
MLA under tensor parallelism is stored once for every rank. Last, what the connector refuses.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import KVExportError, ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration, RequestType, StatusReport
from lmcache_mp.testing.kv_worker import wait_done
from lmcache_mp.testing.launcher import start_daemon
from lmcache_mp.testing.vllm_caches import LAYOUTS, allocate_like_vllm, block_pages
from tests.support.helpers import lookup, refusal, status, wait_for_status
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp, registration

CHUNK = 64  # the daemon's chunk: 4 blocks of 16 tokens, 2 of 32
NUM_BLOCKS, LAYERS, HEADS, HEAD_SIZE, LATENT = 24, 3, 2, 32, 576
CHUNKS = 3
DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


@dataclass(frozen=True)
class Case:
    backend: str  # vLLM's attention backend name, sent as the layout
    layout: str = "LBNHC"  # the physical KVCacheLayout
    mla: bool = False
    block_size: int = 16  # vLLM's
    kernel_block_size: int | None = None

    @property
    def ratio(self) -> int:
        return self.block_size // (self.kernel_block_size or self.block_size)

    def allocate(self, seed: int) -> dict[str, torch.Tensor]:
        """A cache as vLLM allocates it, every byte random (from `seed`)."""
        buffer, caches = allocate_like_vllm(LAYERS, NUM_BLOCKS, HEADS, self.block_size,
                                            LATENT if self.mla else HEAD_SIZE, torch.bfloat16, self.layout,
                                            self.mla, self.kernel_block_size)
        gen = torch.Generator().manual_seed(seed)
        buffer.copy_(torch.randint(-128, 128, buffer.shape, generator=gen, dtype=torch.int8))
        return caches


CASES = {
    "flash_attn_lbnhc": Case("FLASH_ATTN"),  # vLLM's default on an H100: non-contiguous views
    "flash_attn_lbhnc": Case("FLASH_ATTN", "LBHNC"),
    "triton_attn": Case("TRITON_ATTN"),
    "flex_attention": Case("FLEX_ATTENTION", "LBHNC"),
    "triton_mla": Case("TRITON_MLA", mla=True),
    "flash_attn_mla": Case("FLASH_ATTN_MLA", "LBHNC", mla=True),
    # FlashInfer's kernels take 16-token blocks: vLLM's 32-token blocks are 2 kernel blocks each.
    "flashinfer_kernel_blocks": Case("FLASHINFER", block_size=32, kernel_block_size=16),
}


def hashes_of(tokens: list[int], block_size: int) -> list[bytes]:
    """A vLLM-like chain of block hashes over full blocks of `block_size` tokens."""
    out, prev = [], b"none"
    for i in range(len(tokens) // block_size):
        prev = hashlib.sha256(prev + repr(tokens[i * block_size:(i + 1) * block_size]).encode()).digest()
        out.append(prev)
    return out


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """One daemon for the module (each case its own model name): a start per case would cost more
    than the case. With a disk tier, which the MLA test reads its chunks back from."""
    tmp = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    daemon = start_daemon(tmp, *DAEMON_ARGS, "--l2", f"disk://{tmp}/disk?size_gb=0.1")
    yield daemon.url
    daemon.stop(signal.SIGTERM)
    log = daemon.log()
    shutil.rmtree(tmp, ignore_errors=True)
    assert "Traceback" not in log, log


@pytest.fixture
def adapters() -> Iterator[list[Any]]:
    """Adapters a test made, shut down after it."""
    made: list[Any] = []
    yield made
    for adapter in made:
        adapter.shutdown()


def worker(made: list[Any], url: str, model: str, case: Case, caches: dict[str, torch.Tensor],
           world_size: int = 1, rank: int = 0, replicated: bool = False) -> LMCacheMPWorkerAdapter:
    """A worker adapter with these caches registered."""
    adapter = LMCacheMPWorkerAdapter(url, None, model, world_size, rank, case.block_size,
                                     replicated=replicated)
    made.append(adapter)
    adapter.register_kv_caches(caches, case.backend)
    return adapter


def scheduler(made: list[Any], url: str, model: str, case: Case,
              world_size: int = 1) -> LMCacheMPSchedulerAdapter:
    adapter = LMCacheMPSchedulerAdapter(url, None, model, world_size, 0, case.block_size)
    made.append(adapter)
    return adapter


def retrieve_and_check(reader: LMCacheMPWorkerAdapter, case: Case, request_id: str, hashes: list[bytes],
                       source: dict[str, torch.Tensor], source_ids: list[int],
                       target: dict[str, torch.Tensor], rng: random.Random) -> None:
    """RETRIEVE the chunks stored from `source_ids` into other blocks of `target`, the first and
    last block ids -1: the blocks named hold the source's pages bit-exact, every other block
    (the skipped ones included) its old bytes."""
    before = {name: layer.clone() for name, layer in target.items()}
    ids = rng.sample(range(NUM_BLOCKS), len(source_ids))
    ids[0] = ids[-1] = -1
    reader.submit_retrieve_request(request_id, LoadStoreOp(ids, block_hashes=hashes[:len(ids)]), None)
    wait_done(reader, request_id, retrieve=True)
    assert reader.take_failed_retrieves() == {}
    written = [b for b in ids if b >= 0]
    others = [b for b in range(NUM_BLOCKS) if b not in written]
    for name, layer in target.items():
        got = block_pages(layer, written, case.ratio)
        read = [s for s, b in zip(source_ids, ids, strict=True) if b >= 0]
        want = block_pages(source[name], read, case.ratio)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(block_pages(layer, others, case.ratio).view(torch.uint8),
                           block_pages(before[name], others, case.ratio).view(torch.uint8)), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_caches_store_lookup_retrieve(url: str, adapters: list[Any], name: str) -> None:
    case, rng, model = CASES[name], random.Random(name), f"model-{name}"
    tokens = [rng.randrange(1000) for _ in range(CHUNKS * CHUNK + 5)]  # and a partial tail
    hashes = hashes_of(tokens, case.block_size)
    stored = rng.sample(range(NUM_BLOCKS), CHUNKS * CHUNK // case.block_size)
    source = case.allocate(seed=rng.randrange(1 << 30))
    writer = worker(adapters, url, model, case, source)
    writer.submit_store_request("store", LoadStoreOp(stored, block_hashes=hashes[:len(stored)]), None)
    wait_done(writer, "store", retrieve=False)
    assert lookup(scheduler(adapters, url, model, case), "reader", block_hashes=hashes) == CHUNKS * CHUNK
    target = case.allocate(seed=rng.randrange(1 << 30))
    reader = worker(adapters, url, model, case, target)  # a second registration, of fresh caches
    retrieve_and_check(reader, case, "reader", hashes, source, stored, target, rng)
    assert status(url).leases == 0  # the retrieve spent its leases


def test_mla_is_stored_once_for_every_rank(url: str, adapters: list[Any]) -> None:
    """Under tensor parallelism every rank holds the same MLA latent KV: the pool and the disk tier
    hold one object per chunk, not one per rank; a LOOKUP reads it back from disk once for both
    ranks, each rank of another engine retrieves it, and so does an engine of the same model on
    one rank. Keys of another rank are still refused."""
    case, rng, model = CASES["triton_mla"], random.Random("mla-tp"), "model-mla-tp"
    tokens = [rng.randrange(1000) for _ in range(CHUNKS * CHUNK)]
    hashes = hashes_of(tokens, case.block_size)
    stored = rng.sample(range(NUM_BLOCKS), CHUNKS * CHUNK // case.block_size)
    source = case.allocate(seed=7)
    ranks = [worker(adapters, url, model, case, case.allocate(seed=7), 2, rank, replicated=True)
             for rank in range(2)]
    def on_disk(report: StatusReport) -> int | None:
        return None if report.tiers[0].write_queue_chunks else report.tiers[0].objects

    disk = on_disk(wait_for_status(url, lambda r: on_disk(r) is not None, "earlier chunks on disk"))
    objects = status(url).objects
    for rank, adapter in enumerate(ranks):
        adapter.submit_store_request("store", LoadStoreOp(stored, block_hashes=hashes), None)
        wait_done(adapter, "store", retrieve=False)
        assert status(url).objects == objects + CHUNKS, f"after rank {rank}'s store"
    wait_for_status(url, lambda r: on_disk(r) == disk + CHUNKS, "one disk object per chunk")

    client = MessageQueueClient(url)
    try:
        client.submit(RequestType.CLEAR, []).result(10)
        assert status(url).objects == 0  # L1 is empty: the chunks are on disk only
        tp2 = scheduler(adapters, url, model, case, world_size=2)
        assert lookup(tp2, "tp2", block_hashes=hashes) == CHUNKS * CHUNK  # read from disk
        assert status(url).objects == CHUNKS
        assert status(url).leases == 2 * CHUNKS  # one object per chunk, a lease on it per rank
        keys = [IPCCacheEngineKey(model, 2, 0, chunk_hash=hashes[1])]  # rank 0's key, to rank 1
        refused = refusal(client, RequestType.STORE, [keys, ranks[1].instance_id, [0, 1, 2, 3], b""])
        assert refused.code is ErrorCode.INVALID_ARGUMENT and "keys of worker 0" in refused.message
    finally:
        client.close()
    for rank in range(2):  # a fresh engine's ranks: each RETRIEVE spends its own rank's leases
        target = case.allocate(seed=20 + rank)
        reader = worker(adapters, url, model, case, target, 2, rank, replicated=True)
        retrieve_and_check(reader, case, "tp2", hashes, source, stored, target, rng)
        # Rank 1's chunks stay pinned until it has read them: evicting them between the two
        # RETRIEVEs would fail rank 1's load.
        assert status(url).leases == (CHUNKS if rank == 0 else 0)

    target = case.allocate(seed=30)
    reader = worker(adapters, url, model, case, target, replicated=True)  # an engine on one rank
    assert lookup(scheduler(adapters, url, model, case), "tp1", block_hashes=hashes) == CHUNKS * CHUNK
    retrieve_and_check(reader, case, "tp1", hashes, source, stored, target, rng)
    assert status(url).objects == CHUNKS


def test_register_refuses_what_it_cannot_read(url: str, adapters: list[Any]) -> None:
    """Caches whose blocks are not whole groups of vLLM's, an MLA name on caches of several heads,
    and a replicated cache that is not MLA are refused at REGISTER, saying why (never a cache
    that fails every operation, or serves one rank's KV to another)."""
    odd = Case("FLASHINFER", block_size=32, kernel_block_size=16)
    refusals = [
        # 49 kernel blocks of 16 tokens are no whole number of vLLM's 32-token blocks.
        (odd, allocate_like_vllm(LAYERS, 49, HEADS, 16, HEAD_SIZE, torch.bfloat16)[1], False,
         "not whole groups of this cache's 49 kernel blocks of 16 tokens"),
        # vLLM's blocks smaller than the cache's.
        (Case("FLASH_ATTN"), allocate_like_vllm(LAYERS, 8, HEADS, 32, HEAD_SIZE, torch.bfloat16)[1], False,
         "blocks of 16 tokens"),
        (Case("TRITON_MLA"), Case("FLASH_ATTN").allocate(seed=1), False, "one latent head"),
        (Case("FLASH_ATTN"), Case("FLASH_ATTN").allocate(seed=1), True, "only MLA caches"),
    ]
    for case, caches, replicated, why in refusals:
        adapter = LMCacheMPWorkerAdapter(url, None, "model-refused", 1, 0, case.block_size,
                                         replicated=replicated)
        adapters.append(adapter)
        with pytest.raises(ServerError) as refused:
            adapter.register_kv_caches(caches, case.backend)
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT and why in refused.value.message
        # Refused for good: offload off, never retried.
        assert adapter.registration.refused and not adapter.ensure_registered()


def test_worker_refuses_a_daemon_that_reads_other_blocks(url: str, adapters: list[Any],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that predates `KVCacheRegistration.block_size` takes a kernel-block split cache's
    kernel blocks for vLLM's blocks, and would refuse every STORE and RETRIEVE (other block ids
    per chunk). The worker sees it in the reply and turns offload off with one ERROR. The real
    daemon plays that one: the registration it gets is sent without the field, as such a
    worker's was (and as such a daemon would ignore it)."""
    def without_block_size(*args: Any, **fields: Any) -> KVCacheRegistration:
        return KVCacheRegistration(*args, **{**fields, "block_size": 0})

    monkeypatch.setattr(registration, "KVCacheRegistration", without_block_size)
    case = CASES["flashinfer_kernel_blocks"]
    adapter = LMCacheMPWorkerAdapter(url, None, "model-old-daemon", 1, 0, case.block_size)
    adapters.append(adapter)
    with caplog.at_level(logging.ERROR, logger="vllm_adapter"), pytest.raises(KVExportError):
        adapter.register_kv_caches(case.allocate(seed=1), case.backend)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "blocks of 16 tokens, vLLM's are 32 tokens" in errors[0]
    assert adapter.registration.refused and not adapter.ensure_registered()
    assert adapter.instance_id not in status(url).registered_instances  # withdrawn from the daemon


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["attention", "mla", "kernel_blocks"])
def test_caches_are_allocated_as_vllm_allocates_them(layout: str, kind: str) -> None:
    """`allocate_like_vllm` against vLLM 0.32's own `allocate_kv_cache` for the same specs: every
    view's shape, strides, storage offset and dtype, and the buffer's size."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    block_size, kernel = (32, 16) if kind == "kernel_blocks" else (16, None)
    mla = kind == "mla"
    head_size = LATENT if mla else HEAD_SIZE
    if mla:
        spec: FullAttentionSpec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size,
                                                   dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=head_size,
                                 dtype=torch.bfloat16)
    vllm_layout = KVCacheLayout[layout]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # Planned as vLLM's `get_kv_cache_config_from_groups` plans one group of one spec.
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, vllm_layout)
    tensor = KVCacheTensor(size=LAYERS * NUM_BLOCKS * spec.page_size_bytes, layers=names,
                           layer_stride=layer_stride, block_stride=block_stride)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    theirs = allocate_kv_cache(config, torch.device("cpu"), vllm_layout,
                               kernel_block_sizes=None if kernel is None else [kernel])
    buffer, ours = allocate_like_vllm(LAYERS, NUM_BLOCKS, HEADS, block_size, head_size, torch.bfloat16,
                                      layout, mla, kernel)
    assert list(ours) == list(theirs) == names
    assert buffer.nbytes == tensor.size
    for name in names:
        a, b = ours[name], theirs[name]
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(),
                                                                     b.dtype), name
        assert b.untyped_storage().nbytes() == tensor.size


def _connector_config(kv_cache_config: Any, use_mla: bool = False, tp: int = 1, pp: int = 1) -> Any:
    """What `LMCacheMPDaemonConnector` reads of vLLM's config (stand-ins for its fields)."""
    parallel = SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size=tp * pp, rank=0)
    model = SimpleNamespace(model="m", revision=None, code_revision=None, model_weights="",
                            dtype=torch.bfloat16, quantization=None, use_mla=use_mla,
                            hf_config=SimpleNamespace(to_dict=dict))
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
                           model_config=model, parallel_config=parallel,
                           load_config=SimpleNamespace(load_format="auto", download_dir=None),
                           device_config=SimpleNamespace(device_type="cpu"))


@pytest.fixture
def own_logging() -> Iterator[None]:
    """The connector hands our loggers to vLLM's handlers (and stops their propagation): undone
    after the test, so that later tests' caplog still sees them."""
    saved = [(lg, list(lg.handlers), lg.propagate, lg.level)
             for lg in map(logging.getLogger, ("vllm_adapter", "lmcache_mp"))]
    yield
    for lg, handlers, propagate, level in saved:
        lg.handlers[:] = handlers
        lg.propagate = propagate
        lg.setLevel(level)


def test_connector_is_inert_when_vllm_zeros_new_blocks(own_logging: None) -> None:
    """With mixed-precision caches vLLM zeros each step's new blocks on its stream,
    unordered against the connector's loads and stores: no hits, no stores, one warning."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from vllm_adapter.connector import LMCacheMPDaemonConnector

    specs = [FullAttentionSpec(block_size=16, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
             for dtype in (torch.bfloat16, torch.float16)]
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups,
                           hash_block_size=16)
    assert config.needs_kv_cache_zeroing
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logging.getLogger("vllm_adapter.connector").addHandler(handler)
    try:
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            connector = LMCacheMPDaemonConnector(_connector_config(config), role, config)
            request = SimpleNamespace(request_id="r", num_tokens=4 * CHUNK)
            assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
            assert connector.request_finished(request, [0, 1]) == (False, None)
            assert connector.get_mem_pool_context() is None  # the cache is allocated as vLLM would
            connector.register_kv_caches(CASES["flash_attn_lbnhc"].allocate(seed=1))  # not registered
            connector.shutdown()
    finally:
        logging.getLogger("vllm_adapter.connector").removeHandler(handler)
    warnings = [r.getMessage() for r in seen if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("zeros new KV cache blocks" in w for w in warnings)


def test_replicated_only_for_mla_under_tensor_parallelism_alone() -> None:
    """Which engines register their caches as the same on every rank (`replicated_kv`)."""
    pytest.importorskip("vllm")
    from vllm_adapter.connector import replicated_kv

    def replicated(use_mla: bool, tp: int, pp: int = 1, replicas: int | None = None) -> bool:
        kv = SimpleNamespace(kv_tp_replicas=tp if replicas is None else replicas)
        return replicated_kv(_connector_config(kv, use_mla, tp, pp), kv)  # type: ignore[arg-type]

    assert replicated(use_mla=True, tp=2) and replicated(use_mla=True, tp=1)
    assert not replicated(use_mla=False, tp=2)
    assert not replicated(use_mla=True, tp=2, pp=2)  # pipeline stages hold other layers
    assert not replicated(use_mla=True, tp=4, replicas=1)  # vLLM says the ranks differ
