"""Types that cross the process boundary, and the msgspec codecs that carry them.

Keys (`IPCCacheEngineKey`) travel as plain msgpack maps. Tensor handles travel as
msgpack extension types whose payloads are themselves msgspec-encoded structs:
nothing on any socket is ever pickled.

Handles here are plain data and this module imports no torch (so `lmcache-mp ping` and the
protocol never load it) and nothing of `transfer/`: building handles from tensors and opening them
as tensors live in `transfer/cuda.py` (`export_cuda_tensors`, `import_cuda_tensors`: the seed's
`CudaIPCWrapper(tensor)` and `to_tensor()`) and `transfer/shm.py`, which import this module.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Self

import msgspec

# The names and ids a client puts into the daemon's tables (sessions, cancels, tails) and logs,
# bounded as they are decoded (BAD_PAYLOAD past it). vLLM's request ids are ~50 characters, model
# names a path or a hub name.
MAX_REQUEST_ID_CHARS = 256
MAX_MODEL_NAME_CHARS = 1024
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
BoundedModelName = Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)]

# Extension type codes on the wire. Never reorder or reuse a number.
EXT_CUDA_IPC_WRAPPER = 1
EXT_SHARED_MEMORY_TENSOR = 2


class IPCCacheEngineKey(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Names one chunk of KV (hash mode) or a token range of a request (token mode).

    Hash mode sets `chunk_hash` (vLLM block hashes strided to chunk boundaries).
    Token mode sets `token_ids`, `start` and `end`; the daemon hashes the full chunks.
    `worker_id=None` means "every rank" (scheduler-side lookups).
    `request_id` travels with the key but is not part of its identity: equality, hashing
    and ordering ignore it. (A msgspec Struct rather than a dataclass: 5x faster to build
    and decode, which is most of a LOOKUP's cost; it encodes as a compact array.)
    """

    model_name: BoundedModelName
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    worker_id: Annotated[int, msgspec.Meta(ge=0)] | None
    chunk_hash: bytes = b""
    token_ids: tuple[int, ...] = ()
    # Checked as they are decoded: a negative token position is refused (BAD_PAYLOAD).
    start: Annotated[int, msgspec.Meta(ge=0)] = 0
    end: Annotated[int, msgspec.Meta(ge=0)] = 0
    request_id: RequestId | None = None
    # Hash mode: the vLLM blocks of a short chunk (a request's tail, `lmcache_mp/engine/tails.py`), which
    # takes that many block ids in a STORE or RETRIEVE; 0 for a whole chunk (protocol 4 on).
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0

    def _identity(self) -> tuple:
        return (self.model_name, self.world_size, self.worker_id, self.chunk_hash, self.token_ids,
                self.start, self.end, self.num_blocks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IPCCacheEngineKey):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __lt__(self, other: IPCCacheEngineKey) -> bool:
        return self._identity() < other._identity()

    def __le__(self, other: IPCCacheEngineKey) -> bool:
        return self._identity() <= other._identity()

    def __gt__(self, other: IPCCacheEngineKey) -> bool:
        return self._identity() > other._identity()

    def __ge__(self, other: IPCCacheEngineKey) -> bool:
        return self._identity() >= other._identity()

    @property
    def is_token_mode(self) -> bool:
        return not self.chunk_hash

    def no_worker_id_version(self) -> IPCCacheEngineKey:
        return msgspec.structs.replace(self, worker_id=None)

    @staticmethod
    def Serialize(obj: IPCCacheEngineKey) -> bytes:
        return _key_encoder.encode(obj)

    @staticmethod
    def Deserialize(data: bytes) -> IPCCacheEngineKey:
        return _key_decoder.decode(data)


_key_encoder = msgspec.msgpack.Encoder()
_key_decoder = msgspec.msgpack.Decoder(IPCCacheEngineKey)


class TensorHandle:
    """A reference to tensor memory owned by another process, carried as a small state struct.

    Subclasses name their msgpack extension code and their state type; the codecs below
    wrap `Serialize(obj)` in that extension, so a handle is never pickled.
    """

    EXT_CODE: ClassVar[int]
    State: ClassVar[type[msgspec.Struct]]

    def __init__(self, *, state: msgspec.Struct):
        self.state = state

    @classmethod
    def Serialize(cls, obj: TensorHandle) -> bytes:
        return msgspec.msgpack.encode(obj.state)

    @classmethod
    def Deserialize(cls, data: bytes) -> Self:
        return cls(state=msgspec.msgpack.decode(data, type=cls.State))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.state == other.state  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state!r})"


class _CudaIPCState(msgspec.Struct, array_like=True, frozen=True):
    device_uuid: str
    # torch's `UntypedStorage._share_cuda_()` tuple for the storage the view is of. Every view of
    # one storage carries the same tuple (the storage is shared once), which is how the daemon
    # knows to open it once.
    storage_handle: tuple[bytes | int | bool | None, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class CudaIPCWrapper(TensorHandle):
    """A view of a CUDA storage shared by IPC handle: plain data. `transfer.cuda.export_cuda_tensors`
    makes them from tensors and `transfer.cuda.import_cuda_tensors` opens them."""

    EXT_CODE = EXT_CUDA_IPC_WRAPPER
    State = _CudaIPCState
    state: _CudaIPCState


class _SharedMemoryState(msgspec.Struct, array_like=True, frozen=True):
    storage_index: int
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class SharedMemoryTensor(TensorHandle):
    """A CPU tensor view into a shared-memory storage that the daemon maps by file descriptor.

    The descriptors themselves travel over the daemon's attach socket (SCM_RIGHTS) in
    `storage_index` order; this handle only says how to view them (`transfer.shm.view_shared`).
    """

    EXT_CODE = EXT_SHARED_MEMORY_TENSOR
    State = _SharedMemoryState
    state: _SharedMemoryState


_HANDLE_TYPES: dict[int, type[TensorHandle]] = {
    cls.EXT_CODE: cls for cls in (CudaIPCWrapper, SharedMemoryTensor)
}

# A worker's registered KV caches: one handle per layer, in layer order.
KVCache = list[TensorHandle]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TensorHandle):
        return msgspec.msgpack.Ext(obj.EXT_CODE, obj.Serialize(obj))
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    handle_type = _HANDLE_TYPES.get(code)
    if handle_type is None:
        raise msgspec.ValidationError(f"unknown msgpack extension type {code}")
    try:
        return handle_type.Deserialize(bytes(data))
    except msgspec.DecodeError as err:
        # The message around it was valid msgpack: what is wrong is this handle's payload
        # (not msgpack, truncated, or not the state's schema), so say which handle.
        raise msgspec.ValidationError(f"malformed {handle_type.__name__} payload: {err}") from None


def _dec_hook(expected: type, obj: Any) -> Any:
    # Custom classes in a type annotation arrive here already built by _ext_hook;
    # anything else (an int where a handle belongs, say) is a validation error.
    if isinstance(expected, type) and isinstance(obj, expected):
        return obj
    raise msgspec.ValidationError(f"expected {expected.__name__}, got {type(obj).__name__}")


def get_customized_encoder(type: Any = None) -> msgspec.msgpack.Encoder:
    """An encoder that knows the tensor-handle extension types. `type` is accepted for
    symmetry with the decoder; msgspec encoders are not typed."""
    del type
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def get_customized_decoder(type: Any) -> msgspec.msgpack.Decoder:
    """A strict decoder for `type` that also understands the tensor-handle extensions."""
    return msgspec.msgpack.Decoder(type, ext_hook=_ext_hook, dec_hook=_dec_hook)
