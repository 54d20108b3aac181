"""What a careless or hostile client sends the daemon. A real daemon; the clients speak the
protocol by hand where they must do what no adapter does (never read their replies, send keys no
adapter builds)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from lmcache_mp.custom_types import MAX_MODEL_NAME_CHARS, MAX_REQUEST_ID_CHARS, IPCCacheEngineKey
from lmcache_mp.errors import ServerError
from lmcache_mp.mq import Codec, MessageQueueClient
from lmcache_mp.mq.server import PEER_REPLY_BYTES
from lmcache_mp.protocol import ErrorCode, RequestType, TailHit, TailNote
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import refusal, status, wait_for, wait_for_status
from vllm_adapter import LMCacheMPWorkerAdapter

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")



def non_reading_dealer(context: zmq.Context, url: str) -> zmq.Socket:
    """A DEALER on `url` that sends without bound and whose library stops reading replies at once."""
    hostile = context.socket(zmq.DEALER)
    hostile.setsockopt(zmq.RCVHWM, 1)
    hostile.setsockopt(zmq.SNDHWM, 0)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(url)
    return hostile

@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_replies_held_for_a_client_that_never_reads_are_bounded(daemon: DaemonProcess, worker_for) -> None:
    """100,000 replies were held for a client that sent requests and read none (+47 MiB
    in the daemon for one such connection). Now a few thousand at most; the rest are dropped."""
    worker_for(daemon.url)  # "m" registered: each LOOKUP_CHUNKS below is counted once handled
    requests = 100_000
    context = zmq.Context()
    hostile = non_reading_dealer(context, daemon.url)
    try:
        before = status(daemon.url)
        rss_before = rss_mib(daemon.proc.pid)
        request_type = msgspec.msgpack.encode(int(RequestType.LOOKUP_CHUNKS))
        payload = Codec().encoder.encode(["m", 1, None, [b"h" * 32]])
        for i in range(requests):
            hostile.send_multipart([struct.pack("<Q", i), request_type, payload])
        wait_for_status(daemon.url, lambda r: r.lookup_chunks_total >= before.lookup_chunks_total + requests,
                        "every request handled", timeout_s=300)
        grown = rss_mib(daemon.proc.pid) - rss_before
        assert grown < 16, f"the daemon grew {grown:.1f} MiB holding replies nobody reads"
    finally:
        hostile.close()
        context.term()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_negative_token_position_is_a_typed_refusal(daemon: DaemonProcess, client: MessageQueueClient,
                                                       worker_for) -> None:
    """A token key with a negative `start` was answered INTERNAL with a traceback on LOOKUP, and
    accepted by STORE. It is refused as it is decoded."""
    worker = worker_for(daemon.url)
    key = IPCCacheEngineKey("m", 1, None, token_ids=tuple(range(2 * CHUNK)), start=-CHUNK, end=CHUNK)
    assert refusal(client, RequestType.LOOKUP, [[key]]).code is ErrorCode.BAD_PAYLOAD
    store_key = IPCCacheEngineKey("m", 1, 0, token_ids=tuple(range(2 * CHUNK)), start=-CHUNK, end=CHUNK,
                                  request_id="r")
    error = refusal(worker.mq_client, RequestType.STORE, [[store_key], worker.instance_id, [0, 1], b""])
    assert error.code is ErrorCode.BAD_PAYLOAD and ">= 0" in error.message, error
    assert status(daemon.url).objects == 0
    assert "Traceback" not in daemon.log()


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_huge_hello_name_is_refused_and_a_long_one_logged_short(daemon: DaemonProcess) -> None:
    """A HELLO's client name was logged at any length (64 MiB lines)."""
    client = MessageQueueClient(daemon.url)
    try:
        error = refusal(client, RequestType.HELLO, [1, "x" * (1 << 20)])
        assert error.code is ErrorCode.BAD_PAYLOAD and "limit" in error.message, error
        client.submit(RequestType.HELLO, [1, "y" * 3000]).result(10)  # an old protocol: logged
    finally:
        client.close()
    warned = [line for line in daemon.log().splitlines() if "speaks protocol 1" in line]
    assert len(warned) == 1 and len(warned[0]) < 400, warned


