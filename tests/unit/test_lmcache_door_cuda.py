"""The lmcache door's CUDA caches (`lmcache_mp/lmcache_door/cuda_caches.py`, `views.py`), every part a machine
without a GPU can run: descriptors encoded by lmcache 0.5.6's own client, vLLM 0.32's cache views
reordered by LMCache's own worker code, then turned back by the door. Opening the handles and the
copies themselves run on a GPU (`scripts/gpu/selftest_door.py`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcache_mp.lmcache_door import cuda_caches, wire
from lmcache_mp.lmcache_door.views import logical_view, token_dim
from lmcache_mp.testing.vllm_caches import allocate_like_vllm
from lmcache_mp.transfer.cuda import import_cuda_tensors
from lmcache_mp.transfer.layouts import describe_caches
from tests.support.helpers import LMCACHE_MISSING

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.kv_format.contiguity import attempt_permute_to_contiguous_view
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.platform.base.ipc_wire import CudaIPCData, RawCudaIPCData, TensorMetadata
from lmcache.v1.platform.devices.cuda.ipc_wrapper import CudaIPCWrapper, RawCudaIPCWrapper

from tests.support.lmcache_peer import client_frames

# vLLM's KVCacheLayout -> the kv_layout LMCache's connector sends for it.
KV_LAYOUT = {"LBNHC": "NHD", "LBHNC": "HND"}
UUID = "GPU-00000000-1111-2222-3333-444444444444"
# torch's `_share_cuda_` tuple: device, handle, storage bytes, offset, ref counter, slot, event, sync.
STORAGE_HANDLE = (0, b"h" * 64, 1 << 20, 0, b"/torch_ref", 3, b"e" * 64, True)


@pytest.mark.parametrize("case", [
    dict(layout="LBNHC", heads=8, block=16),  # vLLM's default on an H100: reordered by LMCache
    dict(layout="LBHNC", heads=8, block=16),  # contiguous already
    dict(layout="LBNHC", heads=16, block=16),  # as many heads as tokens: the strides tell them apart
    dict(layout="LBNHC", heads=1, block=16, mla=True),  # a latent head
    dict(layout="LBNHC", heads=4, block=32, kernel=16),  # blocks split into kernel blocks
    dict(layout="LBHNC", heads=2, block=32, kernel=16),
])
def test_the_door_sees_vllm_s_own_view_behind_lmcache_s_reordering(case: dict[str, Any]) -> None:
    block, kernel = case["block"], case.get("kernel")
    _, layers = allocate_like_vllm(3, 6, case["heads"], block, 8, torch.bfloat16, case["layout"],
                                   mla=case.get("mla", False), kernel_block_size=kernel)
    for seed, layer in enumerate(layers.values()):
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(seed)))
    vllm_views = list(layers.values())
    sent = [attempt_permute_to_contiguous_view(view) for view in vllm_views]  # what LMCache's worker sends
    seen = [logical_view(view, KV_LAYOUT[case["layout"]], block) for view in sent]
    for ours, theirs in zip(seen, vllm_views, strict=True):
        assert (ours.shape, ours.stride(), ours.storage_offset()) == (
            theirs.shape, theirs.stride(), theirs.storage_offset())
        assert torch.equal(ours, theirs)
    _, geometry = describe_caches(seen, "LMCACHE_CUDA", block)
    assert (geometry.block_size, geometry.num_blocks) == (block, 6)


def test_without_a_kv_layout_the_sizes_decide_where_they_cannot_be_wrong() -> None:
    with pytest.raises(ValueError, match="no kv_layout"):
        token_dim((12, 8, 4, 256), (8192, 1024, 256, 1), None, 16)  # kernel blocks of 8 tokens, or 4?
    assert token_dim((6, 16, 8, 256), (32768, 2048, 256, 1), None, 16) == 1  # the sizes tell
    with pytest.raises(ValueError, match="4-D"):
        token_dim((2, 6, 16, 8, 128), (1, 1, 1, 1, 1), "NHD", 16)


def _register_frames(wrappers: list[Any], hints: dict[str, Any]) -> list[bytes]:
    return client_frames("register_kv_cache", 7, wrappers, "org/model", 1, EngineType.VLLM, hints,
                         [EngineGroupInfo(0, (0, 1), 16)])


def test_lmcache_s_cuda_descriptors_become_our_own_handles() -> None:
    metadata = TensorMetadata(dtype="bfloat16", shape=(6, 16, 8, 256), stride=(32768, 2048, 256, 1),
                              storage_offset=4096, device_uuid=UUID)
    theirs = [CudaIPCWrapper.from_wire(CudaIPCData(version=1, metadata=metadata, handle=STORAGE_HANDLE))
              for _ in range(2)]
    request = wire.decode_request(_register_frames(theirs, {"kv_layout": "NHD"}))
    descriptors = request.args[1]
    assert cuda_caches.is_cuda(descriptors)
    ours = cuda_caches.wrappers(descriptors)
    state = ours[0].state
    assert (state.device_uuid, state.storage_handle, state.dtype, state.shape, state.stride,
            state.storage_offset) == (UUID, STORAGE_HANDLE, "bfloat16", (6, 16, 8, 256),
                                      (32768, 2048, 256, 1), 4096)
    # Our own checks accept them; only opening them needs the GPU this machine lacks.
    with pytest.raises(ValueError, match=r"cannot open the worker's CUDA memory: no visible CUDA device"):
        import_cuda_tensors(ours)


def test_lmcache_s_isolated_ipc_mode_is_refused_with_its_reason() -> None:
    metadata = TensorMetadata(dtype="bfloat16", shape=(4, 8), stride=(8, 1), storage_offset=0,
                              device_uuid=UUID)
    raw = RawCudaIPCWrapper.from_wire(RawCudaIPCData(version=1, metadata=metadata, ipc_handle=b"r" * 64,
                                                     alloc_offset=0, nbytes=64))
    descriptors = wire.decode_request(_register_frames([raw], {"kv_layout": "NHD"})).args[1]
    assert cuda_caches.is_cuda(descriptors)
    with pytest.raises(ValueError, match="isolated IPC"):
        cuda_caches.wrappers(descriptors)
    cuda_caches.check_event_handle(b"")  # nothing to wait for
    cuda_caches.check_event_handle(b"e" * 64)  # torch's interprocess event
    with pytest.raises(ValueError, match="isolated IPC"):
        cuda_caches.check_event_handle(b"t" * 80)  # a timeline-semaphore event
