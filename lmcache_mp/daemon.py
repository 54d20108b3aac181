"""Wires the daemon together: configuration -> engine -> request handlers -> server."""

from __future__ import annotations

from lmcache_mp.config import ServerConfig
from lmcache_mp.server import Server


def build_server(config: ServerConfig) -> Server:
    return Server(config)
