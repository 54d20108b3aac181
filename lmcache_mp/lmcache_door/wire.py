"""LMCache's multiprocess request wire, as lmcache 0.5.6's vLLM connector speaks it: our own structs
for its frames, its operation table, and the frames of every reply.

A request is `[uid, op, payload_0 ... payload_n]` after the ROUTER's identity: `uid` a msgpack int,
`op` a msgpack int of LMCache's frozen legacy table or the operation's name, one msgpack frame per
argument. A reply echoes `[uid, op]`, then one payload frame unless the result is None. LMCache's
wire has no error frame; what its client reads as a failure is, per operation, a typed failure
value (`(b"", False)` for a store, `0` chunks for a prefetch query, ...) or, where the reply has
none (operations that answer None), an op frame other than the request's: its client then fails
that request's future with our text in the message (`failure_frames`).

Decoding is strict and fail-closed: a descriptor, key or group field this version does not know is
refused (it may change what the bytes mean), as is an operation we do not serve. Nothing here
imports torch: the door answers its first requests while the daemon's engine is still being built.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from lmcache_mp.custom_types import MAX_MODEL_NAME_CHARS, MAX_REQUEST_ID_CHARS

LMCACHE_VERSION = "0.5.6"
SPOKEN = f"lmcache {LMCACHE_VERSION}'s multiprocess wire (lmcache_driven and engine_driven modes)"

# LMCache's frozen table of legacy operation ids (newer operations travel by name only; 11 is retired).
LEGACY_OPERATIONS: dict[int, str] = {
    1: "register_kv_cache", 2: "unregister_kv_cache", 3: "register_q_cache", 4: "unregister_q_cache",
    5: "store_q", 6: "store", 7: "retrieve", 8: "lookup", 9: "query_prefetch_status",
    10: "wait_prefetch_status", 12: "free_lookup_locks", 13: "end_session",
    14: "register_kv_cache_engine_driven_context", 15: "unregister_kv_cache_engine_driven_context",
    16: "prepare_store", 17: "commit_store", 18: "prepare_retrieve", 19: "commit_retrieve", 20: "clear",
    21: "get_chunk_size", 22: "ping", 23: "report_block_allocation", 24: "noop", 25: "cb_register_rope",
    26: "cb_unregister_rope", 27: "cb_retrieve_pre_computed", 28: "cb_unified_lookup",
    29: "p2p_lookup_and_lock", 30: "p2p_query_lookup_results", 31: "p2p_unlock_objects",
    32: "get_experimental", 33: "cb_protocol_handshake",
}
# Operations 0.5.6 knows beyond the table, by name; known, like the table's, but not all served.
NAMED_OPERATIONS = frozenset({"subscribe_kv_events", "server_module_call", "cb_reorder_plan"})
# What get_experimental names for the KV event stream (subscribe_kv_events): LMCache's connector
# subscribes only to a server that advertises it.
KV_EVENT_CAPABILITY = "kv_event_stream"
KNOWN_OPERATIONS = frozenset(LEGACY_OPERATIONS.values()) | NAMED_OPERATIONS

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
MAX_TOKEN_ID = 2**32 - 1
MAX_SALT_CHARS = 128  # LMCache's own bound on cache_salt
MAX_SHM_NAME_CHARS = 255  # NAME_MAX: a segment is one file in /dev/shm
MAX_ERROR_OP_CHARS = 600  # the failure text a refused None-answering request carries

# Torch dtype names (as LMCache writes them, without "torch.") and their sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
    "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


# ---- IPC descriptors: each layer's cache, a msgpack extension (code 1) holding one of these ------------


class TensorMetadata(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A view of a storage: elements, not bytes (`storage_offset`, `stride`)."""

    dtype: str
    shape: tuple[NonNegative, ...]
    stride: tuple[NonNegative, ...]
    storage_offset: NonNegative
    device_uuid: Annotated[str, msgspec.Meta(max_length=128)]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def byte_span(self) -> int:
        """One past the view's last byte within its storage (0 for an empty view)."""
        if 0 in self.shape:
            return 0
        last = self.storage_offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.itemsize

    def check(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} is not one this daemon copies ({', '.join(DTYPE_SIZES)})")
        if len(self.shape) != len(self.stride):
            raise ValueError(f"a view of shape {self.shape} with strides {self.stride}")


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="type"):
    version: Literal[1]
    metadata: TensorMetadata

    def storage_bytes(self) -> int:
        raise NotImplementedError

    def check(self) -> None:
        self.metadata.check()
        if self.metadata.byte_span() > self.storage_bytes():
            raise ValueError(f"a view reaching byte {self.metadata.byte_span()} of a "
                             f"{self.storage_bytes()}-byte storage")


