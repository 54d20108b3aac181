"""A v1 remote server as a tier: `--l2 lmcache://HOST:PORT[?timeout_s=T]`.

Works against any server that speaks the v1 protocol as LMCache's reference `lmcache_server`
does (`lmcache_mp/v1remote/`), ours (`lmcache-mp remote-server`) included, and uses only what
every such server answers: EXIST, GET, PUT and HEALTH. It never sends LIST (the reference
server never answers it), so it keeps no index: `contains` is one pipelined EXIST per batch.

Key strings follow the reference format, `MODEL@WORLD_SIZE@WORKER_ID@CHUNK_HASH@DTYPE`, with
`lmcmp-` + the chunk format's fingerprint as the model part: the fingerprint already names the
model, layout, rank and chunk size, and a real model name could overflow the key's 150 bytes.
A value is the self-describing object of `chunk_format.py` (fmt BINARY, dtype uint8): a GET
receives its header into a small buffer and its payload straight into the L1 slot, then checks
both against the key (the protocol has no checksum or authentication of its own).

The protocol has no DELETE: a damaged object found on a read stays on the server until it is
evicted or overwritten, and `NetworkTier` remembers it as bad so that write-behind replaces it.
Nor can a model's chunks be dropped (RESET_MODEL): `drop_models` keys its chunks afresh from then
on (a generation in the key's model part), so that this daemon never reads the old ones again,
and still fails, since the server keeps them for a daemon started later or another one sharing it.

Pooled connections. Servers close connections left idle (ours after `--idle-timeout-s`, 60 s by
default), so a pooled connection may be dead when the next batch comes: used as is, the batch
fails (and the tier goes down for a while) or, for a PUT (no reply), is lost without a word. So a
connection idle longer than `MAX_IDLE_S` is dropped, one the server closed is detected (a zero-wait
poll) and dropped before use, and a batch that still finds its pooled connection closed before any
reply (the server closed it between that check and our request) runs once more on a new one. Every
operation here may run twice: EXIST and GET are idempotent, and a PUT re-sent whole stores the
same bytes under the same key again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Set
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

import torch

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.chunk_format import CorruptChunk, as_buffer, header_size_of, verify
from lmcache_mp.storage.tiers.remote import Fetched, NetworkTier
from lmcache_mp.storage.tiers.urls import redact_url
from lmcache_mp.v1remote.client import V1Connection, V1PeerClosedError
from lmcache_mp.v1remote.protocol import Buffer, format_key

logger = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 1.0
IDLE_CONNECTIONS = 4  # kept open for the next batch (a writer, a reader, a probe, one spare)
# A pooled connection idle longer is closed rather than used: well under our server's default idle
# timeout (60 s), so that it is not closed by the server just as a request goes out on it (a lost PUT).
MAX_IDLE_S = 20.0
# Models whose chunks are keyed afresh (`drop_models`) that the tier remembers one by one; past it,
# every model's are (none of the old chunks is read again: misses, never old KV).
MAX_RESET_MODELS = 4096
_KEY_DTYPES = {"float16": "half", "bfloat16": "bfloat16", "float32": "float", "float64": "double",
               "int8": "int8", "uint8": "uint8"}  # other dtypes (fp8) travel as raw bytes: "uint8"


class V1RemoteTier(NetworkTier):
    def __init__(self, name: str, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(name)
        self._address = (host, port)
        self._timeout_s = timeout_s
        self._idle: list[tuple[V1Connection, float]] = []  # (connection, when it went idle)
        self._idle_lock = threading.Lock()
        # Key generations (`drop_models`): one per model, and one for all past MAX_RESET_MODELS.
        self._generations: dict[str, int] = {}
        self._all_generation = 0

    @classmethod
    def from_url(cls, url: str) -> V1RemoteTier:
        parts = urlsplit(url)
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        try:
            host, port = parts.hostname, parts.port
            timeout_s = float(params.pop("timeout_s", DEFAULT_TIMEOUT_S))
        except ValueError:
            host = None
        if parts.scheme != "lmcache" or not host or not port or params or timeout_s <= 0 or parts.path:
            raise ValueError(f"{redact_url(url)!r}: a v1 remote server is named lmcache://HOST:PORT"
                             "[?timeout_s=T] (T > 0)")
        return cls(redact_url(url), host, port, timeout_s)

    # ---- the network primitives ---------------------------------------------------------------

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        names = [self._key_string(k) for k in keys]
        return self._run(lambda conn: conn.exist_many(names))

    def _fetch_many(self, keys: list[ChunkKey], outs: list[torch.Tensor | None]) -> list[Fetched | None]:
        if any(out is None for out in outs):
            raise ValueError("the v1 tier reads into destination buffers only (`out` is required)")
        names = [self._key_string(k) for k in keys]
        heads = [bytearray(header_size_of(k)) for k in keys]
        payloads = [as_buffer(out) for out in outs]  # type: ignore[arg-type]
        buffers = [[head, payload] for head, payload in zip(heads, payloads, strict=True)]

        def fetch(conn: V1Connection) -> tuple[list[int | None], list[bool]]:
            good = [False] * len(keys)  # afresh on a retry: the buffers are received again

            def check(i: int) -> None:  # as each chunk lands, while the next ones are on their way
                with contextlib.suppress(CorruptChunk):
                    verify(keys[i], heads[i], payloads[i])
                    good[i] = True

            return conn.get_into_many(names, buffers, on_received=check), good

        lengths, good = self._run(fetch)
        fetched: list[Fetched | None] = []
        for head, payload, length, ok in zip(heads, payloads, lengths, good, strict=True):
            if length is None:
                fetched.append(None)
            elif ok:
                fetched.append(Fetched(head, payload, verified=True))
            else:  # damaged, or of the wrong size (never received): fails verification, counted corrupt
                fetched.append(Fetched(b"", payload[:0]))
        return fetched

    def _store_many(self, items: Iterable[tuple[ChunkKey, bytes, memoryview]]) -> list[bool]:
        pending = iter(items)  # lazy: each header is checksummed when its turn comes
        sent: list[tuple[str, list[Buffer]]] = []

        def put_all(conn: V1Connection) -> None:
            # On a retry, what went out on the dead connection may be lost: all of it again, whole.
            for name, buffers in sent:
                conn.put(name, buffers)
            for key, head, payload in pending:
                sent.append((self._key_string(key), [head, payload]))
                conn.put(*sent[-1])

        self._run(put_all)
        return [True] * len(sent)  # PUT has no reply: sent is all we know

    def _delete_many(self, keys: list[ChunkKey]) -> int:
        return 0  # no DELETE in the protocol (see the module docstring)

    def drop_models(self, models: Set[str]) -> int:
        with self._idle_lock:
            if len(self._generations) + len(models) > MAX_RESET_MODELS:
                self._generations.clear()
                self._all_generation += 1
            else:
                for model in models:
                    self._generations[model] = self._generations.get(model, 0) + 1
        raise NotImplementedError(f"{self.name}: the v1 protocol has no DELETE, so the model's old chunks "
                                  "stay on the server; this daemon reads them no more (it keys the model's "
                                  "chunks afresh), but one started later, or another sharing the server, "
                                  "would: restart or clear the remote server itself")

    def _key_string(self, key: ChunkKey) -> str:
        return _key_string(key, (self._all_generation, self._generations.get(key.fmt.model_name, 0)))

    def _clear_namespace(self) -> int:
        raise NotImplementedError(f"{self.name}: the v1 protocol has no DELETE; restart or clear the "
                                  "remote server itself")

    def _ping(self) -> None:
        if not self._run(lambda conn: conn.health()):
            raise ConnectionError(f"{self.name} answered HEALTH with FAIL")

    def _close_connections(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _run(self, operation: Callable[[V1Connection], R]) -> R:
        """`operation` on a pooled connection, or a new one. If a pooled one turns out to have been
        closed by the server before answering any of it, once more on a new connection (see the
        module docstring); a new connection that fails is a real failure, never retried."""
        conn, pooled = self._take()
        try:
            replies = conn.replies
            try:
                return operation(conn)
            except V1PeerClosedError as err:
                if not pooled or conn.replies != replies:
                    raise
                logger.debug("%s: a pooled connection was closed by the server (%s); retrying on a "
                             "new one", self.name, err)
            conn = self._open()
            return operation(conn)
        finally:
            self._give_back(conn)

    def _open(self) -> V1Connection:
        return V1Connection(*self._address, timeout_s=self._timeout_s)

    def _take(self) -> tuple[V1Connection, bool]:
        """A live pooled connection (True), or a new one (False)."""
        while True:
            with self._idle_lock:
                conn, idle_since = self._idle.pop() if self._idle else (None, 0.0)
            if conn is None:
                return self._open(), False
            if time.monotonic() - idle_since <= MAX_IDLE_S and not conn.peer_closed():
                return conn, True
            conn.close()

    def _give_back(self, conn: V1Connection) -> None:
        """Pool `conn` for the next batch; a connection that failed is closed, not kept."""
        with self._idle_lock:
            if conn.closed or len(self._idle) >= IDLE_CONNECTIONS or self._closed.is_set():
                conn.close()
            else:
                self._idle.append((conn, time.monotonic()))


def _key_string(key: ChunkKey, generation: tuple[int, int] = (0, 0)) -> str:
    """`key`'s name on the server; a `generation` other than (0, 0) names it afresh (`drop_models`)."""
    fmt = key.fmt
    model = f"lmcmp-{fmt.fingerprint.hex()}"
    if generation != (0, 0):
        model += "-{}.{}".format(*generation)
    return format_key(model, fmt.world_size, fmt.worker_id, key.chunk_hash.hex(),
                      _KEY_DTYPES.get(fmt.dtype, "uint8"))
