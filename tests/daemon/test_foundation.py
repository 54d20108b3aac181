"""Wire protocol, message queue, daemon process and CLI, against the real daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from lmcache_mp.chunks import TierCleared
from lmcache_mp.custom_types import (
    CudaIPCWrapper,
    IPCCacheEngineKey,
    get_customized_decoder,
    get_customized_encoder,
)
from lmcache_mp.distributed.api import MemoryLayoutDesc, ObjectKey, ipc_keys_to_object_keys
from lmcache_mp.errors import ProtocolMismatchError, RequestTimeoutError, ServerError
from lmcache_mp.kv_events.log import CLEARED, STORED, ChunkEvent, EventsReply
from lmcache_mp.mq import REQUEST_ID, Codec, MessageQueueClient
from lmcache_mp.protocol import (
    PROTOCOL,
    PROTOCOL_VERSION,
    ChunkOutcome,
    ErrorCode,
    HelloReply,
    InstanceInfo,
    KVCacheRegistration,
    ModelReset,
    ModelScope,
    PrefixHit,
    RegisterReply,
    RequestType,
    RetrieveResult,
    StatusReport,
    StoreResult,
    TailHit,
    TailNote,
)
from lmcache_mp.testing.launcher import DaemonProcess, start_daemon
from tests.support.helpers import CUDA, HASH_KEY, SHM, TOKEN_KEY

# One example payload per request type, and one example reply per reply type.
PAYLOADS = {
    RequestType.HELLO: [PROTOCOL_VERSION, "tests"],
    RequestType.PING: [7],
    RequestType.GET_CHUNK_SIZE: [],
    RequestType.STATUS: [],
    RequestType.REGISTER_KV_CACHE: [1, [SHM, CUDA], KVCacheRegistration("m", 1, 0, "CPU_ATTN", b"t")],
    RequestType.UNREGISTER_KV_CACHE: [1],
    RequestType.LOOKUP: [[HASH_KEY, TOKEN_KEY]],
    RequestType.STORE: [[HASH_KEY], 1, [0, 1], b""],
    RequestType.RETRIEVE: [[TOKEN_KEY], 1, [3, 4], b"evt"],
    RequestType.END_SESSION: ["req-1"],
    RequestType.CLEAR: [],
    RequestType.CLEAR_TIERS: [],
    RequestType.RELEASE_LEASES: [[HASH_KEY, TOKEN_KEY]],
    RequestType.LOOKUP_CHUNKS: ["m", 2, "req-1", [b"\x01" * 32, b"\x02" * 32]],
    RequestType.CANCEL_TRANSFERS: [1, ["req-1", "req-2"]],
    RequestType.KV_EVENTS: [12, ["m"], 4096],
    RequestType.LOOKUP_PREFIX: ["m", 2, "req-1", [b"\x01" * 32], [b"\x05" * 32]],
    RequestType.NOTE_TAILS: ["m", 2, [TailNote(b"\x01" * 32, TailHit(40, 3, b"\x03" * 32, b"\x05" * 32))],
                             [TailNote(b"", TailHit(7, 1, b"\x04" * 32))]],
    RequestType.RESET_MODEL: [ModelScope(["m@0123456789abcdef", "m@0123456789abcdef#sliding-0"])],
}
REPLIES = {
    RequestType.HELLO: HelloReply(PROTOCOL_VERSION, "0.1.0", 256, "/tmp/x.attach"),
    RequestType.PING: 7,
    RequestType.GET_CHUNK_SIZE: 256,
    RequestType.STATUS: StatusReport("0.1.0", 1, 1.5, 256, ["ipc:///x"], registered_instances=[3],
                                     instances=[InstanceInfo(3, "m", 2, 1, "CPU_ATTN", 4, 16, 1 << 20)]),
    RequestType.REGISTER_KV_CACHE: RegisterReply("CPU_ATTN", 2, 16, 32, 65536),
    RequestType.UNREGISTER_KV_CACHE: True,
    RequestType.LOOKUP: 3,
    RequestType.STORE: StoreResult(b"", [ChunkOutcome.STORED, ChunkOutcome.NO_SPACE]),
    RequestType.RETRIEVE: RetrieveResult(b"", False, "lease expired"),
    RequestType.END_SESSION: None,
    RequestType.CLEAR: 5,
    RequestType.CLEAR_TIERS: [TierCleared("disk:///d", 3), TierCleared("lmcache://h:1", 0, "no DELETE")],
    RequestType.RELEASE_LEASES: None,
    RequestType.LOOKUP_CHUNKS: 2,
    RequestType.CANCEL_TRANSFERS: 1,
    RequestType.KV_EVENTS: EventsReply(7, 14, False, [ChunkEvent(CLEARED), ChunkEvent(
        STORED, "CPU", "LOCAL", None, b"\x01" * 32, b"\x02" * 32, "m", 2, 1)]),
    RequestType.LOOKUP_PREFIX: PrefixHit(1, [TailHit(40, 3, b"\x03" * 32)]),
    RequestType.NOTE_TAILS: None,
    RequestType.RESET_MODEL: ModelReset(4, 1, [TierCleared("disk:///d", 4),
                                               TierCleared("lmcache://h:1", 0, "no DELETE")]),
}


def test_every_request_and_reply_round_trips() -> None:
    codec = Codec()
    assert set(PAYLOADS) == set(RequestType) == set(REPLIES)
    for request_type, payload in PAYLOADS.items():
        frames = codec.encode_request(42, request_type, payload)
        assert REQUEST_ID.unpack(frames[0]) == (42,)
        assert codec.decode_request_type(frames[1]) is request_type
        assert codec.decode_payload(request_type, frames[2:]) == payload
        reply = REPLIES[request_type]
        assert codec.decode_reply(request_type, 0, codec.encode_reply(reply)) == reply
    err = codec.encode_error(ErrorCode.BAD_PAYLOAD, "nope")
    with pytest.raises(ServerError) as info:
        codec.decode_reply(RequestType.PING, ErrorCode.BAD_PAYLOAD, err)
    assert info.value.code is ErrorCode.BAD_PAYLOAD and info.value.message == "nope"


def test_seed_types_round_trip() -> None:
    for key in (HASH_KEY, TOKEN_KEY):
        back = IPCCacheEngineKey.Deserialize(IPCCacheEngineKey.Serialize(key))
        assert back == key and back.request_id == key.request_id
    # request_id travels but is not identity; keys order and hash by identity.
    other = msgspec.structs.replace(HASH_KEY, request_id="other")
    assert other == HASH_KEY and hash(other) == hash(HASH_KEY) and not other < HASH_KEY
    assert HASH_KEY.no_worker_id_version().worker_id is None
    assert sorted([TOKEN_KEY, HASH_KEY]) == sorted([HASH_KEY, TOKEN_KEY])
    for handle in (SHM, CUDA):
        assert type(handle).Deserialize(type(handle).Serialize(handle)) == handle
    enc, dec = get_customized_encoder(), get_customized_decoder(list[CudaIPCWrapper])
    assert dec.decode(enc.encode([CUDA])) == [CUDA]
    with pytest.raises(msgspec.ValidationError):
        dec.decode(enc.encode([SHM]))  # a handle of the wrong kind fails its schema
    with pytest.raises(TypeError):
        msgspec.msgpack.encode(CUDA)  # the plain encoder knows no handles: nothing pickled


def test_object_keys_and_kv_rank() -> None:
    assert ObjectKey.ComputeKVRank(8, 5, 4, 1) == 8 << 24 | 5 << 16 | 4 << 8 | 1
    for bad in [(256, 0, 1, 0), (2, 2, 1, 0), (2, 0, 1, 1), (2, -1, 1, 0)]:
        with pytest.raises(ValueError):
            ObjectKey.ComputeKVRank(*bad)
    for raw in (b"\x00" * 7 + b"\x05", b"\xff" * 8, bytes(range(8))):
        assert ObjectKey.IntHash2Bytes(ObjectKey.Bytes2IntHash(raw)) == raw
    assert ObjectKey.Bytes2IntHash(ObjectKey.IntHash2Bytes(-12345)) == -12345
    k0 = IPCCacheEngineKey("m", 2, None, chunk_hash=b"a")
    k1 = IPCCacheEngineKey("m", 2, None, chunk_hash=b"b")
    keys = ipc_keys_to_object_keys([k0, k1])
    assert [(k.chunk_hash, k.kv_rank & 0xFF0000) for k in keys] == [
        (b"a", 0), (b"a", 1 << 16), (b"b", 0), (b"b", 1 << 16)]  # chunk-major
    assert ipc_keys_to_object_keys([IPCCacheEngineKey("m", 2, 1, chunk_hash=b"a")]) == keys[1:2]
    import torch

    layout = MemoryLayoutDesc([torch.Size([2, 3])], [torch.bfloat16])
    assert layout.nbytes == 12


def test_daemon_answers_every_request_type(client: MessageQueueClient) -> None:
    hello = client.submit(RequestType.HELLO, PAYLOADS[RequestType.HELLO]).result(5)
    assert hello.protocol_version == PROTOCOL_VERSION and hello.chunk_size == 256
    assert client.submit(RequestType.PING, [123]).result(5) == 123
    assert client.submit(RequestType.GET_CHUNK_SIZE, []).result(5) == 256
    status = client.submit(RequestType.STATUS, []).result(5)
    assert isinstance(status, StatusReport) and status.endpoints == [client.server_url]
    for request_type, payload in PAYLOADS.items():
        future = client.submit(request_type, payload)
        assert future.wait(10), f"{request_type.name} got no reply"
        error = future.exception()
        # Either a typed reply or a typed error: never silence, never a crash.
        assert error is None or isinstance(error, ServerError), (request_type, error)
    assert client.submit(RequestType.PING, [1]).result(5) == 1


def _raw(sock: zmq.Socket, frames: list[bytes]) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(5000), f"no reply to {frames!r}"
    return sock.recv_multipart()


def test_malformed_requests_get_error_replies(daemon: DaemonProcess) -> None:
    codec = Codec()
    enc = msgspec.msgpack.encode
    rid = REQUEST_ID.pack(9)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.url)
    cases = [
        ([b"short-id"], ErrorCode.MALFORMED_MESSAGE),
        ([rid], ErrorCode.MALFORMED_MESSAGE),
        ([rid, b"\xc1\xc1garbage"], ErrorCode.UNKNOWN_REQUEST_TYPE),
        ([rid, enc(999)], ErrorCode.UNKNOWN_REQUEST_TYPE),
        ([rid, enc("PING"), enc([1])], ErrorCode.UNKNOWN_REQUEST_TYPE),
        ([rid, enc(int(RequestType.PING))], ErrorCode.BAD_PAYLOAD),  # no payload frame
        ([rid, enc(int(RequestType.PING)), enc([1]), enc([2])], ErrorCode.BAD_PAYLOAD),  # two
        ([rid, enc(int(RequestType.PING)), enc(1), enc(2)], ErrorCode.BAD_PAYLOAD),  # protocol 2's
        ([rid, enc(int(RequestType.PING)), enc([])], ErrorCode.BAD_PAYLOAD),  # a value short
        ([rid, enc(int(RequestType.PING)), enc([1, 2])], ErrorCode.BAD_PAYLOAD),  # one too many
        ([rid, enc(int(RequestType.PING)), enc(["not an int"])], ErrorCode.BAD_PAYLOAD),
        ([rid, enc(int(RequestType.PING)), enc(1)], ErrorCode.BAD_PAYLOAD),  # not an array
        ([rid, enc(int(RequestType.LOOKUP)), enc([[{"model_name": 3}]])], ErrorCode.BAD_PAYLOAD),
        ([rid, enc(int(RequestType.REGISTER_KV_CACHE)), enc([1, [1, 2], {}])], ErrorCode.BAD_PAYLOAD),
        ([rid, enc(int(RequestType.STORE)), b"\x94\xff\x00\x01\x90"], ErrorCode.BAD_PAYLOAD),
        ([rid, enc(int(RequestType.HELLO)), os.urandom(64), os.urandom(3)], ErrorCode.BAD_PAYLOAD),
        ([rid, enc(int(RequestType.HELLO)), os.urandom(64)], ErrorCode.BAD_PAYLOAD),
    ]
    try:
        for frames, code in cases:
            reply = _raw(sock, frames)
            assert len(reply) == 3, reply
            status = msgspec.msgpack.decode(reply[1])
            assert status == code, (frames, reply)
            if frames[0] == rid:
                assert reply[0] == rid  # the request id is echoed for matching
            with pytest.raises(ServerError) as info:
                codec.decode_reply(RequestType.PING, status, reply[2])
            assert info.value.message
        for _ in range(200):  # random garbage must not kill the loop either
            sock.send_multipart([os.urandom(1 + n) for n in range(1 + os.urandom(1)[0] % 5)])
            assert sock.poll(5000)
            sock.recv_multipart()
        ok = _raw(sock, codec.encode_request(77, RequestType.PING, [5]))
        assert ok[0] == REQUEST_ID.pack(77) and codec.decode_reply(RequestType.PING, 0, ok[2]) == 5
    finally:
        sock.close()
    assert daemon.proc.poll() is None


def test_oversized_frame_is_refused_and_the_daemon_serves_on(daemon: DaemonProcess) -> None:
    from lmcache_mp.mq import MAX_FRAME_BYTES

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.url)
    try:
        sock.send_multipart([REQUEST_ID.pack(1), msgspec.msgpack.encode(int(RequestType.PING)),
                             b"\x00" * (MAX_FRAME_BYTES + 1)])
        assert not sock.poll(1000)  # no reply: the peer was cut off, nothing was buffered
    finally:
        sock.close()
    client = MessageQueueClient(daemon.url)
    try:
        assert client.submit(RequestType.PING, [11]).result(5) == 11
    finally:
        client.close()


def test_a_deferred_request_goes_out_on_its_own_and_close_stops_the_flusher(daemon: DaemonProcess) -> None:
    """`submit_later` (END_SESSION, RELEASE_LEASES) queues the request for the next one; with
    nothing sent after it, the flusher thread sends it within LATER_FLUSH_S. `close` waits for
    that thread before closing the socket it uses."""
    client = MessageQueueClient(daemon.url)
    client.handshake("deferred")
    future = client.submit_later(RequestType.PING, [7])
    deadline = time.monotonic() + 5
    while client._outbox:  # nobody drives the socket here: only the flusher can send it
        assert time.monotonic() < deadline, "the deferred request was never sent"
        time.sleep(0.005)
    assert future.result(5) == 7
    flusher = client._flusher
    assert flusher is not None and flusher.is_alive()
    client.submit_later(RequestType.PING, [8])
    client.close()
    assert not flusher.is_alive()


def test_concurrent_clients_threads_match_replies(daemon: DaemonProcess) -> None:
    # 8,000 requests in flight at once: the last wait behind all the others, which on a busy
    # machine took longer than the usual client's 30 s deadline. This test is about matching.
    client = MessageQueueClient(daemon.url, request_timeout_s=120)
    client.handshake("tests")
    try:
        _threads_match_replies(client)
    finally:
        client.close()


def _threads_match_replies(client: MessageQueueClient) -> None:
    threads, per_thread = 8, 1000
    mismatches: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            futures = [(n, client.submit(RequestType.PING, [t * per_thread + n]))
                       for n in range(per_thread)]
            for n, future in futures:
                got = future.result(120)
                if got != t * per_thread + n:
                    mismatches.append((t * per_thread + n, got))
        except BaseException as err:  # surfaced below
            errors.append(err)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(240)
    assert not errors and not mismatches
    assert client.in_flight == 0


def test_separate_clients_in_separate_threads(daemon: DaemonProcess) -> None:
    results: dict[int, list[int]] = {}

    def worker(t: int) -> None:
        c = MessageQueueClient(daemon.url)
        try:
            results[t] = [c.submit(RequestType.PING, [t * 10_000 + n]).result(30) for n in range(200)]
        finally:
            c.close()

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(60)
    assert results == {t: [t * 10_000 + n for n in range(200)] for t in range(4)}


def test_sigterm_removes_socket_and_exits_zero(daemon: DaemonProcess) -> None:
    assert daemon.socket_path.exists()
    assert oct(daemon.socket_path.stat().st_mode & 0o777) == oct(0o600)
    assert "ready" in daemon.log()
    assert daemon.stop(signal.SIGTERM) == 0
    assert not daemon.socket_path.exists()
    assert "stopped" in daemon.log()


def test_sigint_also_stops_cleanly(short_tmp: Path) -> None:
    d = start_daemon(short_tmp)
    assert d.stop(signal.SIGINT) == 0
    assert not d.socket_path.exists()


def test_tcp_loopback_and_refusal_of_public_bind(short_tmp: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(short_tmp, "--allow-unauthenticated-tcp", url=f"tcp://127.0.0.1:{port}")
    try:
        assert f"tcp://127.0.0.1:{port}" in d.log()
    finally:
        assert d.stop() == 0
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen", "tcp://0.0.0.0:5555"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--insecure-remote" in out.stderr


def test_ping_cli(daemon: DaemonProcess, short_tmp: Path) -> None:
    cli = [sys.executable, "-m", "lmcache_mp.cli"]
    out = subprocess.run([*cli, "ping", "--url", daemon.url, "--count", "5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"protocol {PROTOCOL_VERSION}," in out.stdout
    assert "chunk size 256" in out.stdout and "median" in out.stdout
    nobody = f"ipc://{short_tmp / 'nobody.sock'}"
    out = subprocess.run([*cli, "ping", "--url", nobody, "--timeout", "0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no answer" in out.stderr
    out = subprocess.run([*cli, "status", "--url", daemon.url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"chunk_size": 256' in out.stdout


def test_client_times_out_and_refuses_mismatched_server(short_tmp: Path) -> None:
    # A fake "server" that answers HELLO with another protocol version.
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    url = f"ipc://{short_tmp / 'fake.sock'}"
    router.bind(url)
    codec = Codec()

    def serve_once() -> None:
        identity, rid, _type, *_ = router.recv_multipart()
        body = codec.encode_reply(HelloReply(PROTOCOL_VERSION + 1, "9.9", 256, ""))
        router.send_multipart([identity, rid, msgspec.msgpack.encode(0), body])

    th = threading.Thread(target=serve_once)
    th.start()
    client = MessageQueueClient(url)
    try:
        with pytest.raises(ProtocolMismatchError, match=f"protocol {PROTOCOL_VERSION + 1}"):
            client.handshake("tests", timeout_s=5)
        th.join(5)
        with pytest.raises(RequestTimeoutError):
            client.submit(RequestType.PING, [1]).result(0.2)
    finally:
        client.close()
        router.close(linger=0)


def test_protocol_2_clients_and_daemons_learn_of_the_mismatch(daemon: DaemonProcess, short_tmp: Path) -> None:
    """Protocol 3 sends one payload frame. A protocol-2 client's HELLO (a frame per value) still
    gets a HelloReply naming protocol 3; a protocol-2 daemon refuses our HELLO with BAD_PAYLOAD,
    which the client reports as a protocol mismatch."""
    enc = msgspec.msgpack.encode
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.url)
    try:
        reply = _raw(sock, [REQUEST_ID.pack(3), enc(int(RequestType.HELLO)), enc(2), enc("old client")])
        assert msgspec.msgpack.decode(reply[1]) == ErrorCode.OK
        assert Codec().decode_reply(RequestType.HELLO, 0, reply[2]).protocol_version == PROTOCOL_VERSION
    finally:
        sock.close()

    router = zmq.Context.instance().socket(zmq.ROUTER)
    url = f"ipc://{short_tmp / 'old.sock'}"
    router.bind(url)

    def refuse_once() -> None:  # what a protocol-2 daemon answers a one-frame HELLO
        identity, rid, *_ = router.recv_multipart()
        body = Codec().encode_error(ErrorCode.BAD_PAYLOAD, "HELLO takes 2 payload frames, got 1")
        router.send_multipart([identity, rid, enc(int(ErrorCode.BAD_PAYLOAD)), body])

    th = threading.Thread(target=refuse_once)
    th.start()
    client = MessageQueueClient(url)
    try:
        with pytest.raises(ProtocolMismatchError, match="older protocol"):
            client.handshake("tests", timeout_s=5)
    finally:
        th.join(5)
        client.close()
        router.close(linger=0)


def test_request_spec_is_declared_for_every_type() -> None:
    assert set(PROTOCOL) == set(RequestType)
    assert len({int(t) for t in RequestType}) == len(RequestType)
