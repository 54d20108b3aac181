"""The wire types are plain data. Neither they nor the CLI load torch; tensor handles keep their
extension codes and bytes; the CUDA-specific parts are testable without a GPU.

They import nothing of `transfer/` (no cycle with `transfer/cuda.py`, where exporting and
opening CUDA handles live); a CUDA handle is checked before anything is opened, and
one the daemon cannot open is refused once, naming the cause, never retried."""

from __future__ import annotations

import logging
import subprocess
import sys

import msgspec
import pytest
import torch

import vllm_adapter.registration as registration
from lmcache_mp.custom_types import (
    EXT_CUDA_IPC_WRAPPER,
    CudaIPCWrapper,
    IPCCacheEngineKey,
    KVCache,
    get_customized_decoder,
    get_customized_encoder,
)
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration, RequestType
from lmcache_mp.testing.blocks import BLOCK
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from lmcache_mp.transfer.cuda import (
    IPC_REQUIREMENTS,
    export_cuda_tensors,
    import_cuda_tensors,
    index_of_uuid,
)
from tests.support.helpers import ADAPTER_LOG, CUDA, HASH_KEY, SHM, TOKEN_KEY, register_requests, status
from vllm_adapter import LMCacheMPWorkerAdapter

CUDA_STATE = CUDA.state  # the same handles test_foundation.py round-trips

# The bytes these encoded to before the wire types became plain data (no torch): a daemon and a
# worker of either side of that change must still understand each other, so they must never change.
HANDLES_HEX = (
    "92c717029600cd1000a862666c6f61743136930204089320080100c76d0196a84750552d757569649800c440"
    + "00" * 64 + "cd040000c40372656600c403657674c3a7666c6f6174313692040492040100")
# Protocol 4 added `num_blocks` (a short chunk's blocks), the last element of every key.
HASH_KEY_HEX = "99a16d02c0c420" + "01" * 32 + "900000a57265712d3100"
TOKEN_KEY_HEX = "99a16d0100c400930102030003a17200"


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("command", [["ping", "--count", "2"], ["status", "--json"]])
def test_cli_talks_to_the_daemon_without_torch(daemon: DaemonProcess, command: list[str]) -> None:
    code = ("import sys\n"
            "from lmcache_mp.cli.main import main\n"
            "rc = main(sys.argv[1:])\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, f'the CLI loaded torch: {loaded[:5]}'\n"
            "sys.exit(rc)\n")
    out = _python(code, *command, "--url", daemon.url)
    assert out.returncode == 0, out.stderr
    assert "chunk size 256" in out.stdout or '"chunk_size": 256' in out.stdout


def test_wire_modules_load_no_torch() -> None:
    out = _python("import sys\n"
                  "import lmcache_mp.custom_types, lmcache_mp.protocol, lmcache_mp.mq\n"
                  "print('torch' in sys.modules, sorted(m for m in sys.modules if 'transfer' in m))\n")
    assert out.returncode == 0 and out.stdout.strip() == "False []", out.stdout + out.stderr
    # transfer/cuda.py imported first, in a fresh interpreter: it imports custom_types, which
    # imports nothing back (no cycle).
    out = _python("import lmcache_mp.transfer.cuda as c; print(c.export_cuda_tensors.__name__)")
    assert out.returncode == 0 and out.stdout.strip() == "export_cuda_tensors", out.stderr


def test_handle_and_key_encodings_are_pinned() -> None:
    cuda = CudaIPCWrapper(state=CUDA_STATE)
    encoded = get_customized_encoder().encode([SHM, cuda])
    assert encoded.hex() == HANDLES_HEX
    decoded = get_customized_decoder(KVCache).decode(encoded)
    assert decoded == [SHM, cuda] and decoded[1].state.device_uuid == "GPU-uuid"
    assert IPCCacheEngineKey.Serialize(HASH_KEY).hex() == HASH_KEY_HEX
    assert IPCCacheEngineKey.Serialize(TOKEN_KEY).hex() == TOKEN_KEY_HEX
    back = IPCCacheEngineKey.Deserialize(bytes.fromhex(HASH_KEY_HEX))
    assert back == HASH_KEY and back.request_id == "req-1"


