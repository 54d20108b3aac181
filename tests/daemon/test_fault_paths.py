"""Requests that fail part way, and clients under load, with the real daemon: a failed
RETRIEVE leaves no lease behind; a client's timeouts fire even while replies keep arriving."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from lmcache_mp.custom_types import IPCCacheEngineKey
from lmcache_mp.errors import RequestTimeoutError, ServerError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import ErrorCode, RequestType
from lmcache_mp.testing.blocks import BLOCK, CHUNK, NUM_BLOCKS, block_hashes
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.testing.servers import redis_server
from tests.support.helpers import lease, status, store

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_a_retrieve_that_fails_early_spends_its_leases(daemon: DaemonProcess, worker_for) -> None:
    worker = worker_for(daemon.url)
    client, iid = worker.mq_client, worker.instance_id
    hashes = block_hashes(list(range(3 * CHUNK)))[1::2]
    store(client, iid, hashes, "s")
    blocks = list(range(3 * CHUNK // BLOCK))
    keys = [IPCCacheEngineKey("m", 1, 0, chunk_hash=h, request_id="r") for h in hashes]
    other_model = [IPCCacheEngineKey("other", 1, 0, chunk_hash=h, request_id="r") for h in hashes]
    failures = [
        ([keys, iid + 12345, blocks, b""], ErrorCode.UNKNOWN_INSTANCE),
        ([keys, iid, [*blocks[:-1], NUM_BLOCKS], b""], ErrorCode.INVALID_ARGUMENT),  # a block out of range
        ([keys, iid, blocks[:-1], b""], ErrorCode.INVALID_ARGUMENT),  # too few block ids
        ([other_model, iid, blocks, b""], ErrorCode.INVALID_ARGUMENT),  # keys of another model
    ]
    for payload, code in failures:
        assert lease(client, hashes, "r") == 3
        assert status(daemon.url).leases == 3
        with pytest.raises(ServerError) as info:
            client.submit(RequestType.RETRIEVE, payload).result(10)
        assert info.value.code is code
        assert status(daemon.url).leases == 0, payload  # not pinned until END_SESSION or the TTL
    assert lease(client, hashes, "r") == 3  # the chunks are still there, and can be leased again


def test_timeouts_fire_while_other_replies_keep_arriving(tmp_path: Path, daemons, worker_for) -> None:
    """A LOOKUP stuck behind a hung lower tier (a SIGSTOPped Redis; the tier gives up after 5 s)
    times out on the client's schedule, although PING replies keep its socket busy throughout."""
    with redis_server(tmp_path) as server:
        daemon = daemons(*DAEMON_ARGS, "--l2", f"redis://{server.address}/0?timeout_s=5")
        worker_for(daemon.url)  # a registered worker: the LOOKUP asks the tier
        client = MessageQueueClient(daemon.url)
        stop = threading.Event()

        def chatter() -> None:
            while not stop.is_set():
                client.submit(RequestType.PING, [1], timeout_s=10).result(10)

        server.proc.send_signal(signal.SIGSTOP)
        talker = threading.Thread(target=chatter)
        try:
            talker.start()
            keys = [IPCCacheEngineKey("m", 1, None, chunk_hash=h) for h in block_hashes(list(range(CHUNK)))]
            started = time.monotonic()
            doomed = client.submit(RequestType.LOOKUP, [keys], timeout_s=0.3)
            assert doomed.wait(3), "the timeout never fired"
            assert time.monotonic() - started < 1.0
            assert isinstance(doomed.exception(), RequestTimeoutError)
        finally:
            stop.set()
            talker.join(15)
            server.proc.send_signal(signal.SIGCONT)
            client.close()
