"""The daemon's wire protocol: request types, their payload schemas and reply types.

A request is a multipart ZeroMQ message:

    [request_id (8 bytes), request_type (msgpack int), payload]

where `payload` is one msgpack array of the positional payload arguments, each of its
declared type (one frame, not one per argument: each frame costs a send and a receive).
A reply echoes the request id frame verbatim:

    [request_id, status (msgpack int), body]

`status` 0 means success and `body` is the encoded reply type; any other status is an
`ErrorCode` and `body` is an encoded `ErrorReply`. Every request gets exactly one reply.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from lmcache_mp.chunks import TierCleared, TierStats
from lmcache_mp.custom_types import BoundedModelName, IPCCacheEngineKey, KVCache, RequestId
from lmcache_mp.kv_events.log import EventsReply

# Bump on any incompatible change to a schema below. Clients refuse a server whose
# protocol version differs from theirs (see HELLO).
# 2: LOOKUP_CHUNKS; 3: one payload frame (HELLO is still read in 1-2's layout); 4: tails (short
# last chunks, LOOKUP_PREFIX, NOTE_TAILS)
PROTOCOL_VERSION = 4


class RequestType(enum.IntEnum):
    """Explicit numbers: never reorder, never reuse a retired number."""

    HELLO = 1
    PING = 2
    GET_CHUNK_SIZE = 3
    STATUS = 4
    REGISTER_KV_CACHE = 5
    UNREGISTER_KV_CACHE = 6
    LOOKUP = 7
    STORE = 8
    RETRIEVE = 9
    END_SESSION = 10
    CLEAR = 11
    CANCEL_TRANSFERS = 12
    RELEASE_LEASES = 13
    CLEAR_TIERS = 14
    LOOKUP_CHUNKS = 15
    KV_EVENTS = 16
    LOOKUP_PREFIX = 17
    NOTE_TAILS = 18
    RESET_MODEL = 19


class ErrorCode(enum.IntEnum):
    OK = 0
    MALFORMED_MESSAGE = 1  # frames missing or undecodable request id / type
    UNKNOWN_REQUEST_TYPE = 2
    BAD_PAYLOAD = 3  # no payload frame or several, or a payload that fails its schema
    NOT_IMPLEMENTED = 4
    INVALID_ARGUMENT = 5  # well-formed but semantically wrong (bad block ids, ...)
    UNKNOWN_INSTANCE = 6  # no KV cache registered under that instance id
    OVERLOADED = 7  # the bounded work queue is full; retry later
    SHUTTING_DOWN = 8
    INTERNAL = 9  # a bug on the daemon's side; the message says what
    # REGISTER_KV_CACHE under an instance id that is registered already: refused, never replaced
    # (another worker's id; a worker picks a fresh random id and registers again).
    ALREADY_REGISTERED = 10
    CANCELLED = 11  # a STORE its worker cancelled (CANCEL_TRANSFERS) before it finished: nothing stored
    # The daemon is starting: it answers HELLO, PING, GET_CHUNK_SIZE and STATUS from its first
    # moment, every other request this until its engine is built (seconds: torch is imported
    # then). Retry, as for a daemon that is not there yet.
    STARTING = 12
    # A request about a registration made on another connection (CANCEL_TRANSFERS,
    # UNREGISTER_KV_CACHE): only the connection that registered an instance may act on it.
    FORBIDDEN = 13


# Errors no retry of the same request can change: the daemon found the request itself invalid.
PERMANENT_ERRORS = frozenset({ErrorCode.MALFORMED_MESSAGE, ErrorCode.UNKNOWN_REQUEST_TYPE,
                              ErrorCode.BAD_PAYLOAD, ErrorCode.NOT_IMPLEMENTED, ErrorCode.INVALID_ARGUMENT,
                              ErrorCode.FORBIDDEN})


# The daemon's phase, in HELLO and STATUS: "starting" until its engine is built (requests other than
# HELLO, PING, GET_CHUNK_SIZE and STATUS get STARTING), then "serving". A daemon that predates the
# field is serving whenever it answers.
PHASE_STARTING = "starting"
PHASE_SERVING = "serving"


class ErrorReply(msgspec.Struct, array_like=True, gc=False):
    code: int
    message: str


# ---- payload and reply structs ------------------------------------------------------------


class HelloReply(msgspec.Struct, gc=False):
    protocol_version: int
    server_version: str
    chunk_size: int
    # Unix socket on which workers pass shared-memory descriptors (CPU KV registration); it
    # exists once the daemon is serving.
    attach_socket: str
    phase: str = PHASE_SERVING
    # Random per daemon process: a client that sees it change knows the daemon restarted, however
    # fast (its registrations, leases and requests in flight are gone; the chunks may not be).
    epoch: int = 0


class KVCacheRegistration(msgspec.Struct, gc=False):
    """Who registers, and how to read their caches."""

    model_name: str
    world_size: int
    worker_id: int
    # vLLM's KV layout name for the attention backend, e.g. "CPU_ATTN" or "FLASH_ATTN".
    # Empty: the daemon infers the layout from the tensor shapes.
    layout: str = ""
    # Token handed to the attach socket together with the shared-memory descriptors.
    # Empty for CUDA registrations, whose handles carry everything.
    attach_token: bytes = b""
    # vLLM's block size in tokens: what one block id covers. A backend may split each block into
    # kernel blocks (the caches' block dimension then counts `ratio` times as many, of
    # block_size / ratio tokens); the daemon groups them back, or refuses caches it cannot.
    # 0 (clients that predate the field): the caches' own block size.
    block_size: int = 0
    # Every rank of the world holds the same bytes (MLA's latent cache under tensor parallelism
    # alone): each chunk is stored once for all ranks, and a one-rank engine of the model reads
    # it too. Only for MLA layouts (refused otherwise).
    replicated: bool = False


class RegisterReply(msgspec.Struct, gc=False):
    layout: str
    num_layers: int
    # In the blocks a block id names (kernel blocks grouped): a worker whose block size is not
    # `block_size` (a daemon that predates `KVCacheRegistration.block_size`) must not use it.
    num_blocks: int
    block_size: int
    chunk_bytes: int


class ChunkOutcome(enum.IntEnum):
    STORED = 0
    ALREADY_PRESENT = 1
    NO_SPACE = 2


class StoreResult(msgspec.Struct, array_like=True, gc=False):
    # CUDA event IPC handle recorded after the copies; empty on CPU, where the reply
    # itself means the bytes are in place.
    event_handle: bytes
    outcomes: list[ChunkOutcome]

    def __bool__(self) -> bool:
        return all(o != ChunkOutcome.NO_SPACE for o in self.outcomes)


class RetrieveResult(msgspec.Struct, array_like=True, gc=False):
    event_handle: bytes
    ok: bool
    # Why a retrieve loaded nothing (all or nothing per request); empty on success.
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class TailHit(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request's tail: the tokens past a chunk that a short chunk holds (`tails.py`)."""

    num_tokens: Annotated[int, msgspec.Meta(ge=1)]  # past the anchor chunk's end
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]  # vLLM blocks, the last maybe partly filled
    tail_hash: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
    # vLLM's hash of the tail's last full block (b"": the tail is shorter than a block): a
    # lookup offers it only to a prompt that holds that block.
    last_block: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class PrefixHit(msgspec.Struct, array_like=True, gc=False):
    """LOOKUP_PREFIX's answer: the leading chunks held, and the tails held after the last of
    them (newest first), each leased like the chunks."""

    chunks: int
    tails: list[TailHit] = []


