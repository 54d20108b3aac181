"""Wires the daemon together: configuration -> engine -> request handlers -> server."""

from __future__ import annotations

import torch

from lmcache_mp.config import ServerConfig
from lmcache_mp.engine import Engine
from lmcache_mp.observability import Metrics
from lmcache_mp.protocol import RequestType
from lmcache_mp.server import Handler, Server


class Daemon:
    """The engine behind the server, and their shared lifecycle."""

    def __init__(self, config: ServerConfig):
        config.validate()
        # Copies run on the server's worker threads. torch's intra-op threads, started from
        # such threads, fight each other for the cores and halve copy throughput (measured:
        # 8 vs 16 GB/s gather on 2 cores); one torch thread per worker is the faster setup.
        torch.set_num_threads(1)
        self.metrics = Metrics()
        self.engine = Engine(config, self.metrics)
        e = self.engine
        handlers = {
            # Bookkeeping only: answered on the socket thread.
            RequestType.LOOKUP: Handler(e.lookup, inline=True),
            RequestType.END_SESSION: Handler(e.end_session, inline=True),
            # Copies, mappings and whole-pool sweeps: on the worker pool.
            RequestType.REGISTER_KV_CACHE: Handler(e.register, inline=False),
            RequestType.UNREGISTER_KV_CACHE: Handler(e.unregister, inline=False),
            RequestType.STORE: Handler(e.store, inline=False),
            RequestType.RETRIEVE: Handler(e.retrieve, inline=False),
            RequestType.CLEAR: Handler(e.clear, inline=False),
        }
        try:
            self.server = Server(config, handlers, status_extra=e.status, on_tick=e.tick,
                                 metrics=self.metrics)
            self.metrics.watch(e.gauges)
            if config.metrics_port:
                self.metrics.serve(config.metrics_host, config.metrics_port)
        except BaseException:
            e.close()
            raise
        self.endpoints = self.server.endpoints

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()
