"""Valkey/Redis as a tier: KV shared by every daemon that points at the same server or cluster.

URLs (`--l2 URL`; query parameters are optional):

    redis://[[USER]:PASSWORD@]HOST:PORT[/DB]           one server (Valkey or Redis)
    rediss://...                                       the same over TLS (redis-py's ssl_* query
                                                       parameters, e.g. ssl_ca_certs=PATH, pass through)
    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]
                                                       a cluster, from one or more seed nodes
    rediss+cluster://...                               a cluster over TLS

    ?prefix=NAME     the namespace of every key (default "lmcache-mp"): deployments that must
                     not share KV use different prefixes on one server
    &timeout_s=T     connect and per-operation timeout (default 1.0): past it the tier goes down
                     (misses, skipped writes) and is retried in the background
    &ttl_s=S         expire chunks S seconds after they are written (default: never; the
                     server's maxmemory-policy evicts)

Keys are `PREFIX:MODEL:FINGERPRINT:CHUNK_HASH` (the two last in hex): the model name lets an
operator find a model's chunks (`SCAN 0 MATCH 'lmcache-mp:Qwen/Qwen3-8B:*'`), the fingerprint
(`ChunkFormat`) keeps layouts, ranks and chunk sizes apart, and without a hash tag a cluster
spreads one request's chunks over every node. A value is the self-describing object of
`chunk_format.py`, checked against the key on every read.

Eviction is the server's: set `maxmemory` and `maxmemory-policy allkeys-lru` (see docs/deployment.md,
"A fleet"). A write the server refuses (OOM under `noeviction`) is a skipped write; a
connection that fails takes the tier down (`remote.py`).

Every batch is one pipeline: one round trip per node, however many chunks. On a cluster, each
node's share goes on that node's own connection, so a dead node costs only its own chunks
(misses, skipped writes, retried with backoff) while the other nodes serve theirs.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Set
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import HIREDIS_AVAILABLE, HiredisRespSerializer, PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmcache_mp.chunks import ChunkKey
from lmcache_mp.storage.tiers.remote import RETRY_FIRST_S, Backoff, Fetched, NetworkTier
from lmcache_mp.storage.tiers.urls import redact_url

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
DEFAULT_PREFIX = "lmcache-mp"
DEFAULT_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16  # per server or cluster node: a writer, a reader, a probe, and headroom
# Replies that mean the node or the network failed, not the command: the tier goes down.
_NETWORK_REPLY_ERRORS = (RedisConnectionError, RedisTimeoutError, redis.exceptions.ClusterDownError)

Client = redis.Redis | RedisCluster


class RedisTier(NetworkTier):
    # RedisError: a server or a cluster that fails (ResponseError replies to single commands are
    # handled per command below); RedisClusterException: no seed node answered at all.
    transient_errors = (OSError, RedisError, RedisClusterException)

    def __init__(self, name: str, connect: Callable[[], Client], prefix: str = DEFAULT_PREFIX,
                 ttl_s: int | None = None, gathers: bool = False) -> None:
        super().__init__(name)
        self._gathers = gathers  # the client sends ValueParts without joining them
        self._connect = connect  # () -> Client; called lazily, again after the client fails
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._node_backoff = Backoff()  # cluster nodes that failed, and when to try them again

    @classmethod
    def from_url(cls, url: str) -> RedisTier:
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"not a Valkey/Redis URL: {redact_url(url)!r}")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        prefix = params.pop("prefix", DEFAULT_PREFIX)
        try:
            timeout_s = float(params.pop("timeout_s", DEFAULT_TIMEOUT_S))
            ttl = params.pop("ttl_s", None)
            ttl_s = int(ttl) if ttl is not None else None
            if timeout_s <= 0 or (ttl_s is not None and ttl_s <= 0) or not prefix:
                raise ValueError
        except ValueError:
            raise ValueError(f"{redact_url(url)!r}: timeout_s and ttl_s must be positive numbers "
                             "and prefix must not be empty") from None
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                       retry=Retry(NoBackoff(), 1), max_connections=MAX_CONNECTIONS)
        if parts.scheme.endswith("+cluster"):
            connect = _cluster_connector(parts.netloc, parts.scheme == "rediss+cluster", params, options, url)
        else:
            plain = urlunsplit(parts._replace(query=urlencode(params)))
            redis.connection.parse_url(plain)  # raises ValueError on a bad URL, now rather than later

            def connect() -> Client:
                return redis.Redis.from_url(plain, command_packer=_GatherPacker(), **options)
        return cls(redact_url(url), connect, prefix, ttl_s, gathers=not parts.scheme.endswith("+cluster"))

    # ---- the network primitives ---------------------------------------------------------------

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        return [bool(n) for n in self._pipelined("exists", [(self._name_of(k),) for k in keys])]

    def _fetch_many(self, keys: list[ChunkKey], outs: list) -> list[Fetched | None]:
        blobs = self._pipelined("get", [(self._name_of(k),) for k in keys])
        return [None if blob is None or isinstance(blob, ResponseError) else Fetched.from_blob(blob)
                for blob in blobs]

    def _store_many(self, items: Iterable[tuple[ChunkKey, bytes, memoryview]]) -> list[bool]:
        # One value per chunk: header and payload, sent from where they lie (`_GatherPacker`) to
        # one server; a cluster's per-node clients take no packer, so there they are joined.
        replies = self._pipelined("set", [(self._name_of(k), self._value(head, payload))
                                          for k, head, payload in items], ex=self._ttl_s)
        return [reply is True for reply in replies]

    def _delete_many(self, keys: list[ChunkKey]) -> int:
        return sum(n for n in self._pipelined("delete", [(self._name_of(k),) for k in keys])
                   if isinstance(n, int))

    def _clear_namespace(self) -> int:
        return self._unlink_matching(f"{_glob_escaped(self._prefix)}:*", lambda name: True)

    def _drop_models(self, models: Set[str]) -> int:
        # A model's keys are `PREFIX:MODEL:FINGERPRINT:HASH`; the pattern may also match a model
        # whose name extends this one's with a colon, so each name found is checked whole.
        heads = {f"{self._prefix}:{model}".encode() for model in models}
        return sum(self._unlink_matching(f"{_glob_escaped(f'{self._prefix}:{model}')}:*",
                                         lambda name: name.rsplit(b":", 2)[0] in heads)
                   for model in models)

    def _unlink_matching(self, pattern: str, wanted: Callable[[bytes], bool]) -> int:
        """UNLINK the `wanted` keys that match the glob `pattern`; how many. SCAN (not KEYS: it
        would block the server) each primary, and UNLINK in batches on that node's own connection
        (keys of a batch may be in different slots, which a cluster-wide multi-key command refuses)."""
        client = self._client_or_connect()
        nodes = ([client.get_redis_connection(n) for n in client.get_primaries()]
                 if isinstance(client, RedisCluster) else [client])
        removed = 0
        for node in nodes:
            batch: list[bytes] = []
            for name in node.scan_iter(match=pattern, count=1000):
                if not wanted(name):
                    continue
                batch.append(name)
                if len(batch) == 1000:
                    removed += self._run_pipeline(node, "unlink", [(n,) for n in batch], {}).count(1)
                    batch = []
            if batch:
                removed += self._run_pipeline(node, "unlink", [(n,) for n in batch], {}).count(1)
        return removed

    def _ping(self) -> None:
        self._client_or_connect().ping()

    def _close_connections(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ---- helpers ------------------------------------------------------------------------------

    def _value(self, header: bytes, payload: memoryview) -> ValueParts | bytes:
        return ValueParts((header, payload)) if self._gathers else b"".join((header, payload))

    def _name_of(self, key: ChunkKey) -> bytes:
        fmt = key.fmt
        return f"{self._prefix}:{fmt.model_name}:{fmt.fingerprint.hex()}:{key.chunk_hash.hex()}".encode()

    def _pipelined(self, command: str, args: list[tuple], **options: object) -> list:
        """One pipeline of `command` per argument tuple (per node, on a cluster); a reply that
        says the network or the server failed raises (the tier goes down), other per-command
        errors come back as values."""
        client = self._client_or_connect()
        if isinstance(client, RedisCluster):
            return self._pipelined_per_node(client, command, args, options)
        return self._run_pipeline(client, command, args, options)

    def _run_pipeline(self, client: redis.Redis, command: str, args: list[tuple], options: dict) -> list:
        try:
            pipe = client.pipeline(transaction=False)
            for a in args:
                getattr(pipe, command)(*a, **options)
            replies = pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError):
            self._drop_client()
            raise
        failed = next((r for r in replies if isinstance(r, _NETWORK_REPLY_ERRORS)), None)
        if failed is not None:
            self._drop_client()
            raise failed
        return replies

    def _pipelined_per_node(self, cluster: RedisCluster, command: str, args: list[tuple],
                            options: dict) -> list:
        """A pipeline per node, each on that node's own connection, so that a dead node costs
        only the chunks it holds: they are misses (None) and skipped writes while the node is
        in its backoff, and the other nodes' chunks are served. Only when every node involved
        fails does the whole tier go down. A reply saying that a slot moved (resharding,
        failover) is a miss, and the slot map is reloaded before the next batch."""
        groups: dict[str, list[int]] = {}
        nodes: dict[str, ClusterNode] = {}
        for i, a in enumerate(args):
            node = cluster.get_node_from_key(a[0])
            groups.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        replies: list = [None] * len(args)
        failed: list[tuple[str, BaseException]] = []
        for name, indices in groups.items():
            if not self._node_backoff.may_try(name):
                self._count(unavailable=len(indices))
                continue
            try:
                got = self._run_pipeline(cluster.get_redis_connection(nodes[name]), command,
                                         [args[i] for i in indices], options)
            except self.transient_errors as e:
                failed.append((name, e))
                self._count(unavailable=len(indices))
                continue
            if self._node_backoff.succeeded(name):
                logger.warning("%s: node %s is reachable again", self.name, name)
            for i, reply in zip(indices, got, strict=True):
                replies[i] = reply
        if failed and len(failed) == len(groups):
            raise failed[0][1]
        for name, error in failed:
            self._count(errors=1)
            delay = self._node_backoff.failed(name)
            logger.log(logging.WARNING if delay == RETRY_FIRST_S else logging.DEBUG,
                       "%s: node %s failed (%s: %s); its chunks are misses and its writes are skipped; "
                       "retrying it in %.1f s", self.name, name, type(error).__name__, error, delay)
        if any(isinstance(r, ResponseError) and str(r).startswith(("MOVED", "ASK")) for r in replies):
            self._drop_client()
        return replies

    def _client_or_connect(self) -> Client:
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _drop_client(self) -> None:
        """Forget a client after a failure: a cluster's slot map may be stale, so the next
        operation (after the probe) starts from the seed nodes again."""
        self._close_connections()


class ValueParts(tuple):
    """One value given as several buffers (a chunk's header and its payload in the pool)."""


class _GatherPacker:
    """redis-py's command packer, except that a `ValueParts` argument is sent as its buffers,
    with no copy: hiredis' packer (and a join) would copy every chunk once or twice more."""

    def __init__(self) -> None:
        self._plain = HiredisRespSerializer() if HIREDIS_AVAILABLE else PythonRespSerializer(6000, _encode)

    def pack(self, *args: object) -> list:
        if not any(isinstance(a, ValueParts) for a in args):
            return self._plain.pack(*args)
        out: list = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, ValueParts):
                out.append(head + b"$%d\r\n" % sum(memoryview(part).nbytes for part in arg))
                out.extend(arg)
                head = b"\r\n"
            else:
                data = _encode(arg)
                head += b"$%d\r\n%s\r\n" % (len(data), data)
        out.append(head)
        return out


def _glob_escaped(text: str) -> str:
    """`text` as a Redis glob pattern that matches it literally."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _encode(arg: object) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int):
        return b"%d" % arg
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


def _cluster_connector(netloc: str, tls: bool, params: dict[str, str], options: dict,
                       url: str) -> Callable[[], Client]:
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redact_url(url)!r}: a cluster URL names its seed nodes as "
                             "HOST:PORT[,HOST:PORT...]")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    if params:
        raise ValueError(f"{redact_url(url)!r}: unknown parameter(s) {', '.join(sorted(params))} "
                         "(a cluster URL takes prefix, timeout_s and ttl_s)")

    def connect() -> RedisCluster:
        return RedisCluster(startup_nodes=nodes, username=unquote(username) or None,
                            password=unquote(password) or None, ssl=tls, require_full_coverage=False,
                            **options)
    return connect
