"""Wires the daemon together: configuration -> engine -> request handlers -> server."""

from __future__ import annotations

import torch

from lmcache_mp.config import ServerConfig
from lmcache_mp.engine import Engine
from lmcache_mp.observability import Metrics
from lmcache_mp.protocol import RequestType
from lmcache_mp.server import Server, prepare_ipc_endpoints


class Daemon:
    """The engine behind the server, and their shared lifecycle."""

    def __init__(self, config: ServerConfig):
        config.validate()
        # Before anything else (the pool, the attach socket): a second daemon started on a live
        # one's path must fail at once and leave that daemon's sockets alone.
        self._claims = prepare_ipc_endpoints(config.listen, config.socket_access)
        try:
            self._build(config)
        except BaseException:
            self._release_claims()
            raise

    def _build(self, config: ServerConfig) -> None:
        # Copies run on the server's worker threads. torch's intra-op threads, started from
        # such threads, fight each other for the cores and halve copy throughput (measured:
        # 8 vs 16 GB/s gather on 2 cores); one torch thread per worker is the faster setup.
        torch.set_num_threads(1)
        self.metrics = Metrics()
        self.engine = Engine(config, self.metrics)
        e = self.engine
        handlers = {  # where each runs is declared in protocol.PROTOCOL
            RequestType.LOOKUP: e.lookup,
            RequestType.LOOKUP_CHUNKS: e.lookup_chunks,
            RequestType.RELEASE_LEASES: e.release_leases,
            RequestType.END_SESSION: e.end_session,
            RequestType.REGISTER_KV_CACHE: e.register,
            RequestType.UNREGISTER_KV_CACHE: e.unregister,
            RequestType.STORE: e.store,
            RequestType.RETRIEVE: e.retrieve,
            RequestType.CANCEL_TRANSFERS: e.cancel_transfers,
            RequestType.CLEAR: e.clear,
            RequestType.CLEAR_TIERS: e.clear_tiers,
        }
        try:
            self.server = Server(config, handlers, status_extra=e.status, on_tick=e.tick,
                                 metrics=self.metrics)
            self.metrics.watch(e.gauges, e.tier_gauges)
            if config.metrics_port:
                self.metrics.serve(config.metrics_host, config.metrics_port)
        except BaseException:
            e.close()
            raise
        self.endpoints = self.server.endpoints

    def readiness(self) -> tuple[bool, str]:
        """Whether the daemon is fully usable (its pool prepared), and a line saying so."""
        status = self.engine.status()
        if status["pool_ready"]:
            return True, f"serving on {' '.join(self.endpoints)}"
        return False, (f"preparing the pool: {status['pool_ready_bytes'] / 2**30:.1f} of "
                       f"{status['pool_bytes'] / 2**30:.1f} GiB")

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()
        self._release_claims()  # last: the sockets are gone, a successor may take the paths

    def _release_claims(self) -> None:
        for claim in self._claims:
            claim.release()
