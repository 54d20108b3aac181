"""The v1 remote protocol: `lmcache-mp remote-server` as a real process, spoken to over real sockets.

The wire checks pack and unpack headers with `struct` and format strings written out here, so a
mistake in `lmcache_mp.v1remote.protocol` cannot hide behind itself."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.cli.main import build_parser
from lmcache_mp.testing.servers import ServerProcess, command, start_v1_server
from lmcache_mp.v1remote.client import V1Connection, V1ConnectionError
from lmcache_mp.v1remote.protocol import (
    DEFAULT_MAX_CONNECTIONS,
    KEY_DTYPES,
    ClientCommand,
    ClientMetaMessage,
    Location,
    MemoryFormat,
    ProtocolError,
    ServerMetaMessage,
    ServerReturnCode,
    WireDtype,
    format_key,
    parse_key,
)
from lmcache_mp.v1remote.server import DEFAULT_IDLE_TIMEOUT_S, RemoteServer

CLIENT_FMT = "iiiiiiiii150s"  # command, length, fmt, dtype, location, shape0..3, key
SERVER_FMT = "iiiiiiiii"  # code, length, fmt, dtype, shape0..3, location
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
MISS = (400, 0, 1, 2, 0, 0, 0, 0, 0)  # a GET miss / failed EXIST, as the reference sends it
ANY_KEY = "probe@1@0@0@half"


@pytest.fixture
def remote_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str, size_gb: str = "0.05") -> ServerProcess:
        started.append(start_v1_server(tmp_path, *args, size_gb=size_gb))
        return started[-1]

    yield start
    for server in started:
        assert server.stop() == 0, server.log()  # SIGTERM: a clean shutdown
        log = server.log()
        assert "Traceback" not in log and "unexpected error" not in log, log
        assert "stopped:" in log, log


# --- raw wire -------------------------------------------------------------------------------------

def _header(command: int, key: str, length: int = 0, fmt: int = 0, dtype: int = 0, location: int = 0,
            shape: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bytes:
    return struct.pack(CLIENT_FMT, command, length, fmt, dtype, location, *shape,
                       key.encode().ljust(150, b" "))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"connection closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def _reply(sock: socket.socket) -> tuple[int, ...]:
    return struct.unpack(SERVER_FMT, _recv_exact(sock, 36))


def test_wire_format_byte_by_byte(remote_server: Callable[..., ServerProcess]) -> None:
    assert struct.calcsize(CLIENT_FMT) == 186 and struct.calcsize(SERVER_FMT) == 36
    server = remote_server()
    key, other = "llama@2@1@00ff3a@bfloat16", "llama@2@1@0a0b@bfloat16@kind%v"
    shape = (2, 4, 8, 16)  # KV_2LTD bfloat16: 2 * 4 * 8 * 16 * 2 bytes
    payload = os.urandom(2 * 4 * 8 * 16 * 2)
    with server.connect() as sock:
        # PUT has no reply: the GET right behind it on the same connection is the first answer.
        sock.sendall(_header(PUT, key, len(payload), fmt=1, dtype=3, location=1, shape=shape) + payload)
        sock.sendall(_header(PUT, other, 3, fmt=4, dtype=6, shape=(3, 0, 0, 0)) + b"abc")
        sock.sendall(_header(GET, key))
        # location (1) comes last, after the shape, in the server header.
        assert _reply(sock) == (200, len(payload), 1, 3, *shape, 1)
        assert _recv_exact(sock, len(payload)) == payload
        sock.sendall(_header(GET, other))
        assert _reply(sock) == (200, 3, 4, 6, 3, 0, 0, 0, 0)
        assert _recv_exact(sock, 3) == b"abc"

        sock.sendall(_header(GET, "llama@2@1@ffff@bfloat16"))
        assert _reply(sock) == MISS
        sock.sendall(_header(EXIST, key) + _header(EXIST, "llama@2@1@ffff@bfloat16"))
        assert _reply(sock) == (200, 0, 1, 2, 0, 0, 0, 0, 0)
        assert _reply(sock) == MISS
        sock.sendall(_header(HEALTH, ANY_KEY))
        assert _reply(sock) == (200, 0, 1, 2, 0, 0, 0, 0, 0)

        sock.sendall(_header(LIST, ANY_KEY))
        listing = f"{key}\n{other}".encode()  # least recently used first: `key` was read first
        assert _reply(sock) == (200, len(listing), 4, 6, len(listing), 0, 0, 0, 0)
        assert _recv_exact(sock, len(listing)) == listing

        # A PUT replaces the object; a zero-length one is a valid object.
        sock.sendall(_header(PUT, key, 0, fmt=4, dtype=6) + _header(GET, key))
        assert _reply(sock) == (200, 0, 4, 6, 0, 0, 0, 0, 0)


def test_messages_match_hand_packed_bytes() -> None:
    key = "m@1@0@abc@half@lora%7"
    msg = ClientMetaMessage(ClientCommand.PUT, key, 2048, MemoryFormat.KV_2LTD, WireDtype.BFLOAT16,
                            (2, 4, 8), Location.LOCAL_CPU)
    wire = struct.pack(CLIENT_FMT, 1, 2048, 1, 3, 1, 2, 4, 8, 0, key.encode().ljust(150, b" "))
    assert msg.serialize() == wire and len(wire) == ClientMetaMessage.packlength() == 186
    assert ClientMetaMessage.deserialize(wire) == msg
    assert ClientMetaMessage.deserialize(bytearray(wire)).shape == (2, 4, 8, 0)

    reply = ServerMetaMessage(ServerReturnCode.SUCCESS, 2048, MemoryFormat.KV_2LTD, WireDtype.BFLOAT16,
                              (2, 4, 8, 16), Location.LOCAL_DISK)
    wire = struct.pack(SERVER_FMT, 200, 2048, 1, 3, 2, 4, 8, 16, 2)
    assert reply.serialize() == wire and len(wire) == ServerMetaMessage.packlength() == 36
    assert ServerMetaMessage.deserialize(wire) == reply
    assert ServerMetaMessage.status(ServerReturnCode.FAIL).serialize() == struct.pack(SERVER_FMT, *MISS)

    bad = [
        b"\0" * 185,  # wrong size
        struct.pack(CLIENT_FMT, 9, 0, 0, 0, 0, 0, 0, 0, 0, ANY_KEY.encode().ljust(150)),  # command
        struct.pack(CLIENT_FMT, 1, -1, 0, 0, 0, 0, 0, 0, 0, ANY_KEY.encode().ljust(150)),  # length
        struct.pack(CLIENT_FMT, 2, 0, 0, 0, 0, 0, 0, 0, 0, b"\xff" * 150),  # not UTF-8
        struct.pack(CLIENT_FMT, 2, 0, 0, 0, 0, 0, 0, 0, 0, ANY_KEY.encode()),  # NUL-padded key
        struct.pack(CLIENT_FMT, 2, 0, 0, 99, 0, 0, 0, 0, 0, ANY_KEY.encode().ljust(150)),  # dtype
        struct.pack(CLIENT_FMT, 2, 0, 0, 0, 0, 0, 0, 0, 0, b"no key here".ljust(150)),
    ]
    for data in bad:
        with pytest.raises(ProtocolError):
            ClientMetaMessage.deserialize(data)
    for data in (b"\0" * 37, struct.pack(SERVER_FMT, 201, 0, 1, 2, 0, 0, 0, 0, 0)):
        with pytest.raises(ProtocolError):
            ServerMetaMessage.deserialize(data)
    with pytest.raises(ProtocolError):
        ClientMetaMessage(ClientCommand.GET, "m@1@0@" + "a" * 140 + "@half")  # 151 bytes


# --- the client -----------------------------------------------------------------------------------

def test_client_pipelines_byte_exact(remote_server: Callable[..., ServerProcess]) -> None:
    server = remote_server()
    keys = [format_key("model", 4, 3, f"{i:x}", "half") for i in range(150)]  # > PIPELINE_WINDOW
    payloads = [os.urandom(1 + 997 * i) for i in range(len(keys))]
    with server.client() as conn:
        assert conn.health()
        for key, data in zip(keys, payloads, strict=True):
            third = len(data) // 3
            conn.put(key, [data[:third], memoryview(data)[third:]], MemoryFormat.KV_2LTD,
                     WireDtype.FLOAT16, (len(data),))
        missing = format_key("model", 4, 3, "dead", "half")
        assert conn.exist_many([*keys, missing]) == [True] * len(keys) + [False]

        outs = [[bytearray(len(d) // 2), bytearray(len(d) - len(d) // 2)] for d in payloads]
        views = [[memoryview(a), memoryview(b)] for a, b in outs]
        assert conn.get_into_many(keys, views) == [len(d) for d in payloads]
        assert all(a + b == d for (a, b), d in zip(outs, payloads, strict=True))

        # A hit of another length is drained, not written (its length tells it), and the stream
        # stays in step.
        wrong = bytearray(b"\x55" * (len(payloads[5]) + 1))
        right = bytearray(len(payloads[6]))
        assert conn.get_into_many([keys[5], missing, keys[6]], [[wrong], [bytearray(1)], [right]]) == [
            len(payloads[5]), None, len(payloads[6])]
        assert wrong == b"\x55" * len(wrong) and right == payloads[6]
        assert conn.health() and not conn.closed

        with pytest.raises(ValueError):  # read-only buffers: refused before anything is sent
            conn.get_into_many([keys[0]], [[bytes(len(payloads[0]))]])
        with pytest.raises(ProtocolError):
            conn.exist_many(["not a key"])
        assert conn.health()  # argument errors leave the connection usable
        assert sorted(conn.list_keys()) == sorted(keys)


def test_client_closes_on_a_dead_server() -> None:
    server = RemoteServer("127.0.0.1", 0, capacity_bytes=1 << 20)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        conn = V1Connection(*server.address, timeout_s=5.0)
        key = format_key("m", 1, 0, "1", "uint8")
        conn.put(key, [b"payload"])
        assert conn.get_into_many([key], [[bytearray(7)]]) == [7]
        stats = server.stats()
        counted = ("objects", "bytes", "puts", "gets", "hits", "connections")
        assert [stats[name] for name in counted] == [1, 7, 1, 1, 1, 1]
    finally:
        server.close()
        thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(ConnectionError):  # close() closed our connection too
        conn.health()
    assert conn.closed
    with pytest.raises(V1ConnectionError):  # and it stays closed
        conn.exist_many([key])


# --- robustness -------------------------------------------------------------------------------

def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_bad_requests_close_only_their_connection(remote_server: Callable[..., ServerProcess]) -> None:
    server = remote_server()
    bad_cases = {
        "garbage": b"\xff" * 186,
        "unparseable key": _header(GET, "model@1@0@NOTHEX@half"),
        "key not in the list of dtypes": _header(EXIST, "model@1@0@ab@float16"),
        "unknown command": _header(7, ANY_KEY),
        "negative length": _header(PUT, ANY_KEY, -5),
        "huge PUT": _header(PUT, ANY_KEY, 2**31 - 1),
        "closed mid-header": _header(HEALTH, ANY_KEY)[:100],
        "closed mid-payload": _header(PUT, "model@1@0@ab@half", 1000) + b"x" * 10,
    }
    with server.connect() as witness:  # opened first: it must outlive every bad connection
        for case, data in bad_cases.items():
            with server.connect() as bad:
                bad.sendall(data)
                bad.shutdown(socket.SHUT_WR)  # the truncated cases end here
                assert _closed_by_server(bad), case
            witness.sendall(_header(HEALTH, ANY_KEY))
            assert _reply(witness)[0] == 200, case
        witness.sendall(_header(EXIST, "model@1@0@ab@half"))  # the half-sent PUT was not stored
        assert _reply(witness) == MISS
    assert server.proc.poll() is None
    log = server.log()
    assert log.count("malformed request, closing the connection") == 6, log
    assert log.count("in the middle of a message") == 2, log
    assert "unknown command -1" in log and "unknown command 7" in log, log


def test_connection_limit(remote_server: Callable[..., ServerProcess]) -> None:
    server = remote_server("--max-connections", "2", "--max-connections-per-host", "2")
    first, second = server.client(), server.client()
    assert first.health() and second.health()
    with server.connect() as third:
        assert _closed_by_server(third)
    first.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the close asynchronously
        try:
            with server.client() as again:
                assert again.health()
                break
        except ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert second.health()
    second.close()


def test_idle_and_stalled_connections_are_reaped(remote_server: Callable[..., ServerProcess]) -> None:
    # Every slot taken by a connection that sends nothing (or stops half-way through a message)
    # locked every client out for good; with an idle timeout they are closed and clients get in.
    # Every connection from this one host: its share is all of them here.
    server = remote_server("--idle-timeout-s", "1",
                           "--max-connections-per-host", str(DEFAULT_MAX_CONNECTIONS))
    silent = [server.connect(timeout=30) for _ in range(DEFAULT_MAX_CONNECTIONS - 2)]
    mid_header = server.connect(timeout=30)
    mid_header.sendall(_header(HEALTH, ANY_KEY)[:100])
    mid_payload = server.connect(timeout=30)
    mid_payload.sendall(_header(PUT, "model@1@0@ab@half", 1000) + b"x" * 10)
    hogs = [*silent, mid_header, mid_payload]
    deadline = time.monotonic() + 30
    while True:  # refused (every slot taken) until the server has reaped the hogs
        try:
            with server.client() as client:
                assert client.health()
                break
        except ConnectionError:
            assert time.monotonic() < deadline, "no client got in: the idle connections were never closed"
            time.sleep(0.05)
    for sock in hogs:  # each one was closed by the server (the 30 s socket timeout is the deadline)
        assert _closed_by_server(sock)
        sock.close()
    deadline = time.monotonic() + 10
    # Each thread logs just after its shutdown, which the client may see first.
    while (log := server.log()).count("idle for") < len(silent) or log.count("not done in time") < 2:
        assert time.monotonic() < deadline, log
        time.sleep(0.02)
    assert log.count("idle for") == len(silent) and log.count("not done in time") == 2, log
    with pytest.raises(ValueError):
        RemoteServer("127.0.0.1", 0, capacity_bytes=1 << 20, idle_timeout_s=0)
    assert build_parser().parse_args(["remote-server"]).idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S


# --- the LRU bound ----------------------------------------------------------------------------

def test_lru_eviction_keeps_recently_read_keys(remote_server: Callable[..., ServerProcess]) -> None:
    # 0.001 GiB = 1,073,741 bytes: three 300,000-byte objects fit (with their 256-byte overhead
    # each), a fourth does not.
    server = remote_server(size_gb="0.001")
    keys = [format_key("lru", 1, 0, f"{i:x}", "uint8") for i in range(5)]
    payloads = [bytes([i]) * 300_000 for i in range(5)]
    with server.client() as conn:
        for i in range(3):
            conn.put(keys[i], [payloads[i]])
        assert conn.exist_many(keys[:3]) == [True, True, True]
        out = bytearray(300_000)
        assert conn.get_into_many([keys[0]], [[out]]) == [300_000]  # keys[0] is now the newest
        conn.put(keys[3], [payloads[3]])
        assert conn.exist_many(keys[:4]) == [True, False, True, True]  # keys[1] was the oldest
        conn.put(keys[4], [payloads[4]])
        assert conn.exist_many(keys) == [True, False, False, True, True]
        assert conn.list_keys() == [keys[0], keys[3], keys[4]]

        # Larger than the whole store: read and discarded, nothing evicted, the stream in step.
        conn.put(format_key("lru", 1, 0, "b16", "uint8"), [bytes(2_000_000)])
        assert conn.list_keys() == [keys[0], keys[3], keys[4]]
        assert conn.get_into_many([keys[4]], [[out]]) == [300_000] and out == payloads[4]


def test_non_loopback_listen_is_refused_without_allow_remote() -> None:
    out = subprocess.run([*command(), "remote-server", "--listen", "tcp://0.0.0.0:0", "--size-gb", "0.001"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "not a loopback address" in out.stderr and "--allow-remote" in out.stderr, out.stderr
    assert "authentication" in out.stderr and "listening" not in out.stderr


# --- key strings ------------------------------------------------------------------------------

# Model names: anything but "@", control characters and surrounding whitespace.
_model = st.text(st.characters(exclude_characters="@", exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp")),
                 min_size=1, max_size=40).filter(lambda s: s == s.strip())
_tag = st.text(st.characters(categories=("Ll", "Lu", "Nd"), max_codepoint=127), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(model=_model, world_size=st.integers(1, 4096), worker_id=st.integers(0, 4095),
       chunk_hash=st.integers(0, 2**64 - 1), dtype=st.sampled_from(sorted(KEY_DTYPES)),
       tags=st.dictionaries(_tag, _tag, max_size=2))
def test_format_then_parse_round_trips(model: str, world_size: int, worker_id: int, chunk_hash: int,
                                       dtype: str, tags: dict[str, str]) -> None:
    try:
        key = format_key(model, world_size, worker_id, f"{chunk_hash:x}", dtype, tags)
    except ProtocolError:
        # Only for being too long.
        size = len(f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}".encode())
        assert size + sum(len(k) + len(v) + 2 for k, v in tags.items()) > 150
        return
    parsed = parse_key(key)
    assert (parsed.model_name, parsed.world_size, parsed.worker_id, parsed.chunk_hash, parsed.dtype) == (
        model, world_size, worker_id, f"{chunk_hash:x}", dtype)
    assert dict(parsed.tags) == tags and str(parsed) == key
    assert ClientMetaMessage.deserialize(ClientMetaMessage(ClientCommand.GET, key).serialize()).key == key


@pytest.mark.parametrize("key", [
    "m@1@0@abc",  # too few parts
    "m@1@0@abc@",  # empty dtype
    "m@x@0@abc@half", "m@1@-1@abc@half", "m@1@ 0@abc@half", "m@1@٣@abc@half",  # not decimal
    "m@1@0@ABC@half", "m@1@0@xyz@half", "m@1@0@@half", "m@1@0@0x1f@half",  # not lowercase hex
    "m@1@0@abc@float16", "m@1@0@abc@Half",  # not an allowed dtype
    "m@1@0@abc@half@tag", "m@1@0@abc@half@%v", "m@1@0@abc@half@t%", "m@1@0@abc@half@a%b%c",  # tags
    "@1@0@abc@half",  # empty model
    " m@1@0@abc@half", "m@1@0@abc@half ", "m\n@1@0@abc@half",  # whitespace, control characters
    "m" * 140 + "@1@0@abc@half",  # 153 bytes
    "é" * 70 + "@1@0@abc@half",  # 140 characters but 153 bytes
])
def test_parse_key_rejects_malformed_keys(key: str) -> None:
    with pytest.raises(ProtocolError):
        parse_key(key)


def test_parse_key_accepts_valid_keys() -> None:
    longest = "m" * 137 + "@1@0@abc@half"
    assert len(longest.encode()) == 150 and parse_key(longest).model_name == "m" * 137
    parsed = parse_key("meta-llama/Llama-3.1-8B@8@7@0123456789abcdef@bfloat16@lora%a1@pp%0")
    assert (parsed.world_size, parsed.worker_id, parsed.tags) == (8, 7, (("lora", "a1"), ("pp", "0")))
    assert parse_key("m@1@0@0@bool").dtype == "bool"
    for bad in [("a@b", 1, 0, "ab", "half", None), ("m", 1, 0, "ab", "half", {"t": "a@b"}),
                ("m", -1, 0, "ab", "half", None), ("m", True, 0, "ab", "half", None),
                ("m", 1, 0, "ab", "half", {"t%x": "v"})]:
        with pytest.raises(ProtocolError):
            format_key(*bad)


# --- one peer's share of the connections -------------------------------------------------------

def _connect_from(server: ServerProcess, source: str) -> socket.socket:
    """A connection from `source`, one of this machine's loopback addresses (all of 127/8 is)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", server.port))
    return sock