class TailNote(msgspec.Struct, array_like=True, gc=False):
    """NOTE_TAILS: a tail and the key of the chunk it follows (b"": it starts at token 0)."""

    anchor: Annotated[bytes, msgspec.Meta(max_length=64)]
    tail: TailHit


# A model as its workers register it (`vllm_adapter.model_identity`; a hybrid model's KV cache groups
# each under a name of its own: `vllm_adapter.kv_groups`).
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class ModelScope(msgspec.Struct, array_like=True, gc=False):
    """RESET_MODEL's payload: the models whose chunks go, each named as its workers register it."""

    model_names: Annotated[list[ModelName], msgspec.Meta(min_length=1, max_length=64)]


class ModelReset(msgspec.Struct, gc=False):
    """RESET_MODEL's answer: what went, where. Confirmed (`ok`) only if every lower tier dropped
    the models' chunks; a tier's `error` says why it did not."""

    pool_chunks: int  # objects (one per rank) taken out of the pool
    tails: int  # tails forgotten by the index (`tails.py`)
    tiers: list[TierCleared] = []  # per lower tier, in order: objects removed, or why not

    @property
    def ok(self) -> bool:
        return not any(tier.error for tier in self.tiers)


# The daemon's front doors: its own protocol (`--listen`), LMCache's connector's wire (`--lmcache-listen`).
NATIVE_DOOR = "native"
LMCACHE_DOOR = "lmcache"