class CudaDescriptor(_Descriptor, tag="cuda"):
    """torch's `_share_cuda_` tuple of the storage the view is of; [2] is the storage's bytes."""

    handle: tuple[int, bytes | None, NonNegative, NonNegative, bytes | None, NonNegative, bytes | None, bool]

    def storage_bytes(self) -> int:
        return self.handle[2]


class RawCudaDescriptor(_Descriptor, tag="cuda_raw"):
    ipc_handle: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
    alloc_offset: NonNegative
    nbytes: NonNegative

    def storage_bytes(self) -> int:
        return self.nbytes


class CpuShmDescriptor(_Descriptor, tag="cpu_shm"):
    """A named POSIX shared-memory segment (`/dev/shm/NAME`) of `nbytes`, the view within it."""

    shm_name: Annotated[str, msgspec.Meta(max_length=MAX_SHM_NAME_CHARS + 1)]
    nbytes: NonNegative

    def storage_bytes(self) -> int:
        return self.nbytes


Descriptor = CudaDescriptor | RawCudaDescriptor | CpuShmDescriptor
DESCRIPTOR_EXT_CODE = 1
_descriptor = msgspec.msgpack.Decoder(Descriptor)


class Descriptors(list[Descriptor]):
    """Marks the payload frame of per-layer descriptors (a list of extensions, decoded apart)."""


def decode_descriptors(frame: bytes) -> Descriptors:
    """The layers' descriptors; ValueError naming the first bad one."""
    out = Descriptors()
    for i, ext in enumerate(msgspec.msgpack.decode(frame, type=list[msgspec.msgpack.Ext])):
        if ext.code != DESCRIPTOR_EXT_CODE:
            raise ValueError(f"layer {i}: extension type {ext.code}, not an IPC descriptor "
                             f"({DESCRIPTOR_EXT_CODE})")
        try:
            descriptor = _descriptor.decode(ext.data)
            descriptor.check()
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            raise ValueError(f"layer {i}'s descriptor: {err}") from None
        out.append(descriptor)
    return out


# ---- keys and the other payloads -----------------------------------------------------------------------


class Key(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """LMCache's `IPCCacheServerKey` (a map by field name): a request's tokens, the range [start, end)
    an operation covers. 0.5.6 sends `token_ids`; 0.5.7 sends `token_bytes` (big-endian uint32)."""

    model_name: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)]
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    worker_id: NonNegative | None
    start: NonNegative
    end: NonNegative
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
    token_ids: list[int] | None = None
    token_bytes: bytes | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_SALT_CHARS)] = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: NonNegative = 0

    def tokens(self) -> tuple[int, ...]:
        """The request's token ids, whichever shape carried them; ValueError if neither or both."""
        if (self.token_ids is None) == (self.token_bytes is None):
            raise ValueError("a key needs exactly one of token_ids (lmcache 0.5.6) and token_bytes (0.5.7)")
        if self.token_ids is not None:
            return tuple(self.token_ids)
        data = self.token_bytes or b""
        if len(data) % 4:
            raise ValueError(f"token_bytes of {len(data)} bytes: not whole big-endian uint32s")
        return tuple(int.from_bytes(data[i:i + 4], "big") for i in range(0, len(data), 4))


class LayoutHints(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """LMCache's `LayoutHints` (a TypedDict, every key optional)."""

    kv_layout: Literal["NHD", "HND", "BLHNC", "BLNHC"] | None = None
    num_kv_heads: NonNegative | None = None
    tokens_per_block: NonNegative | None = None
    kv_list_layout: Literal["k_v", "unified"] | None = None
    head_dim: NonNegative | None = None


class EngineGroupInfo(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One of the engine's KV cache groups (an empty list of them: one plain group)."""

    engine_group_id: NonNegative
    layer_indices: tuple[NonNegative, ...] = ()
    tokens_per_block: NonNegative = 0
    sw_size_tokens: int = -1
    extra_object_group_tag: NonNegative = 0
    recurrent_state: bool = False


class BlockAllocationRecord(msgspec.Struct, frozen=True):
    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]


EngineType = Literal["vllm", "atom", "sglang", "trtllm", "mock"]


class EngineDrivenRegistration(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """LMCache's `RegisterEngineDrivenContextPayload`: no caches, only what its worker's chunks are
    (`[2, num_layers, num_physical_slots, hidden_dim_size]`, one plane where `use_mla`)."""

    instance_id: int
    model_name: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)]
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=1 << 12)]
    hidden_dim_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    dtype_str: str
    use_mla: bool
    num_physical_slots: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None