def test_cuda_handle_from_a_state_round_trips_without_a_gpu() -> None:
    handle = CudaIPCWrapper(state=CUDA_STATE)
    assert CudaIPCWrapper.Deserialize(CudaIPCWrapper.Serialize(handle)) == handle
    enc, dec = get_customized_encoder(), get_customized_decoder(list[CudaIPCWrapper])
    [back] = dec.decode(enc.encode([handle]))
    assert back == handle and back.state == CUDA_STATE and back is not handle
    # A handle naming a device this process cannot see fails naming its UUID, and what CUDA IPC
    # needs of the deployment.
    with pytest.raises(ValueError, match="GPU-uuid") as info:
        import_cuda_tensors([back])
    assert IPC_REQUIREMENTS in str(info.value)


MALFORMED = "malformed CUDA storage handle"


def _cuda_handle(**changes: object) -> CudaIPCWrapper:
    return CudaIPCWrapper(state=msgspec.structs.replace(CUDA_STATE, **changes))


@pytest.mark.parametrize(("handle", "message"), [
    (_cuda_handle(storage_handle=CUDA_STATE.storage_handle[:7]), MALFORMED),
    (_cuda_handle(storage_handle=(0, None, 0, 0, b"ref", 0, b"evt", False)), MALFORMED),
    (_cuda_handle(storage_handle=(0, b"h", True, 0, b"ref", 0, b"evt", False)), MALFORMED),
    (_cuda_handle(storage_handle=(0, b"h", 1024, 0, b"ref", 0, b"evt", 1)), MALFORMED),
    (_cuda_handle(storage_handle=(0, b"h", 0, 0, b"ref", 0, b"evt", False)), "no storage"),
    (_cuda_handle(storage_handle=(0, b"h", 1024, -8, b"ref", 0, b"evt", False)), "no storage"),
    (_cuda_handle(shape=(32, 32), stride=(32, 1)), "overruns the 1024-byte storage"),  # 2 KiB of float16
    (_cuda_handle(storage_offset=505), "overruns"),  # 16 elements from element 505: past element 511
    (_cuda_handle(stride=(4, -1)), "invalid view"),
    (_cuda_handle(shape=(1 << 40, 1 << 40), stride=(0, 0)), "overruns"),
    (_cuda_handle(dtype="complex64"), "dtype"),
], ids=["short", "no-memory-handle", "bool-size", "int-sync", "empty", "negative-offset", "too-big",
        "offset-past-end", "negative-stride", "repeated-element", "unknown-dtype"])
def test_a_malformed_cuda_handle_is_refused_before_anything_is_opened(handle: CudaIPCWrapper,
                                                                      message: str) -> None:
    """The client's handle is checked as a shared-memory one is (the same view check), before CUDA is
    asked to open anything: a mistake in it is the client's, so the message says what, not the
    deployment hint that an import failure gets."""
    good = _cuda_handle()
    with pytest.raises(ValueError, match=message) as info:
        import_cuda_tensors([good, handle])
    assert IPC_REQUIREMENTS not in str(info.value)