class InstanceInfo(msgspec.Struct, gc=False):
    """A registered worker, as STATUS shows it."""

    instance_id: int
    model_name: str
    world_size: int
    worker_id: int
    layout: str
    num_layers: int
    num_blocks: int
    kv_bytes: int  # the registered KV cache's size
    door: str = NATIVE_DOOR  # the front door it registered through


class DoorInfo(msgspec.Struct, gc=False):
    """A front door, as STATUS shows it: where it listens and what it served since start."""

    name: str  # NATIVE_DOOR or LMCACHE_DOOR
    endpoints: list[str]
    requests_total: int  # requests answered
    failed_total: int  # of those, answered with an error (LMCache's wire: a failure or a miss)
    registered_instances: int  # registered through it, now


class CapacityPoint(msgspec.Struct, gc=False):
    """The pool's hit rate predicted at a multiple of its size (`engine/capacity_advisor.py`)."""

    pool_scale: float  # of the pool's capacity
    pool_bytes: int
    hit_rate: float


class StatusReport(msgspec.Struct, gc=False):
    server_version: str
    protocol_version: int
    uptime_s: float
    chunk_size: int
    endpoints: list[str]
    phase: str = PHASE_SERVING  # PHASE_STARTING: no engine yet, so no pool either (zeros below)
    pool_bytes: int = 0
    pool_used_bytes: int = 0
    # The pool's memory is prepared in the background from its start; STOREs find NO_SPACE
    # beyond what is ready until `pool_ready`.
    pool_ready_bytes: int = 0
    pool_ready: bool = False
    # Where CUDA is present the pool is page-locked for DMA as it is prepared; if that fails, the
    # rest is used unpinned (copies stay correct, slower) and `pool_pin_error` says why.
    pool_pinned_bytes: int = 0
    pool_pin_error: str = ""
    epoch: int = 0  # as in HELLO
    # Warm restart: the pool file ("" for a pool in anonymous memory), what this start adopted
    # from it (chunks, bytes, and of those the ones not yet checksummed when the last daemon died),
    # adopted chunks checked since and dropped (failed their check), and the queues: adopted
    # chunks still to be checked (readers can't see them yet), new chunks still to be checksummed.
    pool_file: str = ""
    pool_adopted_chunks: int = 0
    pool_adopted_bytes: int = 0
    pool_adopted_unsealed: int = 0
    pool_verified_total: int = 0
    pool_dropped_total: int = 0
    pool_unverified: int = 0
    pool_unsealed: int = 0
    objects: int = 0
    registered_instances: list[int] = []
    instances: list[InstanceInfo] = []
    # LOOKUP's chunks asked for and found since start: the hit rate
    lookup_chunks_total: int = 0
    lookup_hits_total: int = 0
    # The pool's hit rate predicted at 0.5x to 8x its capacity, from the LOOKUPs since start, and
    # the sampled chunk accesses it rests on (`engine/capacity_advisor.py`: what it models, and not)
    capacity_curve: list[CapacityPoint] = []
    capacity_sampled_chunks: int = 0
    sessions: int = 0
    leases: int = 0
    # STOREs and RETRIEVEs copying, per (instance, request), and those pairs remembered as
    # cancelled (CANCEL_TRANSFERS; bounded)
    transfers_running: int = 0
    cancelled_transfers: int = 0
    requests_in_flight: int = 0
    # RETRIEVE chunks copied by a helper thread, not the request's own (a split RETRIEVE), ever
    split_chunks: int = 0
    tiers: list[TierStats] = []  # the tiers below the pool, in order
    # KV events (`kv_events`): the PUB and replay endpoints ([] without --kv-events-listen), the
    # event log's next seq, and the batches and events published and the events lost (the log's
    # ring overran the publisher; subscribers were resynced) since start.
    kv_events_endpoints: list[str] = []
    kv_events_seq: int = 0
    kv_events_batches_total: int = 0
    kv_events_published_total: int = 0
    kv_events_dropped_total: int = 0
    # Resyncs (AllBlocksCleared, then every chunk held; `kv_events/resync.py`) finished since start,
    # and whether one is asked for or running: the stream has settled when none is and
    # kv_events_published_total + kv_events_dropped_total == kv_events_seq.
    kv_events_resyncs_total: int = 0
    kv_events_resyncing: bool = False
    # Requests' tails (`tails.py`): in the index now; noted (NOTE_TAILS) and offered by
    # LOOKUP_PREFIX since start.
    tails_indexed: int = 0
    tails_offered_total: int = 0
    tails_noted_total: int = 0
    doors: list[DoorInfo] = []  # the native door first, then the lmcache door if it listens


