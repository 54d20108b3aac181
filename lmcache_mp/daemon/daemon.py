"""Wires the daemon together: configuration -> server (at once) -> engine (in the background).

The server binds and answers PING, HELLO and STATUS within a fraction of a second of the start;
the engine (the pool, the tiers, the attach socket) needs torch, whose import alone takes seconds
(2.4 s on the 2-core test VM, far more under load). So the engine is built on a thread of its own
while the server refuses its requests with STARTING, then installed; until then this module and
everything it imports load no torch.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lmcache_mp.config import ServerConfig
from lmcache_mp.daemon.server import Server
from lmcache_mp.engine import status
from lmcache_mp.lmcache_door.door import LMCacheDoor
from lmcache_mp.observability.metrics import Metrics
from lmcache_mp.protocol import LMCACHE_DOOR, NATIVE_DOOR, DoorInfo
from lmcache_mp.sockets import prepare_ipc_endpoints

if TYPE_CHECKING:
    from lmcache_mp.engine.engine import Engine

logger = logging.getLogger(__name__)

# How long a daemon stopped while it is starting waits for the engine build to finish (an import
# cannot be interrupted), so that it closes what the build opened (the attach socket, a tier's lock).
BUILD_JOIN_TIMEOUT_S = 60.0


# torch's native libraries that need nothing from Python, in load order: loaded ahead of `import torch`.
_TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so")


def preload_torch_libraries() -> None:
    """Load torch's largest native libraries with the GIL released. `import torch` loads them too,
    but holding the GIL while the dynamic loader relocates and initialises them: measured on the
    test VM, the socket thread then waits up to 1.5-3.4 s for a PING's reply; loaded here first
    (the import then finds them loaded), the longest wait was 0.2-0.6 s. Best effort: a library
    missing or failing to load here is left to the import, which reports its real error."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return
    libc = ctypes.CDLL(None)  # a foreign call through ctypes lets go of the GIL
    dlopen = getattr(libc, "dlopen", None)
    if dlopen is None:
        return
    dlopen.argtypes, dlopen.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
    for name in _TORCH_LIBRARIES:
        path = os.path.join(os.path.dirname(spec.origin), "lib", name)
        if os.path.exists(path):
            dlopen(path.encode(), os.RTLD_NOW | os.RTLD_LOCAL)


def _build_engine(config: ServerConfig, metrics: Metrics, epoch: int) -> tuple[Engine, float]:
    """The engine, and how long importing it (torch) took of the build."""
    started = time.monotonic()
    preload_torch_libraries()
    # Imported here, on the build thread: see the module docstring.
    import torch

    from lmcache_mp.engine.engine import Engine

    imported_s = time.monotonic() - started
    # Copies run on the server's worker threads. torch's intra-op threads, started from
    # such threads, fight each other for the cores and halve copy throughput (measured:
    # 8 vs 16 GB/s gather on 2 cores); one torch thread per worker is the faster setup.
    torch.set_num_threads(1)
    return Engine(config, metrics, epoch), imported_s


class Daemon:
    """The server, the engine behind it once built, and their shared lifecycle."""

    def __init__(self, config: ServerConfig):
        config.validate()
        self.config = config
        # Before anything else (the pool, the attach socket): a second daemon started on a live
        # one's path must fail at once and leave that daemon's sockets alone.
        self._claims = prepare_ipc_endpoints(config.listen + config.lmcache_listen, config.socket_access)
        try:
            self.metrics = Metrics()
            if config.metrics_port:
                self.metrics.serve(config.metrics_host, config.metrics_port)
            self.server = Server(config, self.metrics, doors=self.doors)
            # LMCache's own connector, served by the same engine (`lmcache_door`).
            self.door = (LMCacheDoor(config, lambda: self.server.arrivals, self.metrics)
                         if config.lmcache_listen else None)
        except BaseException:
            self._release_claims()
            raise
        self.endpoints = self.server.endpoints
        self.engine: Engine | None = None
        # Why the engine could not be built (the daemon then stops); None while building or once built.
        self.failure: Exception | None = None
        self.build_s = 0.0  # seconds the engine took, from `start`
        self.import_s = 0.0  # of which importing torch and the engine's modules
        self.serving = False  # the engine was built and serves (it is not, when `stop` came first)
        self._builder: threading.Thread | None = None
        self._lock = threading.Lock()  # orders installing the engine against `stop`
        self._stopping = False
        self.metrics.watch_doors(self.doors)  # last: it reads the attributes above

    def start(self, on_built: Callable[[], None]) -> None:
        """Answer PING, HELLO and STATUS from now on; build the engine on a thread of its own and
        serve every request once it is built. `on_built()` is called on that thread when the
        build has ended: `failure` then says whether it failed."""
        self.server.start()
        if self.door is not None:
            self.door.start()
        self._builder = threading.Thread(target=self._build, args=(on_built,), name="engine-build",
                                         daemon=True)
        self._builder.start()

    def _build(self, on_built: Callable[[], None]) -> None:
        started = time.monotonic()
        try:
            engine, self.import_s = _build_engine(self.config, self.metrics, self.server.epoch)
        except Exception as err:  # reported by the caller, which stops the daemon
            self.failure = err
        else:
            self.build_s = time.monotonic() - started
            with self._lock:
                if not self._stopping:
                    self._serve(engine)
                    self.serving = True
                self.engine = engine  # after serving: `readiness` never runs ahead of the handlers
        finally:
            on_built()

    def _serve(self, e: Engine) -> None:
        self.metrics.watch(functools.partial(status.gauges, e), functools.partial(status.tier_gauges, e))
        self.metrics.watch_capacity(functools.partial(status.capacity_gauges, e))
        self.server.serve_engine(e.handlers(), status_extra=functools.partial(status.engine_status, e),
                                 on_tick=e.tick)
        if self.door is not None:
            self.door.serve(e)

    def doors(self) -> list[DoorInfo]:
        """The front doors (the native one, and the lmcache door if it listens), for STATUS and /metrics."""
        engine = self.engine
        registered = engine.registry.registered_by_door() if engine is not None else {}
        doors = [(NATIVE_DOOR, self.server.endpoints)]
        if self.door is not None:
            doors.append((LMCACHE_DOOR, self.door.endpoints))
        return [DoorInfo(name, list(endpoints), *self.metrics.answered(name), registered.get(name, 0))
                for name, endpoints in doors]

    def readiness(self) -> tuple[bool, str]:
        """Whether the daemon is fully usable (engine built, pool prepared), and a line saying so."""
        engine = self.engine
        if engine is None:
            return False, "starting: building the engine (importing torch)"
        pool = engine.storage.pool_stats()  # only the pool's numbers: not a whole STATUS
        if pool.ready_bytes >= pool.capacity_bytes:
            return True, f"serving on {' '.join(self.endpoints)}"
        return False, (f"preparing the pool: {pool.ready_bytes / 2**30:.1f} of "
                       f"{pool.capacity_bytes / 2**30:.1f} GiB")

    def stop(self) -> None:
        with self._lock:
            self._stopping = True  # an engine built from now on is closed, never served
        if self.door is not None:
            self.door.stop()
        self.server.stop()
        if self._builder is not None:
            self._builder.join(BUILD_JOIN_TIMEOUT_S)
            if self._builder.is_alive():
                logger.warning("the engine build still runs after %.0f s; stopping without it",
                               BUILD_JOIN_TIMEOUT_S)
        if self.engine is not None:
            self.engine.close()
        self._release_claims()  # last: the sockets are gone, a successor may take the paths

    def _release_claims(self) -> None:
        for claim in self._claims:
            claim.release()
