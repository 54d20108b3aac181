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

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.settings import from_keys, positive, setting
from lmcache_mp.sockets import default_url
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


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _within_a_second(value: float) -> str | None:
    return None if 0 <= value <= 1000 else "must be within 0-1000"


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's `kv_connector_extra_config` keys, each `lmcache.mp.` + a field's name,
    declared once (`lmcache_mp.settings.setting`): `from_extra_config` reads them, and docs/configuration.md's
    table of them is `settings.markdown_table(ConnectorSettings, "lmcache.mp.")`."""

    url: str = setting(
        default_url, "daemon URL, `ipc://PATH` or `tcp://HOST:PORT` (a daemon on tcp:// has CURVE keys, "
        "given here with the two keys below, or was started with `--allow-unauthenticated-tcp`)",
        default_text="the daemon's default socket (`lmcache_mp.sockets.default_url()`)")
    timeout_s: float = setting(
        DEFAULT_TIMEOUT_S, "a request to the daemon not answered in time counts as failed: a lookup as a "
        "miss, a load as failed (recomputed), a store is sent again (below); a load or store that got no "
        "answer is given up (its blocks handed back to vLLM) only once the daemon has confirmed that it "
        "will not touch the blocks any more (CANCEL_TRANSFERS) or has exited: until then vLLM keeps them "
        "out of use (a WARNING; an ERROR after 60 s). Also how long a store is tried again before its "
        "chunks are given up", check=positive)
    reconnect_interval_s: float = setting(
        DEFAULT_RECONNECT_INTERVAL_S, "how often an absent daemon is tried again; also the heartbeat by "
        "which the scheduler notices the daemon has gone", check=positive)
    load_mode: str = setting(
        "auto", "`async`: loads run while the engine steps on; `sync`: a request's load runs right before "
        "its forward pass (one scheduler step sooner, lower TTFT for requests arriving alone, but the "
        "step's other requests wait for the copy; a whole-prompt hit leaves the last chunk to vLLM); "
        "`auto`: sync where the hit is not a whole-prompt one and either no other request computes "
        "(nobody waits for the copy) or the load is at most `sync_load_max_mb` (the others wait "
        "milliseconds, where an async load would cost the request a whole step), async otherwise",
        choices=LOAD_MODES)
    sync_load_max_mb: float = setting(
        256.0, "in `auto` load mode, the largest load (MiB of KV on each rank) that runs synchronously "
        "while other requests compute: they wait for its copy (at ~35 GB/s pool to H100, 256 MiB is "
        "~7 ms; at ~6 GB/s on a CPU, ~40 ms), where an async load would cost its own request a whole "
        "scheduler step; 0 loads asynchronously whenever anything else computes", check=_not_negative)
    lookup_wait_ms: float = setting(
        DEFAULT_LOOKUP_WAIT_MS, "how long the scheduler may wait in one step, across requests, for lookups "
        "still in flight: a lookup answered within it lets its request be scheduled, its load planned, in "
        "that step rather than the next; 0 never waits", check=_within_a_second)
    server_public_key: str | None = setting(
        None, "CURVE, for a daemon that requires authentication: the daemon's public key file "
        "(`NAME.key`), given with `lmcache.mp.client_key`; see \"Authenticated remote access\"")
    client_key: str | None = setting(
        None, "CURVE: this client's secret key file (`NAME.key_secret`), given with "
        "`lmcache.mp.server_public_key`")
    save_decode_cache: bool = setting(
        True, "store the chunks completed while decoding too: in multi-turn chat a request's answer is "
        "its next turn's prefix (with 128-token answers, returning turns loaded 13.5% more of their "
        "history, for 15% more chunks stored: docs/benchmarks.md section 12); false stores prompt "
        "chunks only, for workloads whose answers are never continued, where they would churn the "
        "cache (a request alone: `lmcache.mp.skip_save`)")

    tails: bool = setting(
        True, "store each finished request's tail (its KV past its last full chunk, the last "
        "block maybe partly filled) and load it into the request that resends that history: a "
        "returning turn recomputes none of it (docs/benchmarks.md section 10); models with one KV "
        "cache group of full attention only")
    step_trace: str | None = setting(
        None, "a path prefix: each of the engine's processes writes a timeline of the connector's hooks "
        "to `PREFIX.<role>.<pid>.jsonl`, one JSON line per hook call (its step, start, duration and "
        "what it did), to find where a step's time goes (`scripts/bench/step_trace_report.py` sums it "
        "up); for diagnosis, not for production: ~100 bytes a hook, up to 2 million lines a process")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """The `lmcache.mp.*` keys of `extra` (`settings.from_keys`: unknown ones are refused, values
        converted and checked); both CURVE key files, readable, or neither."""
        if not extra.get(_PREFIX + "url"):  # absent, null or empty: the daemon's default socket
            extra = {key: value for key, value in extra.items() if key != _PREFIX + "url"}
        settings = from_keys(cls, extra, _PREFIX, "kv_connector_extra_config")
        if (settings.server_public_key is None) != (settings.client_key is None):
            raise ValueError(f"{_PREFIX}server_public_key and {_PREFIX}client_key go together")
        if settings.curve is not None:
            settings.curve.check()  # unreadable keys: refused at start, not at every reconnection
        return settings

    @property
    def curve(self) -> ClientCurve | None:
        """The CURVE key files, where given."""
        if self.server_public_key is None or self.client_key is None:
            return None
        return ClientCurve(Path(self.server_public_key), Path(self.client_key))


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
    # How many times the scheduler has reset the model's KV (`reset_cache`): a worker that sees
    # it grow gives up the stores it holds, whose KV predates the reset.
    resets: int = 0


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
