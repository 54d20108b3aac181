"""The lmcache door's wire (`lmcache_mp/lmcache_door/wire.py`) against the bytes LMCache's own client
encodes: each request frame built as lmcache 0.5.6's `MessageQueueClient` builds it (its RPC specs bind
the arguments, its encoders write them), then decoded by our structs; each reply decoded by its client's
decoders. The installed lmcache is used here only to produce and read real bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from lmcache_mp.engine.hashing import chunk_hashes
from lmcache_mp.lmcache_door import wire
from lmcache_mp.lmcache_door.keys import engine_keys
from tests.support.helpers import LMCACHE_MISSING

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import (
    BlockAllocationRecord,
    IPCCacheServerKey,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.rpc import get_rpc_spec, get_rpc_specs
from lmcache.v1.multiprocess.transport.zmq_impl.mq import msgspec_decode, msgspec_encode
from lmcache.v1.multiprocess.transport.zmq_impl.wire import (
    LEGACY_OPERATION_IDS,
    decode_operation,
    encode_operation,
)
from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

from tests.support.lmcache_peer import client_frames

TOKENS = list(range(1000, 1100))


def key(worker: int | None = 0, start: int = 0, end: int = 64, salt: str = "") -> IPCCacheServerKey:
    return IPCCacheServerKey.from_token_ids("org/model", 1, worker, TOKENS, start, end, "req-1", salt)


def client_reads(op: str, frames: list[bytes]) -> Any:
    """What lmcache's client makes of a reply (`MessageQueueClient.process_inbound`): the result, or
    the exception its future gets."""
    spec = get_rpc_spec(op)
    answered = decode_operation(frames[1])
    if answered != op:
        return ValueError(f"Response operation {answered!r} does not match request {op!r}")
    return msgspec_decode(frames[2], cls=spec.response_type) if len(frames) > 2 else None


def test_the_installed_lmcache_speaks_the_wire_this_daemon_serves() -> None:
    # Its version: tests/unit/test_lmcache_peer.py; here, the operations of its wire.
    assert {v: k for k, v in LEGACY_OPERATION_IDS.items()} == wire.LEGACY_OPERATIONS
    assert set(get_rpc_specs()) <= wire.KNOWN_OPERATIONS
    for op, spec in wire.SERVED.items():  # one payload frame per argument, as the client sends them
        assert len(spec.payload) == len(get_rpc_spec(op).payload_types), op


def test_a_cpu_registration_decodes_into_our_descriptors() -> None:
    storage = torch.zeros(2 * 8 * 64, dtype=torch.bfloat16)
    layers = [storage.view(2, 8, 64)[i] for i in range(2)]
    wrappers = [CpuShmTensorWrapper(t, "/lmcache_kv_1_0", segment_nbytes=storage.nbytes) for t in layers]
    frames = client_frames("register_kv_cache", 5, wrappers, "org/model", 1, EngineType.VLLM,
                           {"kv_layout": "NHD"}, [EngineGroupInfo(0, (0, 1), 16)])

    request = wire.decode_request(frames)

    assert request.op == "register_kv_cache"
    instance_id, descriptors, model, world_size, engine_type, hints, groups = request.args
    assert (instance_id, model, world_size, engine_type) == (5, "org/model", 1, "vllm")
    assert [d.shm_name for d in descriptors] == ["/lmcache_kv_1_0"] * 2
    assert [d.metadata.storage_offset for d in descriptors] == [0, 8 * 64]
    assert descriptors[1].metadata.shape == (8, 64) and descriptors[1].nbytes == storage.nbytes
    assert descriptors[1].metadata.byte_span() == storage.nbytes
    assert hints.kv_layout == "NHD" and groups == [wire.EngineGroupInfo(0, (0, 1), 16)]


def test_every_request_of_the_vllm_path_decodes() -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("ping", (None,)), ("ping", (12,)), ("get_chunk_size", ()), ("get_experimental", ()),
        ("lookup", (key(None, 0, 64), 1)), ("query_prefetch_status", ("req-1",)),
        ("wait_prefetch_status", ("req-1", 2.5)), ("free_lookup_locks", (key(None, 32, 64), 1)),
        ("store", (key(), 5, [[0, 1, 2, 3]], b"stub_ipc_handle")),
        ("retrieve", (key(), 5, [[4, 5, 6, 7]], b"stub_ipc_handle", 16)),
        ("end_session", ("req-1",)), ("unregister_kv_cache", (5,)), ("clear", (False,)),
        ("report_block_allocation", (99, "org/model", [BlockAllocationRecord("req-1", [3], [1, 2])])),
    ]
    for op, args in calls:
        request = wire.decode_request(client_frames(op, *args))
        assert request.op == op
        assert len(request.args) == len(args)
    store = wire.decode_request(client_frames("store", key(), 5, [[0, 1]], b"h"))
    decoded_key = store.args[0]
    assert decoded_key.tokens() == tuple(TOKENS) and (decoded_key.start, decoded_key.end) == (0, 64)
    assert decoded_key.worker_id == 0 and decoded_key.num_kv_readers == 1
    assert store.args[1:] == (5, [[0, 1]], b"h")


def test_a_key_of_lmcache_0_5_7_carries_its_tokens_as_bytes() -> None:
    fields = msgspec.msgpack.decode(msgspec_encode(key(), IPCCacheServerKey))
    del fields["token_ids"]
    fields["token_bytes"] = b"".join(t.to_bytes(4, "big") for t in TOKENS)  # big-endian uint32
    frames = client_frames("lookup", key(None), 1)
    frames[2] = msgspec.msgpack.encode(fields)

    request = wire.decode_request(frames)

    assert request.args[0].tokens() == tuple(TOKENS)
    [ours] = engine_keys(request.args[0], 32, lookup=False)
    assert ours.token_ids == tuple(TOKENS[:64]) and (ours.start, ours.end) == (0, 64)


def test_replies_read_as_lmcache_s_client_reads_them() -> None:
    store = wire.decode_request(client_frames("store", key(), 5, [[0]], b"h"))
    assert client_reads("store", wire.reply_frames(store, (b"", True))) == (b"", True)
    failed = wire.failure_frames(store.uid, store.op_frame, "store", "why")
    assert client_reads("store", failed) == (b"", False)

    query = wire.decode_request(client_frames("query_prefetch_status", "r"))
    assert client_reads("query_prefetch_status", wire.reply_frames(query, None)) is None  # pending
    assert client_reads("query_prefetch_status", wire.reply_frames(query, 3)) == 3
    assert client_reads("query_prefetch_status", wire.failure_frames(query.uid, query.op_frame,
                                                                     "query_prefetch_status", "x")) == 0

    ping = wire.decode_request(client_frames("ping", None))
    assert client_reads("ping", wire.failure_frames(ping.uid, ping.op_frame, "ping", "x")) is False

    # An operation answering None has no failure value: its future fails, with our reason.
    end = wire.decode_request(client_frames("end_session", "r"))
    assert client_reads("end_session", wire.reply_frames(end, None)) is None
    failed = client_reads("end_session", wire.failure_frames(end.uid, end.op_frame, "end_session",
                                                             "the reason"))
    assert isinstance(failed, ValueError) and "the reason" in str(failed)


def test_requests_of_another_wire_are_refused_with_what_their_reply_needs() -> None:
    uid = msgspec_encode(3, int)
    lookup_key = msgspec_encode(key(None), IPCCacheServerKey)
    cases = {
        "retired id 11": ([uid, msgspec.msgpack.encode(11)], True, None),
        "an unknown name": ([uid, msgspec.msgpack.encode("negotiate_chunk_size")], True, None),
        "a known op not served": ([uid, encode_operation("store_q"), b"\xc0", b"\xc0", b"\xc0"], False,
                                  "store_q"),
        "a malformed payload": ([uid, encode_operation("store"), b"\xff", b"\x05", b"\x90", b"\xc4\x00"],
                                True, "store"),
        "a payload frame missing": ([uid, encode_operation("lookup"), lookup_key], True, "lookup"),
        "an op frame that is no op": ([uid, b"\xc3"], True, None),
        "no op frame": ([uid], True, None),
    }
    for what, (frames, unknown, op) in cases.items():
        with pytest.raises(wire.WireError) as refused:
            wire.decode_request(frames)
        assert (refused.value.unknown, refused.value.op) == (unknown, op), what
        reply = wire.failure_frames(refused.value.uid, refused.value.op_frame, refused.value.op,
                                    refused.value.message)
        assert reply[0] == uid, what  # the client matches it to its request


def test_descriptors_this_version_does_not_know_are_refused() -> None:
    good = {"type": "cpu_shm", "version": 1, "shm_name": "/s", "nbytes": 64,
            "metadata": {"dtype": "bfloat16", "shape": [4, 8], "stride": [8, 1], "storage_offset": 0,
                         "device_uuid": "cpu"}}

    def frame(*descriptors: dict) -> bytes:
        return msgspec.msgpack.encode([msgspec.msgpack.Ext(1, msgspec.msgpack.encode(d))
                                       for d in descriptors])

    assert len(wire.decode_descriptors(frame(good))) == 1
    refused = {
        "an unknown field": {**good, "flags": 1},
        "an unknown kind": {**good, "type": "cuda_vmm"},
        "another version": {**good, "version": 2},
        "a view past its segment": {**good, "nbytes": 63},
        "an unknown dtype": {**good, "metadata": {**good["metadata"], "dtype": "complex64"}},
    }
    for what, descriptor in refused.items():
        try:
            wire.decode_descriptors(frame(descriptor))
        except ValueError:
            continue
        pytest.fail(f"a descriptor with {what} was decoded")
    with pytest.raises(ValueError):
        wire.decode_descriptors(msgspec.msgpack.encode([msgspec.msgpack.Ext(2, b"\x90")]))


def test_a_salted_key_names_chunks_of_its_salt_s_own_chain() -> None:
    def engine_side(salt: str, start: int = 0, lookup: bool = True) -> list[bytes | tuple[int, ...]]:
        decoded = wire.decode_request(client_frames("lookup", key(None, start, 64, salt), 1)).args[0]
        return [k.chunk_hash or k.token_ids for k in engine_keys(decoded, 32, lookup=lookup)]

    plain, tenant_a, tenant_b = engine_side(""), engine_side("tenant-a"), engine_side("tenant-b")
    assert plain == [tuple(TOKENS[:64])]  # token mode: the engine hashes its own chain
    assert len(tenant_a) == len(tenant_b) == 2 and not set(tenant_a) & set(tenant_b)
    assert not set(tenant_a) & set(chunk_hashes(TOKENS, 32, 2))  # nor the unsalted chain's chunks
    assert engine_side("tenant-a") == tenant_a  # the same salt, the same chunks
    assert engine_side("tenant-a", start=32, lookup=False) == tenant_a[1:]


def test_a_key_of_a_later_version_s_fields_is_refused() -> None:
    decoded = wire.decode_request(client_frames("lookup", key(None), 1)).args[0]
    with pytest.raises(msgspec.ValidationError):  # a field a later version may key chunks by
        msgspec.msgpack.decode(msgspec.msgpack.encode({**msgspec.structs.asdict(decoded), "extra": 1}),
                               type=wire.Key)
