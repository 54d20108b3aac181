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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlsplit

import torch

from lmcache_mp.storage.base import ChunkKey
from lmcache_mp.storage.chunk_format import CorruptChunk, as_buffer, header_size_of, verify
from lmcache_mp.storage.remote import Fetched, NetworkTier
from lmcache_mp.storage.tiers import redact_url
from lmcache_mp.v1remote.client import V1Connection
from lmcache_mp.v1remote.protocol import format_key

DEFAULT_TIMEOUT_S = 1.0
IDLE_CONNECTIONS = 4  # kept open for the next batch (a writer, a reader, a probe, one spare)
_KEY_DTYPES = {"float16": "half", "bfloat16": "bfloat16", "float32": "float", "float64": "double",
               "int8": "int8", "uint8": "uint8"}  # other dtypes (fp8) travel as raw bytes: "uint8"


class V1RemoteTier(NetworkTier):
    def __init__(self, name: str, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(name)
        self._address = (host, port)
        self._timeout_s = timeout_s
        self._idle: list[V1Connection] = []
        self._idle_lock = threading.Lock()

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
        with self._connection() as conn:
            return conn.exist_many([_key_string(k) for k in keys])

    def _fetch_many(self, keys: list[ChunkKey], outs: list[torch.Tensor | None]) -> list[Fetched | None]:
        if any(out is None for out in outs):
            raise ValueError("the v1 tier reads into destination buffers only (`out` is required)")
        heads = [bytearray(header_size_of(k)) for k in keys]
        payloads = [as_buffer(out) for out in outs]  # type: ignore[arg-type]
        good = [False] * len(keys)

        def check(i: int) -> None:  # as each chunk lands, while the next ones are on their way
            with contextlib.suppress(CorruptChunk):
                verify(keys[i], heads[i], payloads[i])
                good[i] = True

        buffers = [[head, payload] for head, payload in zip(heads, payloads, strict=True)]
        with self._connection() as conn:
            lengths = conn.get_into_many([_key_string(k) for k in keys], buffers, on_received=check)
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
        sent = 0
        with self._connection() as conn:
            for key, head, payload in items:
                conn.put(_key_string(key), [head, payload])
                sent += 1
        return [True] * sent  # PUT has no reply: sent is all we know

    def _delete_many(self, keys: list[ChunkKey]) -> int:
        return 0  # no DELETE in the protocol (see the module docstring)

    def _clear_namespace(self) -> int:
        raise NotImplementedError(f"{self.name}: the v1 protocol has no DELETE; restart or clear the "
                                  "remote server itself")

    def _ping(self) -> None:
        with self._connection() as conn:
            if not conn.health():
                raise ConnectionError(f"{self.name} answered HEALTH with FAIL")

    def _close_connections(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @contextmanager
    def _connection(self) -> Iterator[V1Connection]:
        """An open connection for one batch; a connection that failed is closed, not kept."""
        with self._idle_lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = V1Connection(*self._address, timeout_s=self._timeout_s)
        try:
            yield conn
        finally:
            with self._idle_lock:
                if conn.closed or len(self._idle) >= IDLE_CONNECTIONS or self._closed.is_set():
                    conn.close()
                else:
                    self._idle.append(conn)


def _key_string(key: ChunkKey) -> str:
    fmt = key.fmt
    return format_key(f"lmcmp-{fmt.fingerprint.hex()}", fmt.world_size, fmt.worker_id, key.chunk_hash.hex(),
                      _KEY_DTYPES.get(fmt.dtype, "uint8"))