# ---- the KV event stream's batches (LMCache's dataclasses: maps by field name) -------------------------


class KVEventRecord(msgspec.Struct):
    """One change of the CPU cache: a chunk stored (with its tokens and its parent's hash) or removed."""

    seq: int
    kind: Literal["stored", "removed"]
    medium: str
    model_name: str
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]


class KVEventBatch(msgspec.Struct):
    """One batch of a subscription: `lost` (or a new `incarnation`) tells the connector to withdraw
    what it announced before; `enabled=False` ends its subscription (it reports its own stores then)."""

    enabled: bool
    incarnation: int
    next_cursor: int
    lost: bool
    events: list[KVEventRecord]


MAX_EVENTS_PER_BATCH = 1024  # LMCache's own bound on a subscription's batch
STREAM_REFUSED = KVEventBatch(enabled=False, incarnation=0, next_cursor=0, lost=False, events=[])


# ---- the operations served, and what their client reads as failure -----------------------------------


class ReplyError(enum.Enum):
    """A reply that has no failure value: the op frame is replaced (see `failure_frames`)."""

    OTHER_OP = "other_op"


SMALL = 4 << 10
KEYED = 8 << 20  # a key carries the request's every token id: 1M tokens of up to 5 bytes each
REGISTER = 4 << 20


@dataclass(frozen=True)
class OpSpec:
    payload: tuple[Any, ...]  # one type per payload frame
    failure: Any  # the reply a failed request gets: a value of its reply type, or ReplyError.OTHER_OP
    max_payload_bytes: int = SMALL


STORE_FAILED = (b"", False)
# An engine-driven store prepared without slots: its worker then commits, and the commit fails.
PREPARE_STORE_FAILED = {"context": {}}
PREPARE_RETRIEVE_FAILED = {"success": False, "data": b"", "context": {}}

SERVED: dict[str, OpSpec] = {
    "ping": OpSpec((int | None,), False),
    "get_chunk_size": OpSpec((), ReplyError.OTHER_OP),
    "get_experimental": OpSpec((), []),
    "noop": OpSpec((), ReplyError.OTHER_OP),
    "register_kv_cache": OpSpec((int, Descriptors, str, int, EngineType, LayoutHints, list[EngineGroupInfo]),
                                ReplyError.OTHER_OP, REGISTER),
    "unregister_kv_cache": OpSpec((int,), ReplyError.OTHER_OP),
    "lookup": OpSpec((Key, int), ReplyError.OTHER_OP, KEYED),
    "query_prefetch_status": OpSpec((str,), 0),
    "wait_prefetch_status": OpSpec((str, float), 0),
    "free_lookup_locks": OpSpec((Key, int), ReplyError.OTHER_OP, KEYED),
    "end_session": OpSpec((str,), ReplyError.OTHER_OP),
    "report_block_allocation": OpSpec((int, str, list[BlockAllocationRecord]), ReplyError.OTHER_OP, KEYED),
    "store": OpSpec((Key, int, list[list[int]], bytes), STORE_FAILED, KEYED),
    "retrieve": OpSpec((Key, int, list[list[int]], bytes, int), STORE_FAILED, KEYED),
    "clear": OpSpec((bool,), ReplyError.OTHER_OP),
    "register_kv_cache_engine_driven_context": OpSpec((EngineDrivenRegistration,), ReplyError.OTHER_OP),
    "unregister_kv_cache_engine_driven_context": OpSpec((int,), ReplyError.OTHER_OP),
    "prepare_store": OpSpec((Key, int), PREPARE_STORE_FAILED, KEYED),
    # Its data is empty: the chunks are in the staging segment (pickled tensors are refused, unread).
    "commit_store": OpSpec((Key, int, bytes), False, KEYED),
    "prepare_retrieve": OpSpec((Key, int), PREPARE_RETRIEVE_FAILED, KEYED),
    "commit_retrieve": OpSpec((Key, int), False, KEYED),
    # A stream: batches follow, one per credit (`events.py`); refused, it ends at once.
    "subscribe_kv_events": OpSpec((int, Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)],
                                   NonNegative, Annotated[int, msgspec.Meta(ge=1, le=MAX_EVENTS_PER_BATCH)]),
                                  STREAM_REFUSED),
}