class HandlerKind(enum.Enum):
    """Where the daemon runs a request's handler (see server.py)."""

    INLINE = enum.auto()  # on the socket thread: bookkeeping only, never blocks
    WORKER = enum.auto()  # on the bounded worker pool: copies, mappings, whole-pool sweeps
    # On a worker pool of its own, the load lane: vLLM's forward pass waits for a load, which must
    # never queue behind a long prefill's STORE or a REGISTER that maps a whole cache.
    LOAD = enum.auto()
    # On the socket thread, like INLINE, but the handler may return a Future instead of a
    # value: the reply goes out when it completes (a LOOKUP that reads from a lower tier).
    # It may also return a `dispatch.ReplyThen`.
    DEFERRED = enum.auto()


# The most payload bytes a request of each size class can legitimately need, checked before
# it is decoded on the socket thread (decoding takes ~60x the bytes in memory, and time).
SMALL_PAYLOAD = 4 << 10  # a few scalars and names
# Keys and block ids of one request: a 1M-token prompt is 4,096 chunk keys (~0.5 MiB) and
# 65,536 blocks of 16 tokens (~0.3 MiB); several times that.
KEYS_PAYLOAD = 4 << 20
REGISTER_PAYLOAD = 4 << 20  # a handle per layer: ~0.5 MiB for 1,000 layers
# Request ids a worker cancels at once: those it had in flight (~100 bytes each), far below this.
CANCEL_PAYLOAD = 256 << 10
TAILS_PAYLOAD = 64 << 10  # a finished request's few tails
RESET_PAYLOAD = 96 << 10  # up to 64 model names of up to 1 KiB


@dataclass(frozen=True)
class RequestSpec:
    payload: tuple[Any, ...]  # one type per payload argument
    reply: Any
    kind: HandlerKind
    max_payload_bytes: int = SMALL_PAYLOAD  # larger: BAD_PAYLOAD, not decoded


Keys = list[IPCCacheEngineKey]

