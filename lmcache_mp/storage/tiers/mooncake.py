"""The Mooncake Store tier: chunks as objects of a Mooncake Store cluster, over TCP or RDMA.

    mooncake://MASTER_HOST:PORT[/PREFIX]?protocol=tcp&metadata_server=URL

    protocol=NAME          tcp (the default) or rdma: how the transfer engine moves bytes
    rdma_devices=NAMES     with rdma, the NICs to use (comma-separated; default: the engine's choice)
    metadata_server=URL    the transfer engine's metadata service (default
                           http://MASTER_HOST:8080/metadata, the master's own with
                           --enable_http_metadata_server; etcd://HOST:PORT also works)
    local_hostname=HOST    the address the cluster reaches this node at (default: the one this
                           host reaches the master from)
    local_buffer_mb=N      the client's buffer that reads land in (default 1024): the LOOKUPs
                           promoting at once must fit in it, or their last chunks are misses
    timeout_s=T            the longest one call may take (default 2)
    max_in_flight=N        chunks per call (default 32); the client moves a call's chunks at once
    register_pool=BOOL     register the whole pool with the transfer engine, so that writes go
                           straight from it (default false: see "Bytes")

Mooncake Store keeps objects in the memory that its storage nodes (`mooncake_client`, or the
clients of engines that lend memory) mount; the master knows where each object is. This tier's
client lends nothing (a daemon that stops takes no one's chunks with it): chunks outlive a
daemon's restart, not the storage nodes' nor the master's (without its HA mode a restarted
master knows no object written before). The master evicts by its own watermarks.

Objects are keyed `PREFIX/MODEL/FINGERPRINT/CHUNK_HASH` (PREFIX defaults to "lmcache-mp") and
hold the checksummed self-describing chunk (`chunk_format.py`). Mooncake cannot list keys, but
it removes by regular expression: RESET_MODEL removes `PREFIX/MODEL/<hex>/<hex>`, CLEAR_TIERS
`PREFIX/...`. Removals are forced: an object's read lease (a few seconds) does not keep it.

Bytes. The transfer engine serves the memory registered with it to the cluster's other engines,
with no authentication, on ports it opens on every interface: whoever reaches them can read and
write it. So by default only the client's own buffer and this tier's small header arena are
registered, and each chunk's bytes are copied into the client's buffer on their way out. With
`register_pool=true` (a private network of trusted nodes) the pool's whole memory is registered
once the pool exists (`share_memory`), and each chunk is sent from its pool slot behind its header,
with no copy; that exposes every chunk of every tenant to the network. Reads land in the client's
buffer, are verified there and copied into the pool slot: a read may not target the pool, because
the deadline below can give up on a call that then still writes into its destination, a slot the
pool has given to another chunk meanwhile. A write given up on can at worst store bytes that fail
their checksum.

Deadlines. The client blocks for seconds while its master is gone and for 30 s while a storage
node hangs, so every call runs with a deadline (`calls.py`). A check at start says in one line
what is wrong (no master, no metadata service, a setup that fails) and the tier starts *down*
(`remote.py`): the daemon serves from its pool, and the tier comes up once the probe connects.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np
import torch

# The client logs to stderr, INFO and up by default: lines per connection. The tier says what
# matters itself; the client's errors stay visible. An operator's setting wins.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
from mooncake.store import MooncakeDistributedStore

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.tiers.calls import CallRunner
from lmcache_mp.storage.tiers.remote import Fetched, NetworkTier
from lmcache_mp.storage.tiers.urls import query_params, redact_url

logger = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_PREFIX = "lmcache-mp"
DEFAULT_METADATA_PORT = 8080
# One LOOKUP's promotion lands whole in the client's read buffer before it is copied out, and
# several LOOKUPs promote at once: 256 MiB held 28 of 32 chunks of 8 MiB, and 7 of a request's 8
# chunks of 32 MiB (an 8B model's), the rest misses.
DEFAULT_LOCAL_BUFFER_MB = 1024
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_IN_FLIGHT = 32
SETUP_TIMEOUT_S = 10.0  # a setup registers with the master and the metadata service
CALL_THREADS = 8
HEADER_SLOT_BYTES = 1024  # a chunk's header is ~150 bytes; a longer one goes the copying way
_PARAMS = frozenset({"protocol", "rdma_devices", "metadata_server", "local_hostname", "local_buffer_mb",
                     "timeout_s", "max_in_flight", "register_pool"})
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# The client's codes (Mooncake's ErrorCode): those that mean "the cluster did not answer" take
# the tier down; the others are one object's fate.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
_UNREACHABLE = {-900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
                -103: "CLIENT_NOT_FOUND", -1: "INTERNAL_ERROR"}
_REGEX_SPECIALS = re.compile(r"([\\^$.|?*+()\[\]{}])")


class MooncakeUnavailable(ConnectionError):
    """The cluster cannot be used now: said in words an operator can act on."""


@dataclass(frozen=True)
class MooncakeSettings:
    master: tuple[str, int]
    prefix: str
    protocol: str
    rdma_devices: str
    metadata_server: str
    local_hostname: str
    local_buffer_bytes: int
    timeout_s: float
    max_in_flight: int
    register_pool: bool = False

    @property
    def master_address(self) -> str:
        return f"{self.master[0]}:{self.master[1]}"


class MooncakeTier(NetworkTier):
    transient_errors = (OSError,)  # MooncakeUnavailable, TimeoutError, a refused connection

    def __init__(self, name: str, settings: MooncakeSettings) -> None:
        super().__init__(name)
        self._settings = settings
        self._calls = CallRunner(CALL_THREADS, "lmcache-mp-mooncake")
        self._client_lock = threading.Lock()
        self._client: MooncakeDistributedStore | None = None
        self._connecting = None  # the Future of a setup under way
        # Headers of a zero-copy write batch, in registered memory (RDMA reads them from there).
        self._headers = np.zeros(settings.max_in_flight * HEADER_SLOT_BYTES, dtype=np.uint8)
        self._headers_lock = threading.Lock()
        self._shared: tuple[int, int] | None = None  # the pool's memory: (address, bytes)
        self._registered: list[tuple[int, int]] = []  # what the client has registered
        try:
            self._ping()
        except self.transient_errors as e:
            self._went_down("connecting at start", e, logging.ERROR)

    @classmethod
    def from_url(cls, url: str) -> MooncakeTier:
        return cls(redact_url(url), parse_url(url))

    def share_memory(self, memory: torch.Tensor) -> None:
        if not self._settings.register_pool:
            return  # the transfer engine would serve it to every peer that reaches it
        with self._client_lock:
            self._shared = (memory.data_ptr(), memory.numel() * memory.element_size())
            client = self._client
        if client is not None:
            try:
                self._calls.call(self._settings.timeout_s, self._register, client)
            except TimeoutError as e:
                logger.warning("%s: registering the pool's memory: %s; writes are copied", self.name, e)

    # ---- the network primitives ---------------------------------------------------------------

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        client = self._connected()
        found: list[bool] = []
        for group in _groups(keys, self._settings.max_in_flight):
            codes = self._call(client.batch_is_exist, [self._name_of(k) for k in group])
            _raise_if_unreachable(codes)
            found += [code == 1 for code in codes]
        return found

    def _fetch_many(self, keys: list[ChunkKey], outs: list) -> list[Fetched | None]:
        client = self._connected()
        fetched: list[Fetched | None] = []
        for group in _groups(keys, self._settings.max_in_flight):
            names = [self._name_of(k) for k in group]
            handles = self._call(client.batch_get_buffer, names)
            absent = [name for name, handle in zip(names, handles, strict=True) if handle is None]
            if absent:  # a miss, or a master that did not answer: only is_exist tells which
                _raise_if_unreachable(self._call(client.batch_is_exist, absent))
            # A view keeps its handle, and the handle its piece of the client's buffer, until
            # the chunk is verified and copied out.
            fetched += [None if h is None else Fetched.from_blob(memoryview(h).cast("B")) for h in handles]
        return fetched

    def _store_many(self, items: Iterable[tuple[ChunkKey, bytes, memoryview]]) -> list[bool]:
        client = self._connected()
        stored: list[bool] = []
        items = iter(items)
        while group := list(islice(items, self._settings.max_in_flight)):
            direct = [self._in_shared(payload) and len(header) <= HEADER_SLOT_BYTES
                      for _, header, payload in group]
            codes = dict.fromkeys(range(len(group)), 0)
            if any(direct):
                picked = [i for i, d in enumerate(direct) if d]
                codes.update(zip(picked, self._put_direct(client, [group[i] for i in picked]), strict=True))
            copied = [i for i, d in enumerate(direct) if not d]
            if copied:
                named = [(self._name_of(key), header, payload)
                         for key, header, payload in (group[i] for i in copied)]
                codes.update(zip(copied, self._call(_put_copies, client, named), strict=True))
            results = [codes[i] for i in range(len(group))]
            _raise_if_unreachable(results)
            stored += [code in (0, OBJECT_ALREADY_EXISTS) for code in results]
        return stored

    def _delete_many(self, keys: list[ChunkKey]) -> int:
        client = self._connected()
        removed = 0
        for group in _groups(keys, self._settings.max_in_flight):
            codes = self._call(client.batch_remove, [self._name_of(k) for k in group], True)
            _raise_if_unreachable(codes)
            removed += sum(code == 0 for code in codes)
        return removed

    def _clear_namespace(self) -> int:
        return self._remove_matching(f"^{_escaped(self._settings.prefix)}/")

    def _drop_models(self, models: Set[str]) -> int:
        # The whole key: a model whose name extends this one's with a slash keeps its chunks.
        return sum(self._remove_matching(f"^{_escaped(self._settings.prefix)}/{_escaped(model)}"
                                         "/[0-9a-f]+/[0-9a-f]+$") for model in models)

    def _ping(self) -> None:
        client = self._connected()
        _raise_if_unreachable(self._call(client.batch_is_exist, [f"{self._settings.prefix}/.probe"]))

    def _close_connections(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        # A call stuck in the client (a hung storage node) keeps it: closing it under that call
        # could crash the process. It goes with the process.
        if client is not None and self._calls.wait_idle(self._settings.timeout_s):
            for address, _ in self._registered:
                client.unregister_buffer(address)
            client.close()
        self._calls.close()

    # ---- connecting ---------------------------------------------------------------------------

    def _connected(self) -> MooncakeDistributedStore:
        """The set-up client; a setup runs once at a time, and one that outlives its deadline
        is taken up by a later call once it ends."""
        with self._client_lock:
            if self._client is not None:
                return self._client
            connecting = self._connecting
        if connecting is None:
            _check_reachable(self._settings)
            with self._client_lock:
                if self._connecting is None:
                    self._connecting = self._calls.submit(self._setup)
                connecting = self._connecting
        try:
            client = connecting.result(SETUP_TIMEOUT_S)
        except TimeoutError:
            raise MooncakeUnavailable(
                f"the master at {self._settings.master_address} took over {SETUP_TIMEOUT_S:g} s to "
                "take a client (is it a mooncake_master?)") from None
        except BaseException:
            with self._client_lock:
                if self._connecting is connecting:
                    self._connecting = None
            raise
        with self._client_lock:
            self._client, self._connecting = client, None
        return client

    def _setup(self) -> MooncakeDistributedStore:
        s = self._settings
        client = MooncakeDistributedStore()
        code = client.setup(s.local_hostname, s.metadata_server, 0, s.local_buffer_bytes, s.protocol,
                            s.rdma_devices, s.master_address)
        if code != 0:
            client.close()
            raise MooncakeUnavailable(f"the client's setup with the master at {s.master_address} and "
                                      f"the metadata service {s.metadata_server} failed ({code})")
        self._register(client)
        return client

    def _register(self, client: MooncakeDistributedStore) -> None:
        """Register the header arena and the pool's memory, once each."""
        with self._client_lock:
            spans = [(self._headers.ctypes.data, self._headers.nbytes)]
            if self._shared is not None:
                spans.append(self._shared)
        for address, nbytes in spans:
            if any(address == done for done, _ in self._registered):
                continue
            code = client.register_buffer(address, nbytes)
            if code != 0:  # writes from there then take the copying way
                logger.warning("%s: cannot register %.1f MiB with the transfer engine (%d); writes "
                               "from it are copied", self.name, nbytes / 2**20, code)
                continue
            with self._client_lock:
                self._registered.append((address, nbytes))

    # ---- one call each ------------------------------------------------------------------------

    def _call(self, call: Callable[..., R], *args: object) -> R:
        return self._calls.call(self._settings.timeout_s, call, *args)

    def _put_direct(self, client: MooncakeDistributedStore,
                    group: list[tuple[ChunkKey, bytes, memoryview]]) -> list[int]:
        """One call for `group`: each object is its header (copied into the registered arena)
        then its payload, read by the transfer engine from where it is."""
        with self._headers_lock:
            arena = self._headers.ctypes.data
            pointers, sizes = [], []
            for i, (_, header, payload) in enumerate(group):
                at = i * HEADER_SLOT_BYTES
                self._headers[at:at + len(header)] = np.frombuffer(header, dtype=np.uint8)
                pointers.append([arena + at, _address(payload)])
                sizes.append([len(header), payload.nbytes])
            return self._call(client.batch_put_from_multi_buffers,
                              [self._name_of(k) for k, _, _ in group], pointers, sizes)

    def _remove_matching(self, pattern: str) -> int:
        removed = self._call(self._connected().remove_by_regex, pattern, True)
        if removed < 0:
            raise MooncakeUnavailable(f"removing {pattern!r} failed ({_describe(removed)})")
        return removed

    def _in_shared(self, payload: memoryview) -> bool:
        address = _address(payload)
        with self._client_lock:
            return any(start <= address and address + payload.nbytes <= start + size
                       for start, size in self._registered)

    def _name_of(self, key: ChunkKey) -> str:
        fmt = key.fmt
        return f"{self._settings.prefix}/{fmt.model_name}/{fmt.fingerprint.hex()}/{key.chunk_hash.hex()}"