_uid = msgspec.msgpack.Decoder(int)
_op = msgspec.msgpack.Decoder(int | str)


def _frame_decoder(kind: Any) -> Callable[[bytes], Any]:
    if kind is Descriptors:
        return decode_descriptors
    return msgspec.msgpack.Decoder(kind).decode


_DECODERS: dict[str, tuple[Callable[[bytes], Any], ...]] = {
    name: tuple(_frame_decoder(kind) for kind in spec.payload) for name, spec in SERVED.items()}


# ---- frames ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    uid: bytes  # the frames as received: echoed in the reply
    op_frame: bytes
    op: str
    args: tuple[Any, ...]


class WireError(Exception):
    """A request the door cannot serve, with what its reply needs: `op` is None where the frame named
    no operation of 0.5.6's; `unknown` says the request is of a wire this daemon does not speak."""

    def __init__(self, uid: bytes, op_frame: bytes, op: str | None, message: str, *, unknown: bool):
        super().__init__(message)
        self.uid, self.op_frame, self.op, self.message, self.unknown = uid, op_frame, op, message, unknown


def operation_name(op_frame: bytes) -> str:
    """The operation an op frame names; ValueError if it names none of 0.5.6's."""
    try:
        value = _op.decode(op_frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise ValueError(f"op frame {op_frame[:32]!r} is neither a msgpack int nor a str") from None
    if isinstance(value, int):
        if value not in LEGACY_OPERATIONS:
            raise ValueError(f"operation id {value} is not in lmcache {LMCACHE_VERSION}'s table")
        return LEGACY_OPERATIONS[value]
    if value not in KNOWN_OPERATIONS:
        raise ValueError(f"operation {value[:64]!r} is not one of lmcache {LMCACHE_VERSION}'s")
    return value


def decode_request(frames: list[bytes]) -> Request:
    """A request's frames (the identity taken off) -> its operation and decoded arguments."""
    uid = frames[0] if frames else b""
    op_frame = frames[1] if len(frames) > 1 else b""
    try:
        _uid.decode(uid)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise WireError(uid, op_frame, None, f"request id frame {uid[:16]!r} is not a msgpack int",
                        unknown=True) from None
    if len(frames) < 2:
        raise WireError(uid, op_frame, None, "a request is [uid, op, payload...]: no op frame", unknown=True)
    try:
        op = operation_name(op_frame)
    except ValueError as err:
        raise WireError(uid, op_frame, None, str(err), unknown=True) from None
    spec = SERVED.get(op)
    if spec is None:
        raise WireError(uid, op_frame, op, f"{op} is not served by this daemon", unknown=False)
    payload = frames[2:]
    if len(payload) != len(spec.payload):
        raise WireError(uid, op_frame, op, f"{op} takes {len(spec.payload)} payload frames, got "
                        f"{len(payload)}", unknown=True)
    size = sum(len(frame) for frame in payload)
    if size > spec.max_payload_bytes:
        raise WireError(uid, op_frame, op, f"{op}: a {size}-byte payload, over its "
                        f"{spec.max_payload_bytes}-byte limit", unknown=False)
    args = []
    for i, (decode, frame) in enumerate(zip(_DECODERS[op], payload, strict=True)):
        try:
            args.append(decode(frame))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            raise WireError(uid, op_frame, op, f"{op}'s payload frame {i}: {err}", unknown=True) from None
    return Request(uid, op_frame, op, tuple(args))


def reply_frames(request: Request, value: Any) -> list[bytes]:
    """The reply to a request served: its result (None: no payload frame)."""
    frames = [request.uid, request.op_frame]
    if value is not None:
        frames.append(msgspec.msgpack.encode(value))
    return frames


def failure_frames(uid: bytes, op_frame: bytes, op: str | None, message: str) -> list[bytes]:
    """The reply LMCache's client reads as this request's failure (or a miss): the operation's failure
    value, or, where it has none, an op frame naming the refusal, which fails the client's future."""
    failure = SERVED[op].failure if op in SERVED else ReplyError.OTHER_OP
    if failure is not ReplyError.OTHER_OP:
        return [uid, op_frame, msgspec.msgpack.encode(failure)]
    text = f"lmcache-mp refused {op or 'the request'}: {message}"[:MAX_ERROR_OP_CHARS]
    return [uid, msgspec.msgpack.encode(text)]