PROTOCOL: dict[RequestType, RequestSpec] = {
    # HELLO(client protocol version, client name) -> who the server is.
    RequestType.HELLO: RequestSpec((int, str), HelloReply, HandlerKind.INLINE),
    # PING(nonce) -> the same nonce, so a caller can match replies to requests.
    RequestType.PING: RequestSpec((int,), int, HandlerKind.INLINE),
    RequestType.GET_CHUNK_SIZE: RequestSpec((), int, HandlerKind.INLINE),
    RequestType.STATUS: RequestSpec((), StatusReport, HandlerKind.INLINE),
    # REGISTER_KV_CACHE(instance id, one handle per layer in layer order, who/how). The id is the
    # worker's own random 63-bit number, unique per registration: never a pid, which repeats
    # across containers sharing one daemon.
    RequestType.REGISTER_KV_CACHE: RequestSpec((int, KVCache, KVCacheRegistration), RegisterReply,
                                                    HandlerKind.WORKER, REGISTER_PAYLOAD),
    # UNREGISTER_KV_CACHE(instance id) -> whether it was registered (FORBIDDEN: by another
    # connection).
    RequestType.UNREGISTER_KV_CACHE: RequestSpec((int,), bool, HandlerKind.WORKER),
    # LOOKUP(keys without worker id) -> number of leading chunks present on every rank, in any
    # tier (deferred while chunks are read up from a lower tier).
    RequestType.LOOKUP: RequestSpec((Keys,), int, HandlerKind.DEFERRED, KEYS_PAYLOAD),
    # LOOKUP_CHUNKS(model name, world size, request id or None, chunk hashes) -> as LOOKUP of one
    # hash-mode key per hash (without worker id, all of that request): the scheduler's usual
    # LOOKUP with the fields its keys share sent once. A list of bytes decodes ~40x faster than as
    # many keys, which made most of a LOOKUP's cost beyond a PING's.
    RequestType.LOOKUP_CHUNKS: RequestSpec((BoundedModelName, int, RequestId | None, list[bytes]), int,
                                            HandlerKind.DEFERRED, KEYS_PAYLOAD),
    # LOOKUP_PREFIX(as LOOKUP_CHUNKS, then the window: vLLM's block hashes of the prompt's last
    # chunk and past it) -> the leading chunks held, as LOOKUP_CHUNKS counts them, and the tails
    # noted after the last of them whose last full block is in the window (or that have none)
    # that the pool holds, leased too (`tails.py`).
    RequestType.LOOKUP_PREFIX: RequestSpec(
        (BoundedModelName, int, RequestId | None, list[bytes], list[bytes]), PrefixHit, HandlerKind.DEFERRED,
        KEYS_PAYLOAD),
    # NOTE_TAILS(model name, world size, tails stored, tails superseded): index the first (their
    # STOREs may land later), forget the second and free them from the pool where unleased. Fire
    # and forget.
    RequestType.NOTE_TAILS: RequestSpec((BoundedModelName, int, list[TailNote], list[TailNote]), None,
                                         HandlerKind.INLINE, TAILS_PAYLOAD),
    # STORE / RETRIEVE(keys, instance id, block ids, CUDA event IPC handle or b""). The last
    # chunk may be short: fewer block ids than a chunk's (a tail; `keys.short_chunk_hash`).
    RequestType.STORE: RequestSpec((Keys, int, list[int], bytes), StoreResult, HandlerKind.WORKER,
                                      KEYS_PAYLOAD),
    RequestType.RETRIEVE: RequestSpec((Keys, int, list[int], bytes), RetrieveResult,
                                         HandlerKind.LOAD, KEYS_PAYLOAD),
    # END_SESSION(request id): release everything the request still holds.
    RequestType.END_SESSION: RequestSpec((RequestId,), None, HandlerKind.INLINE),
    # RELEASE_LEASES(keys without worker id, as for LOOKUP, request id set; a token key names
    # the chunks from its `start`): release the leases the keys' requests hold on those chunks,
    # on every rank: chunks a request will not retrieve (e.g. inside vLLM's own prefix hit).
    # Its other leases stay until RETRIEVE / END_SESSION. Fire and forget, like END_SESSION.
    RequestType.RELEASE_LEASES: RequestSpec((Keys,), None, HandlerKind.INLINE, KEYS_PAYLOAD),
    # CLEAR() -> number of objects dropped from the CPU pool (objects under lease or being
    # written stay; lower tiers are persistent and keep theirs).
    RequestType.CLEAR: RequestSpec((), int, HandlerKind.WORKER),
    # CLEAR_TIERS() -> per lower tier, in order, the objects removed from its namespace (every
    # model) or why it could not (a v1 server has no DELETE; a tier that is down). Chunks queued
    # for writing may still land after it. Slow on a large network tier (it scans).
    RequestType.CLEAR_TIERS: RequestSpec((), list[TierCleared], HandlerKind.WORKER),
    # RESET_MODEL(models) -> what went: every chunk of these models (every rank, world size and
    # layout; other models' stay) out of the pool and every lower tier, and their tails out of the
    # index, answered once no reader can find one (vLLM's `reset_prefix_cache(reset_connector=True)`
    # after a weight update). Chunks a request holds leased are freed once released; a STORE of
    # theirs reserved before and committed after stores nothing, nor does one that arrived before
    # it and runs after (answered ALREADY_PRESENT: there is nothing for its worker to send again).
    # `ModelReset.ok` is False where a tier could not drop them (down, or a v1 server: no DELETE).
    RequestType.RESET_MODEL: RequestSpec((ModelScope,), ModelReset, HandlerKind.WORKER, RESET_PAYLOAD),
    # CANCEL_TRANSFERS(instance id, request ids) -> how many of these requests had a STORE or
    # RETRIEVE copying that was stopped and waited for. Sent by a worker whose STORE or RETRIEVE
    # got no reply in time, before it lets vLLM reuse the blocks. Once it is answered, no STORE
    # or RETRIEVE of these requests sent before it touches that instance's blocks any more (those
    # sent after it run as usual): one not started yet
    # is refused (a RETRIEVE: RetrieveResult ok=False, reason "cancelled", its leases spent; a
    # STORE: CANCELLED, nothing stored), one copying stops at its next chunk and is waited for
    # (deferred until then; a stopped STORE publishes nothing). Unknown requests answer 0 at once.
    # Only the connection that registered the instance may send it (FORBIDDEN otherwise); one
    # for an instance not registered records nothing. A full record answers OVERLOADED.
    RequestType.CANCEL_TRANSFERS: RequestSpec((int, list[RequestId]), int, HandlerKind.DEFERRED,
                                               CANCEL_PAYLOAD),
    # KV_EVENTS(from seq, model names, most events) -> the event log's records (`kv_events`) of
    # these models' chunks, and every clear, from that seq (-1: none, only where the log ends):
    # what a connector follows to hand its engine's chunks to vLLM's KV event stream.
    RequestType.KV_EVENTS: RequestSpec((int, list[str], int), EventsReply, HandlerKind.INLINE),
}

assert set(PROTOCOL) == set(RequestType), "every request type needs a spec"