def parse_url(url: str) -> MooncakeSettings:
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname:
        raise ValueError(f"not a Mooncake URL: {shown!r} (mooncake://MASTER_HOST:PORT[/PREFIX]?...)")
    if "@" in parts.netloc:
        raise ValueError(f"{shown!r}: a Mooncake URL carries no user or password")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"{shown!r}: the master's port is missing or not a port (mooncake_master's "
                         "--rpc_port, 50051 by default)")
    params = query_params(url, _PARAMS, "a Mooncake URL")
    protocol = params.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"{shown!r}: protocol is tcp or rdma")
    try:
        timeout_s = float(params.get("timeout_s", DEFAULT_TIMEOUT_S))
        max_in_flight = int(params.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT))
        local_buffer_mb = int(params.get("local_buffer_mb", DEFAULT_LOCAL_BUFFER_MB))
        if timeout_s <= 0 or max_in_flight <= 0 or local_buffer_mb <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{shown!r}: timeout_s, max_in_flight and local_buffer_mb must be positive "
                         "numbers") from None
    register_pool = _BOOLEANS.get(params.get("register_pool", "false").lower())
    if register_pool is None:
        raise ValueError(f"{shown!r}: register_pool is true or false")
    host = parts.hostname
    return MooncakeSettings(
        master=(host, port), prefix=parts.path.strip("/") or DEFAULT_PREFIX, protocol=protocol,
        rdma_devices=params.get("rdma_devices", ""),
        metadata_server=params.get("metadata_server") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata",
        local_hostname=params.get("local_hostname") or _address_towards(host, port),
        local_buffer_bytes=local_buffer_mb << 20, timeout_s=timeout_s, max_in_flight=max_in_flight,
        register_pool=register_pool)