def _served(sock: socket.socket) -> bool:
    """Whether a HEALTH on `sock` is answered (False: the server closed the connection)."""
    try:
        sock.sendall(_header(HEALTH, ANY_KEY))
        return _reply(sock)[0] == 200
    except (AssertionError, ConnectionError):  # closed: _recv_exact asserts on an empty read
        return False


def test_one_host_cannot_hold_every_connection(remote_server: Callable[..., ServerProcess]) -> None:
    """One client held all 64 connections (a HEALTH on each now and then keeps them from the idle
    timeout): 0 of 38 other clients' checks were answered in 75 s. Now one host holds a share of
    the connections (a quarter by default), and the others get the rest."""
    server = remote_server()
    hostile = [_connect_from(server, "127.0.0.2") for _ in range(DEFAULT_MAX_CONNECTIONS)]
    others = [_connect_from(server, f"127.0.1.{i}") for i in range(1, 39)]
    try:
        held = sum(_served(sock) for sock in hostile)
        answered = sum(_served(sock) for sock in others)
        assert (held, answered) == (DEFAULT_MAX_CONNECTIONS // 4, len(others))
        assert all(_served(sock) for sock in others)  # and the same connections again
    finally:
        for sock in hostile + others:
            sock.close()
    assert build_parser().parse_args(["remote-server"]).max_connections_per_host is None
