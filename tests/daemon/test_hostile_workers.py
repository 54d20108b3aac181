"""What a careless or hostile worker hands the daemon with REGISTER_KV_CACHE. A real
daemon; the worker is this process, speaking the protocol by hand (the attach channel and
REGISTER as the adapter sends them), so that it can send what the adapter never would."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest

from lmcache_mp.custom_types import SharedMemoryTensor
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, KVCacheRegistration, RequestType
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.transfer.attach_channel import AttachChannel
from tests.support.helpers import status

SIZE = 256 << 20  # sparse: nothing is allocated unless someone touches it
PAGE = (2, 16, 64)  # a block's page: 2 heads x 16 tokens x 64 dims, bf16 (4 KiB)


def sealed_memfd(size: int = SIZE, seal: bool = True) -> int:
    fd = os.memfd_create("hostile-worker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def plain_file(size: int = SIZE) -> int:
    fd, path = tempfile.mkstemp(prefix="lmc-hostile-")
    os.unlink(path)
    os.ftruncate(fd, size)
    return fd


def pipe_end(size: int = SIZE) -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def handles(dtype: str = "bfloat16", size: int = SIZE) -> list[SharedMemoryTensor]:
    """Two layers of bf16 pages filling one storage of `size` bytes."""
    page = PAGE[0] * PAGE[1] * PAGE[2]  # elements
    blocks = size // 2 // (2 * page)
    return [SharedMemoryTensor(state=SharedMemoryTensor.State(
        storage_index=0, storage_nbytes=size, dtype=dtype, shape=(blocks, *PAGE),
        stride=(page, PAGE[1] * PAGE[2], PAGE[2], 1), storage_offset=i * blocks * page)) for i in range(2)]


@pytest.fixture
def register(daemon: DaemonProcess) -> Iterator[Callable[..., object]]:
    """register(fd, handles) -> the daemon's reply (raises its ServerError): `fd` goes over a fresh
    attach channel, as the adapter sends a cache; the channel stays open until the test ends."""
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    hello = client.handshake("hostile worker")
    channels: list[AttachChannel] = []

    def send(fd: int, layers: list[SharedMemoryTensor], model: str = "m", layout: str = "CPU_ATTN") -> object:
        channels.append(AttachChannel.open(hello.attach_socket, [fd]))
        os.close(fd)
        reg = KVCacheRegistration(model, 1, 0, layout, channels[-1].token)
        return client.submit(RequestType.REGISTER_KV_CACHE, [len(channels), layers, reg]).result(30)

    yield send
    for channel in channels:
        channel.close()
    client.close()


def refusal(register: Callable[..., object], fd: int, layers: list[SharedMemoryTensor], **names: str
            ) -> ServerError:
    with pytest.raises(ServerError) as refused:
        register(fd, layers, **names)
    return refused.value


@pytest.mark.parametrize("make", [plain_file, pipe_end, lambda: sealed_memfd(seal=False)],
                         ids=["plain file", "pipe", "memfd without seals"])
def test_memory_its_worker_could_shrink_is_refused(daemon: DaemonProcess, register, make) -> None:
    """A worker that shrank its file under the daemon's mapping, then sent a STORE, killed the
    daemon with SIGBUS; a descriptor that is no shared memory at all was answered
    INTERNAL. Now: only a memfd sealed against shrinking is mapped; the rest is a typed refusal."""
    error = refusal(register, make(), handles())
    assert error.code is ErrorCode.INVALID_ARGUMENT and "can shrink" in error.message, error
    assert status(daemon.url).registered_instances == []


def test_a_refused_registration_touches_none_of_its_memory(daemon: DaemonProcess, register) -> None:
    """A registration refused for its dtype had the daemon fault in the worker's whole
    (sparse) file, charged to the daemon. Validation comes first; a refused one maps nothing in."""
    fd = sealed_memfd()
    watch = os.dup(fd)
    try:
        error = refusal(register, fd, handles(dtype="complex64"))
        assert error.code is ErrorCode.INVALID_ARGUMENT and "dtype" in error.message, error
        # A good registration after it: its pages are built in the background, so once it has
        # been answered (and a STATUS after it), the refused one's would have started too.
        good = sealed_memfd(64 << 20)
        assert register(good, handles(size=64 << 20)) is not None
        assert status(daemon.url).registered_instances == [2]
        assert os.fstat(watch).st_blocks == 0  # not one page of the refused file was allocated
    finally:
        os.close(watch)


def test_a_view_with_more_elements_than_its_memory_is_refused(daemon: DaemonProcess, register) -> None:
    """A shape whose element count overflows (a zero stride repeating one element 2^80 times)
    was answered INTERNAL with a traceback."""
    layers = handles()
    for layer in layers:
        layer.state = SharedMemoryTensor.State(storage_index=0, storage_nbytes=SIZE, dtype="bfloat16",
                                               shape=(1 << 40, 1 << 40, 1, 64), stride=(0, 0, 64, 1),
                                               storage_offset=0)
    error = refusal(register, sealed_memfd(), layers)
    assert error.code is ErrorCode.INVALID_ARGUMENT and "overruns" in error.message, error
    assert "Traceback" not in daemon.log()


@pytest.mark.parametrize("seal", ["F_SEAL_WRITE", "F_SEAL_FUTURE_WRITE"])
def test_memory_sealed_against_writes_is_refused(daemon: DaemonProcess, register, seal: str) -> None:
    """A memfd sealed against writes cannot be mapped for the daemon's RETRIEVEs to write into:
    it was answered INTERNAL, with a traceback in the log."""
    fd = sealed_memfd()
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, getattr(fcntl, seal, 0x10))  # F_SEAL_FUTURE_WRITE: Linux 5.1
    error = refusal(register, fd, handles())
    assert error.code is ErrorCode.INVALID_ARGUMENT and "sealed against writes" in error.message, error
    assert status(daemon.url).registered_instances == []
    assert "Traceback" not in daemon.log()


@pytest.mark.parametrize(("field", "what"), [("model", "model name"), ("layout", "layout")])
def test_names_past_their_bound_are_refused(daemon: DaemonProcess, register, field: str, what: str) -> None:
    """A 1 MiB model name was registered: each STATUS reply was 1 MiB (queued per connection that
    does not read), and so was the registration's log line. A model name is 1 KiB at most, a
    layout 128 bytes (UTF-8), checked before anything is mapped."""
    error = refusal(register, sealed_memfd(), handles(), **{field: "x" * (1 << 20)})
    assert error.code is ErrorCode.INVALID_ARGUMENT, error
    assert f"a {what} of {1 << 20} bytes" in error.message and len(error.message) < 200, error
    report = status(daemon.url)
    assert report.registered_instances == [] and len(daemon.log()) < 64 << 10
    # At the bound: registered.
    assert register(sealed_memfd(64 << 20), handles(size=64 << 20), **{field: "é" * 64}) is not None
