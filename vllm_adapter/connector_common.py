"""What both halves of `LMCacheMPDaemonConnector` share: the settings read from
`kv_connector_extra_config`, the per-step metadata the scheduler sends the workers, and the
background connection that lets vLLM start and keep serving while the daemon is away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from lmcache_mp.config import default_url
from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import LMCacheMPError
from vllm_adapter.group_adapters import RequestOps
from vllm_adapter.ops import DEFAULT_TIMEOUT_S

logger = logging.getLogger(__name__)

DEFAULT_RECONNECT_INTERVAL_S = 1.0
# How long one connection attempt waits for the daemon's HELLO. A daemon on this machine
# answers in well under a millisecond; the margin is for a box busy running the model.
CONNECT_TIMEOUT_S = 2.0
DEFAULT_LOOKUP_WAIT_MS = 2.0

_PREFIX = "lmcache.mp."
LOAD_MODES = ("auto", "async", "sync")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's `kv_connector_extra_config` keys (see `vllm_adapter.connector`)."""

    url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    reconnect_interval_s: float = DEFAULT_RECONNECT_INTERVAL_S
    save_decode_cache: bool = False
    # "async": loads run while the engine steps on (other requests keep running);
    # "sync": a request's load runs right before its forward pass, one scheduler step sooner;
    # "auto": sync while no other request computes and the sync load loses no hit, else async.
    load_mode: str = "auto"
    # How long the scheduler may wait, per step and across requests, for lookups in flight.
    lookup_wait_ms: float = DEFAULT_LOOKUP_WAIT_MS
    # CURVE keys, for a daemon that requires them: its public key file and this client's
    # secret key file (`lmcache-mp keygen`).
    curve: ClientCurve | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        ours = {key.removeprefix(_PREFIX): value for key, value in extra.items() if key.startswith(_PREFIX)}
        unknown = sorted(set(ours) - {"url", "timeout_s", "reconnect_interval_s", "save_decode_cache",
                                      "load_mode", "lookup_wait_ms", "server_public_key", "client_key"})
        if unknown:  # a typo would otherwise silently fall back to a default
            raise ValueError(f"unknown kv_connector_extra_config keys: {[_PREFIX + k for k in unknown]}")
        settings = cls(
            url=str(ours.get("url") or default_url()),
            timeout_s=float(ours.get("timeout_s", DEFAULT_TIMEOUT_S)),
            reconnect_interval_s=float(ours.get("reconnect_interval_s", DEFAULT_RECONNECT_INTERVAL_S)),
            save_decode_cache=_as_bool(ours.get("save_decode_cache", False)),
            load_mode=str(ours.get("load_mode", "auto")),
            lookup_wait_ms=float(ours.get("lookup_wait_ms", DEFAULT_LOOKUP_WAIT_MS)),
            curve=_curve(ours.get("server_public_key"), ours.get("client_key")),
        )
        if settings.load_mode not in LOAD_MODES:
            raise ValueError(f"{_PREFIX}load_mode must be one of {', '.join(LOAD_MODES)}, "
                             f"not {settings.load_mode!r}")
        if not 0 <= settings.lookup_wait_ms <= 1000:
            raise ValueError(f"{_PREFIX}lookup_wait_ms must be within 0-1000, not {settings.lookup_wait_ms}")
        if settings.timeout_s <= 0 or settings.reconnect_interval_s <= 0:
            raise ValueError(f"{_PREFIX}timeout_s and {_PREFIX}reconnect_interval_s must be positive")
        return settings


def _curve(server_public_key: str | None, client_key: str | None) -> ClientCurve | None:
    if (server_public_key is None) != (client_key is None):
        raise ValueError(f"{_PREFIX}server_public_key and {_PREFIX}client_key go together")
    if server_public_key is None or client_key is None:
        return None
    curve = ClientCurve(Path(server_public_key), Path(client_key))
    curve.check()  # unreadable keys: refused at start, not at every reconnection
    return curve


def _as_bool(value: Any) -> bool:
    """JSON gives a bool; a CLI or environment may give a string ("false" must be False)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@dataclass
class LMCacheMPConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers, by request id. vLLM pickles it to every worker, so
    it holds only small plain values: each op names the blocks and the block hashes of
    whole chunks (a load's block ids may be `ops.SKIP_BLOCK`: blocks vLLM already has, or
    never reads); a hybrid model has one op per KV cache group (`group_adapters.RequestOps`)."""

    loads: dict[str, RequestOps] = field(default_factory=dict)
    stores: dict[str, RequestOps] = field(default_factory=dict)
    step: int = 0  # the scheduler's count of steps: workers report sliding-window stores done by it
    # Preempted this step: their blocks are free again, so their stores must land first.
    preempted: set[str] = field(default_factory=set)
    # The loads (of `loads`) that must complete before this step's forward pass; the others
    # run while the engine steps on, and are reported done in a later step.
    sync_loads: set[str] = field(default_factory=set)
    # Nothing is scheduled: vLLM steps only to collect transfers (finished requests whose
    # blocks wait for their stores).
    idle: bool = False


@dataclass
class LMCacheMPWorkerMeta(KVConnectorWorkerMetadata):
    """What workers tell the scheduler each step: worker rank -> request id -> the latest step
    whose stores of that request (sliding-window groups) are done, so that the blocks they read
    can be freed (`block_holds`). vLLM merges the workers' with `aggregate`."""

    stores_done: dict[int, dict[str, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LMCacheMPWorkerMeta)
        merged = {rank: dict(done) for rank, done in self.stores_done.items()}
        for rank, done in other.stores_done.items():
            merged.setdefault(rank, {}).update(done)
        return LMCacheMPWorkerMeta(merged)


class _Client(Protocol):
    def shutdown(self) -> None: ...


ClientT = TypeVar("ClientT", bound=_Client)


class BackgroundConnect(Generic[ClientT]):
    """Builds a daemon client on a thread of its own, retrying every interval until it
    succeeds, so that an absent daemon never blocks vLLM's start or its steps. Until then
    `get()` is None and the connector behaves as if the cache were empty."""

    def __init__(self, factory: Callable[[], ClientT], retry_interval_s: float, what: str):
        self._factory = factory
        self._retry_interval_s = retry_interval_s
        self._what = what
        self._client: ClientT | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        threading.Thread(target=self._run, name=f"lmcache-mp connect ({what})", daemon=True).start()

    def get(self) -> ClientT | None:
        return self._client

    def wait(self, timeout_s: float) -> ClientT | None:
        """The client, waiting up to `timeout_s` for the first attempt to finish."""
        self._ready.wait(timeout_s)
        return self._client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        self._stop.set()
        if client is not None:
            client.shutdown()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                client = self._factory()
            except (LMCacheMPError, OSError, ValueError) as err:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                logger.log(level, "lmcache-mp %s: daemon unavailable (%s); retrying every %.1f s, "
                           "serving without the cache meanwhile", self._what, err, self._retry_interval_s)
                self._ready.set()
                self._stop.wait(self._retry_interval_s)
                continue
            with self._lock:
                closed = self._closed
                if not closed:
                    self._client = client
            if closed:
                client.shutdown()
            else:
                logger.info("lmcache-mp %s: connected", self._what)
            self._ready.set()
            return
