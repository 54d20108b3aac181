"""What the lmcache door's tests share: LMCache's OWN client (lmcache 0.5.6's `MessageQueueClient`, made
by its `create_request_client`) sending the requests its vLLM connector sends, and KV caches in named
POSIX shared-memory segments made by LMCache's own CPU wrapper (`migrate_to_shm_and_wrap`), as its
connector makes them. Import it after `pytest.importorskip("lmcache", ...)`: it imports lmcache."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.rpc import get_rpc_spec
from lmcache.v1.multiprocess.transport.zmq_impl import create_request_client
from lmcache.v1.multiprocess.transport.zmq_impl.mq import msgspec_encode
from lmcache.v1.multiprocess.transport.zmq_impl.wire import encode_operation
from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap

from lmcache_mp.testing.launcher import DaemonProcess

CHUNK = 32
BLOCK = 16
BLOCKS, HEADS, WIDTH, LAYERS = 16, 2, 32, 2  # each layer [blocks, heads, block tokens, 2 * head size]
TOKENS = list(range(5000, 5100))
MODEL = "org/tiny"
TIMEOUT_S = 60
DOOR_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


class Caches:
    """A worker's KV caches as LMCache's connector hands them over on CPU: every layer a view of one
    buffer, moved into a shared-memory segment of this process by LMCache's own wrapper."""

    def __init__(self) -> None:
        storage = torch.zeros(LAYERS * BLOCKS * HEADS * BLOCK * WIDTH, dtype=torch.bfloat16)
        self.layers = [storage.view(LAYERS, BLOCKS, HEADS, BLOCK, WIDTH)[i] for i in range(LAYERS)]
        self.wrappers = [migrate_to_shm_and_wrap(layer) for layer in self.layers]
        self.name = self.wrappers[0].shm_name
        self.path = Path("/dev/shm") / self.name.lstrip("/")

    def register(self, client: Any, instance_id: int, world_size: int = 1) -> None:
        client.register_kv_cache(instance_id, self.wrappers, MODEL, world_size, EngineType.VLLM, {},
                                 [EngineGroupInfo(0, tuple(range(LAYERS)), BLOCK)]).result(TIMEOUT_S)

    def fill(self, blocks: slice, seed: int) -> None:
        """Random KV in `blocks` of every layer."""
        generator = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            count = len(range(*blocks.indices(BLOCKS)))
            layer[blocks].copy_(torch.randn(count, HEADS, BLOCK, WIDTH, generator=generator))

    def close(self) -> None:
        """Drop the tensors: LMCache's wrapper unmaps and unlinks the segment with its last view."""
        del self.layers, self.wrappers
        gc.collect()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def key(request_id: str, worker: int | None, start: int, end: int,
        tokens: list[int] = TOKENS, salt: str = "", world_size: int = 1) -> IPCCacheServerKey:
    return IPCCacheServerKey.from_token_ids(MODEL, world_size, worker, tokens, start, end, request_id, salt)


def lookup(client: Any, request_id: str, end: int, tokens: list[int] = TOKENS, salt: str = "",
           world_size: int = 1) -> int:
    """LMCache's scheduler's lookup: LOOKUP, then its prefetch status until it is known."""
    lookup_key = key(request_id, None, 0, end, tokens, salt, world_size)
    assert client.lookup(lookup_key, world_size).result(TIMEOUT_S) is None
    count = client.wait_prefetch_status(request_id, 10.0).result(TIMEOUT_S)
    assert count is not None
    return count


def client_frames(op: str, *args: Any, uid: int = 7) -> list[bytes]:
    """The frames lmcache's client sends for `op(*args)`, after the DEALER's identity: its RPC spec
    binds the arguments (defaults applied), its encoders write one frame each."""
    spec = get_rpc_spec(op)
    payloads = spec.bind_payloads(args, {})
    return [msgspec_encode(uid, int), encode_operation(op),
            *[msgspec_encode(p, cls) for p, cls in zip(payloads, spec.payload_types, strict=True)]]


def request_client(url: str) -> Any:
    return create_request_client(url, context=zmq.Context())


def raw_request(url: str, frames: list[bytes]) -> list[bytes]:
    """Send `frames` on a DEALER of its own; the reply's frames (a reply must come)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart(frames)
        assert sock.poll(TIMEOUT_S * 1000), f"no reply to {frames!r}"
        return sock.recv_multipart()
    finally:
        sock.close()
        context.term()


@pytest.fixture(name="door")
def door_fixture(daemons: Callable[..., DaemonProcess],
                 short_tmp: Path) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with the lmcache door on an ipc socket: (the daemon, the door's URL)."""
    url = f"ipc://{short_tmp / 'lmcache.sock'}"
    daemon = daemons("--lmcache-listen", url, *DOOR_ARGS)
    yield daemon, url
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log(), daemon.log()


@pytest.fixture(name="lmcache_client")
def lmcache_client_fixture(door: tuple[DaemonProcess, str]) -> Iterator[Any]:
    client = request_client(door[1])
    yield client
    client.close()


@pytest.fixture(name="caches")
def caches_fixture() -> Iterator[Caches]:
    made = Caches()
    yield made
    made.close()