def test_a_cuda_registration_the_daemon_cannot_open_is_refused_once(daemons, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that can't open a worker's CUDA handles (here: it sees no GPU; in containers: no shared
    PID namespace) refuses the REGISTER as INVALID_ARGUMENT, naming what CUDA IPC needs, and the
    worker does not try again (before: torch's error was INTERNAL, retried with backoff forever,
    each retry exporting every layer again). The worker's export is replaced (no GPU here to export
    from) by what it sends: one handle per layer, all of one storage."""
    port = free_port()
    daemon = daemons("--l1-size-gb", "0.05", "--metrics-port", str(port))
    layers = [_cuda_handle(storage_offset=16 * layer) for layer in range(4)]
    raw = MessageQueueClient(daemon.url, request_timeout_s=30)
    try:
        with pytest.raises(ServerError) as info:
            raw.submit(RequestType.REGISTER_KV_CACHE,
                       [1, layers, KVCacheRegistration("m", 1, 0, "FLASH_ATTN")]).result(30)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert "GPU-uuid" in info.value.message and IPC_REQUIREMENTS in info.value.message
    finally:
        raw.close()
    monkeypatch.setattr(registration, "export_kv_caches", lambda kv_caches: (list(layers), []))
    worker = LMCacheMPWorkerAdapter(daemon.url, None, "m", 1, 0, BLOCK, reregister_interval_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger=ADAPTER_LOG):
            with pytest.raises(ServerError) as info:
                worker.register_kv_caches({f"layer.{i}": torch.zeros(1) for i in range(4)}, "FLASH_ATTN")
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            # Refused for good: `ensure_registered` never tries again (nothing to wait out).
            assert worker.registration.refused and not worker.ensure_registered()
        assert register_requests(port) == 2  # the raw one and the worker's one
        errors = [r for r in caplog.records if r.name == ADAPTER_LOG and r.levelno >= logging.WARNING]
        assert len(errors) == 1 and errors[0].levelno == logging.ERROR
        assert IPC_REQUIREMENTS in errors[0].getMessage()
        assert status(daemon.url).registered_instances == []
        assert "Traceback" not in daemon.log()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("payload", [
    CudaIPCWrapper.Serialize(CudaIPCWrapper(state=CUDA_STATE))[:-3],  # truncated
    b"\xc1",  # not msgpack
    CudaIPCWrapper.Serialize(CudaIPCWrapper(state=CUDA_STATE)) + b"junk",  # trailing bytes
    msgspec.msgpack.encode(["GPU-uuid", [0], "float16", "4x4", [4, 1], 0]),  # shape not a tuple
    msgspec.msgpack.encode(["GPU-uuid", [0], "float16", [4, 4], [4, 1]]),  # a field missing
], ids=["truncated", "not-msgpack", "trailing-bytes", "wrong-type", "field-missing"])
def test_decoder_refuses_a_malformed_cuda_handle(payload: bytes) -> None:
    message = msgspec.msgpack.encode([msgspec.msgpack.Ext(EXT_CUDA_IPC_WRAPPER, payload)])
    with pytest.raises(msgspec.ValidationError, match="CudaIPCWrapper"):
        get_customized_decoder(list[CudaIPCWrapper]).decode(message)


def test_device_uuid_maps_to_this_processes_ordinal() -> None:
    # Two processes with CUDA_VISIBLE_DEVICES=0,1 and =1,0 see the same devices in another order.
    assert index_of_uuid("GPU-b", ["GPU-a", "GPU-b"]) == 1
    assert index_of_uuid("GPU-b", ["GPU-b", "GPU-a"]) == 0
    assert index_of_uuid("GPU-a", ["GPU-b", "GPU-a"]) == 1
    with pytest.raises(ValueError, match="GPU-c"):
        index_of_uuid("GPU-c", ["GPU-a", "GPU-b"])
    with pytest.raises(ValueError, match=r"GPU-a .*none"):
        index_of_uuid("GPU-a", [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_views_of_one_buffer_are_shared_and_opened_once() -> None:
    """As vLLM 0.32 allocates: one int8 buffer, a bfloat16 view per layer at its own offset. The
    buffer is exported once (one storage handle for both views) and opened once in the other
    process, whose views write where the worker's are."""
    buffer = torch.zeros(4096, dtype=torch.int8, device="cuda")
    layers = [buffer[i * 2048:(i + 1) * 2048].view(torch.bfloat16).view(8, 128) for i in range(2)]
    handles = export_cuda_tensors(layers)
    assert handles[0].state.storage_handle == handles[1].state.storage_handle
    assert [h.state.storage_offset for h in handles] == [0, 1024]
    payload = get_customized_encoder().encode(handles)
    code = ("import sys, torch\n"
            "from lmcache_mp.custom_types import KVCache, get_customized_decoder\n"
            "from lmcache_mp.transfer.cuda import import_cuda_tensors\n"
            "handles = get_customized_decoder(KVCache).decode(bytes.fromhex(sys.argv[1]))\n"
            "views = import_cuda_tensors(handles)\n"
            "assert [v.shape for v in views] == [(8, 128)] * 2, views\n"
            "assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()\n"
            "views[0].fill_(1)\n"
            "views[1].fill_(2)\n"
            "torch.cuda.synchronize()\n")
    out = _python(code, payload.hex(), timeout=120)
    assert out.returncode == 0, out.stderr
    torch.cuda.synchronize()
    assert layers[0].eq(1).all() and layers[1].eq(2).all()