def kv_memory_held(pid: int) -> int:
    """Mappings of workers' KV memfds in the daemon."""
    return sum("memfd:lmcache-mp-kv" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_refused_request_about_a_worker_keeps_nothing_of_it(daemon: DaemonProcess, worker_for) -> None:
    """A FORBIDDEN answer (another connection naming a worker's instance) kept that worker's
    cache mapped in the daemon after it unregistered: the error's traceback held the
    registration in a reference cycle, freed only whenever the cycle collector ran."""
    victim, other = worker_for(daemon.url, seed=1), worker_for(daemon.url, seed=2)
    for request_type, payload in ((RequestType.CANCEL_TRANSFERS, [victim.instance_id, ["r"]]),
                                  (RequestType.UNREGISTER_KV_CACHE, [victim.instance_id])):
        assert refusal(other.mq_client, request_type, payload).code is ErrorCode.FORBIDDEN
    assert kv_memory_held(daemon.proc.pid) > 0
    victim.shutdown()
    other.shutdown()
    wait_for_status(daemon.url, lambda r: not r.registered_instances, "both workers gone")
    # Unmapped as the registration's last reference goes, a moment after STATUS stops listing it.
    wait_for(lambda: not kv_memory_held(daemon.proc.pid), "the workers' caches unmapped", timeout_s=5)


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize("keys", [[], [IPCCacheEngineKey("m", 1, 0, token_ids=(1, 2, 3), start=0, end=3,
                                                          request_id="r")]],
                         ids=["no keys", "a token range shorter than a chunk"])
def test_a_store_of_no_chunk_is_a_typed_refusal(daemon: DaemonProcess, worker_for, keys) -> None:
    """A STORE whose keys name no chunk was answered INTERNAL, with a traceback in the log."""
    worker = worker_for(daemon.url)
    error = refusal(worker.mq_client, RequestType.STORE, [keys, worker.instance_id, [], b""])
    assert error.code is ErrorCode.INVALID_ARGUMENT and "no chunk" in error.message, error
    assert status(daemon.url).objects == 0
    assert "Traceback" not in daemon.log()


def cancel(worker: LMCacheMPWorkerAdapter, request_ids: list[str]) -> int:
    """A raw CANCEL_TRANSFERS of the worker's instance, on its own connection (the owner's)."""
    return worker.mq_client.submit(RequestType.CANCEL_TRANSFERS, [worker.instance_id, request_ids]).result(30)


def fill_cancel_record(worker: LMCacheMPWorkerAdapter, size: int = 8192) -> int:
    """Cancel new requests of the worker's instance until not even one more is taken (OVERLOADED);
    how many were."""
    taken = 0
    while size:
        try:
            cancel(worker, [f"{worker.instance_id}-{taken + i}" for i in range(size)])
            taken += size
        except ServerError as err:
            assert err.code is ErrorCode.OVERLOADED, err
            size //= 2
    return taken


# Cancels are kept 2 x the queue deadline + 1 s: long enough that none expires during the test.
@pytest.mark.daemon_args(*DAEMON_ARGS, "--queue-deadline-s", "300")
def test_instances_filling_the_cancel_record_leave_another_worker_its_cancels(daemon: DaemonProcess,
                                                                            worker_for) -> None:
    """A client with 8 instances of its own filled the cancelled-transfer record (8 x 8,192) and
    renewed it: a victim's CANCEL_TRANSFERS got OVERLOADED 30 times out of 30, and its worker kept
    the blocks held. Now each registered instance has a reserve of its own."""
    hostile = [worker_for(daemon.url, seed=seed) for seed in range(2, 12)]
    taken = [fill_cancel_record(worker) for worker in hostile]
    assert taken[-1] < 8192, taken  # full: the last instance could not take all it asked for
    victim = worker_for(daemon.url, seed=1)
    assert cancel(victim, [f"victim-{i}" for i in range(16)]) == 0
    assert status(daemon.url).cancelled_transfers == sum(taken) + 16


LONG_ID = "r" * (MAX_REQUEST_ID_CHARS + 1)
LONG_MODEL = "m" * (MAX_MODEL_NAME_CHARS + 1)


@pytest.mark.daemon_args(*DAEMON_ARGS)
@pytest.mark.parametrize(("request_type", "payload"), [
    (RequestType.LOOKUP, [[IPCCacheEngineKey("m", 1, None, chunk_hash=b"h" * 32, request_id=LONG_ID)]]),
    (RequestType.LOOKUP, [[IPCCacheEngineKey(LONG_MODEL, 1, None, chunk_hash=b"h" * 32)]]),
    (RequestType.LOOKUP_CHUNKS, [LONG_MODEL, 1, "r", [b"h" * 32]]),
    (RequestType.LOOKUP_CHUNKS, ["m", 1, LONG_ID, [b"h" * 32]]),
    (RequestType.LOOKUP_PREFIX, ["m", 1, LONG_ID, [b"h" * 32], []]),
    (RequestType.NOTE_TAILS, [LONG_MODEL, 1, [TailNote(b"", TailHit(1, 1, b"t"))], []]),
    (RequestType.END_SESSION, [LONG_ID]),
    (RequestType.CANCEL_TRANSFERS, [1, [LONG_ID]]),
], ids=["LOOKUP request id", "LOOKUP model", "LOOKUP_CHUNKS model", "LOOKUP_CHUNKS request id",
        "LOOKUP_PREFIX request id", "NOTE_TAILS model", "END_SESSION", "CANCEL_TRANSFERS"])
def test_names_and_ids_a_client_sends_are_bounded(daemon: DaemonProcess, client: MessageQueueClient,
                                                  request_type: RequestType, payload: list) -> None:
    """Request ids and model names are kept in the daemon's tables (65,536 sessions, the cancelled
    transfers, 262,144 tails) and went in at any length (up to the payload's limit, 4 MiB). They
    are bounded as they are decoded: 256 and 1,024 characters."""
    error = refusal(client, request_type, payload)
    assert error.code is ErrorCode.BAD_PAYLOAD and "length <=" in error.message, error
    report = status(daemon.url)
    assert (report.sessions, report.tails_indexed, report.cancelled_transfers) == (0, 0, 0)


@pytest.fixture
def named_workers() -> Iterator[Callable[[str, str, int], list[LMCacheMPWorkerAdapter]]]:
    """named_workers(url, model, count): registered workers of a model of that name."""
    made: list[LMCacheMPWorkerAdapter] = []

    def make(url: str, model: str, count: int) -> list[LMCacheMPWorkerAdapter]:
        for seed in range(count):
            made.append(LMCacheMPWorkerAdapter(url, None, model, 1, 0, BLOCK))
            made[-1].register_kv_caches(make_caches(SHAPE, torch.bfloat16, LAYERS, seed=seed), "CPU_ATTN")
        return made[-count:]

    yield make
    for worker in made:
        worker.shutdown()


def test_reply_bytes_held_for_a_client_that_never_reads_are_bounded(daemons, named_workers) -> None:
    """2,048 replies were held for a connection that reads none, whatever their size: 2,048
    STATUS replies of 1 MiB each (a 1 MiB model name) held 2 GiB. Now the large replies a
    connection has not read are bounded in bytes; past that bound the daemon answers OVERLOADED
    (small). Here 16 workers of a 1,000-character model make each STATUS ~20 KiB."""
    port = free_port()
    daemon = daemons(*DAEMON_ARGS, "--metrics-port", str(port))
    named_workers(daemon.url, "x" * 1000, 16)
    requests = 2000
    context = zmq.Context()
    hostile = non_reading_dealer(context, daemon.url)
    try:
        handled = status_requests(port)
        status_type = msgspec.msgpack.encode(int(RequestType.STATUS))
        payload = Codec().encoder.encode([])
        for i in range(requests):
            hostile.send_multipart([struct.pack("<Q", i), status_type, payload])
        wait_for(lambda: status_requests(port) >= handled + requests, "every STATUS handled",
                 timeout_s=300)
        replies = [hostile.recv_multipart() for _ in range(requests)]  # read at last
    finally:
        hostile.close()
        context.term()
    sent = [(Codec().decode_status(reply[1]), len(reply[2])) for reply in replies]
    answered = sum(size for code, size in sent if code == ErrorCode.OK)
    assert answered > 16 * 1000, "no STATUS answered"
    # What the daemon held for the connection, and what the socket's kernel buffers and the
    # client's library took meanwhile (a reply's worth, and a few socket buffers at most).
    socket_buffer = int(Path("/proc/sys/net/core/wmem_default").read_text())
    assert answered < PEER_REPLY_BYTES + 4 * socket_buffer + (1 << 20), f"{answered} bytes of STATUS held"
    assert {code for code, _ in sent} == {ErrorCode.OK, ErrorCode.OVERLOADED}
    assert "Traceback" not in daemon.log()


def status_requests(port: int) -> float:
    """STATUS requests the daemon has answered, whatever the answer."""
    return sum(value for series, value in scrape(port).items()
               if series.startswith("lmcache_mp_requests_total{") and 'type="STATUS"' in series)
