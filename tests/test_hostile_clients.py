"""What a careless or hostile client sends the daemon (issue 25 item 10 and minor items). A
real daemon; the clients speak the protocol by hand where they must do what no adapter does
(never read their replies, send keys no adapter builds)."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest
import zmq

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.launcher import DaemonProcess
from lmcache_mp.mq import Codec, MessageQueueClient
from lmcache_mp.protocol import ErrorCode, RequestType
from tests.helpers import CHUNK, refusal, status, wait_for, wait_for_status

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_replies_held_for_a_client_that_never_reads_are_bounded(daemon: DaemonProcess, worker_for) -> None:
    """Item 10: 100,000 replies were held for a client that sent requests and read none (+47 MiB
    in the daemon for one such connection). Now a few thousand at most; the rest are dropped."""
    worker_for(daemon.url)  # "m" registered: each LOOKUP_CHUNKS below is counted once handled
    requests = 100_000
    context = zmq.Context()
    hostile = context.socket(zmq.DEALER)
    hostile.setsockopt(zmq.RCVHWM, 1)  # its library stops reading replies at once
    hostile.setsockopt(zmq.SNDHWM, 0)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(daemon.url)
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