def _check_reachable(s: MooncakeSettings) -> None:
    """Say what is missing before a setup (which retries for minutes) is tried."""
    try:
        socket.create_connection(s.master, timeout=s.timeout_s).close()
    except OSError as e:
        raise MooncakeUnavailable(f"no master answers at {s.master_address} "
                                  f"({e.strerror or type(e).__name__}): start mooncake_master there, "
                                  "or fix the URL's host and port (its --rpc_port)") from None
    if not s.metadata_server.startswith("http"):
        return  # etcd: the client's setup says
    try:
        urllib.request.urlopen(f"{s.metadata_server}?key=lmcache-mp-probe", timeout=s.timeout_s).close()
    except urllib.error.HTTPError:
        pass  # it answered (an absent key is a 404)
    except (urllib.error.URLError, OSError) as e:
        raise MooncakeUnavailable(f"no metadata service answers at {s.metadata_server} "
                                  f"({getattr(e, 'reason', e)}): run the master with "
                                  "--enable_http_metadata_server, or set metadata_server=") from None


def _put_copies(client: MooncakeDistributedStore, named: list[tuple[str, bytes, memoryview]]) -> list[int]:
    """Objects whose payload is not in registered memory: the client copies each into its buffer."""
    return [client.put_parts(name, header, payload) for name, header, payload in named]


def _raise_if_unreachable(codes: Iterable[int]) -> None:
    for code in codes:
        if code in _UNREACHABLE:
            raise MooncakeUnavailable(f"the cluster did not answer ({_describe(code)})")


def _describe(code: int) -> str:
    return f"{_UNREACHABLE.get(code, 'error')} {code}"


def _escaped(text: str) -> str:
    """`text` as a literal in the master's (ECMAScript) regular expressions."""
    return _REGEX_SPECIALS.sub(r"\\\1", text)


def _groups(keys: list[ChunkKey], size: int) -> Iterator[list[ChunkKey]]:
    for start in range(0, len(keys), size):
        yield keys[start:start + size]


def _address(payload: memoryview) -> int:
    return np.frombuffer(payload, dtype=np.uint8).ctypes.data


def _address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
