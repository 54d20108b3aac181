"""Issue 11: the wire types are plain data. Neither they nor the CLI load torch; tensor handles
keep their extension codes and bytes; the CUDA-specific parts are testable without a GPU."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from lmcache_mp.custom_types import (
    EXT_CUDA_IPC_WRAPPER,
    CudaIPCWrapper,
    IPCCacheEngineKey,
    KVCache,
    get_customized_decoder,
    get_customized_encoder,
)
from lmcache_mp.launcher import DaemonProcess
from lmcache_mp.transfer.cuda import index_of_uuid
from tests.test_foundation import CUDA, HASH_KEY, SHM, TOKEN_KEY

CUDA_STATE = CUDA.state  # the same handles test_foundation.py round-trips

# The bytes these encoded to before issue 11: a daemon and a worker of either side of the
# change must still understand each other, so they must never change.
HANDLES_HEX = (
    "92c717029600cd1000a862666c6f61743136930204089320080100c76d0196a84750552d757569649800c440"
    + "00" * 64 + "cd040000c40372656600c403657674c3a7666c6f6174313692040492040100")
HASH_KEY_HEX = "98a16d02c0c420" + "01" * 32 + "900000a57265712d31"
TOKEN_KEY_HEX = "98a16d0100c400930102030003a172"


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("command", [["ping", "--count", "2"], ["status", "--json"]])
def test_cli_talks_to_the_daemon_without_torch(daemon: DaemonProcess, command: list[str]) -> None:
    code = ("import sys\n"
            "from lmcache_mp.cli import main\n"
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
                  "print('torch' in sys.modules)\n")
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
    # transfer/cuda.py imported first, in a fresh interpreter: no import cycle with custom_types.
    out = _python("import lmcache_mp.transfer.cuda as c; print(c.export_cuda_tensor.__name__)")
    assert out.returncode == 0 and out.stdout.strip() == "export_cuda_tensor", out.stderr


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
    # The seed's entry points reach transfer/cuda.py: a CPU tensor is refused there, and a
    # handle naming a device this process cannot see fails naming its UUID.
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        CudaIPCWrapper(torch.zeros(4))
    with pytest.raises(ValueError, match="needs a tensor or a state"):
        CudaIPCWrapper()
    with pytest.raises(ValueError, match="GPU-uuid"):
        back.to_tensor()


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
def test_cuda_handle_opens_in_another_process() -> None:
    base = torch.zeros(4, 8, device="cuda")
    payload = get_customized_encoder().encode(CudaIPCWrapper(base[1:3]))  # storage offset 8
    code = ("import sys, torch\n"
            "from lmcache_mp.custom_types import CudaIPCWrapper, get_customized_decoder\n"
            "view = get_customized_decoder(CudaIPCWrapper).decode(bytes.fromhex(sys.argv[1])).to_tensor()\n"
            "assert view.shape == (2, 8), view.shape\n"
            "view.fill_(7)\n"
            "torch.cuda.synchronize()\n")
    out = _python(code, payload.hex(), timeout=120)
    assert out.returncode == 0, out.stderr
    torch.cuda.synchronize()
    assert base[1:3].eq(7).all() and base[0].eq(0).all() and base[3].eq(0).all()
