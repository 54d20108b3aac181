"""`lmcache-mp`: run the daemon and talk to it. Argument parsing and printing only."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import resource
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import msgspec

from lmcache_mp import __version__, config, settings, sockets
from lmcache_mp.chunks import TierCleared
from lmcache_mp.cli import pools
from lmcache_mp.cli.status_text import render_status
from lmcache_mp.curve import ClientCurve, generate_keys
from lmcache_mp.daemon import sd_notify
from lmcache_mp.daemon.logs import configure_logging
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import ModelScope, RequestType
from lmcache_mp.storage.pool.directory import remove_stale
from lmcache_mp.storage.pool.location import PoolFileError, default_pool_file, discard_pool_file
from lmcache_mp.storage.tiers.urls import redact_url
from lmcache_mp.v1remote.protocol import DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT

if TYPE_CHECKING:
    from lmcache_mp.daemon.daemon import Daemon

logger = logging.getLogger("lmcache_mp")
_SIGNAL_CHECK_S = 0.5
EXIT_FAILED = 3  # `serve`: the daemon met a FatalError while serving (2: it could not start)
T = TypeVar("T")


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=sockets.default_url(),
                        help="daemon endpoint, ipc://PATH or tcp://HOST:PORT (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each reply (default: %(default)s)")
    parser.add_argument("--server-key", type=Path, metavar="PATH",
                        help="the daemon's CURVE public key file (NAME.key), for a daemon that "
                             "requires authentication; with --client-key")
    parser.add_argument("--client-key", type=Path, metavar="PATH",
                        help="this client's CURVE secret key file (NAME.key_secret), whose public "
                             "key the daemon allows")


def _client(args: argparse.Namespace) -> MessageQueueClient:
    if (args.server_key is None) != (args.client_key is None):
        raise SystemExit("lmcache-mp: --server-key and --client-key go together")
    curve = ClientCurve(args.server_key, args.client_key) if args.server_key else None
    return MessageQueueClient(args.url, curve=curve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp",
        description="A long-lived KV-cache daemon for LLM serving (node-local), and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-mp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Run the KV-cache daemon until SIGTERM or SIGINT.")
    serve.add_argument("--config", type=Path, metavar="PATH",
                       help="read settings from this TOML file (keys as in --print-config). "
                            "Precedence: flag > environment (LMCACHE_MP_<SETTING>) > file > default")
    serve.add_argument("--print-config", action="store_true",
                       help="print the settings in effect as a TOML file and exit")
    settings.add_flags(serve, config.ServerConfig)
    serve.set_defaults(func=cmd_serve)

    ping = sub.add_parser("ping", help="measure the round trip to a daemon and show who it is",
                          description="Send HELLO, then PINGs; exit 1 if nothing answers.")
    _add_url(ping)
    ping.add_argument("--count", type=int, default=10, help="PINGs to send (default: %(default)s)")
    ping.set_defaults(func=cmd_ping)

    status = sub.add_parser("status", help="print a daemon's pool, sessions and registrations",
                            description="Ask a daemon for STATUS and print it.")
    _add_url(status)
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    status.set_defaults(func=cmd_status)
    events = sub.add_parser("kv-events", help="print a daemon's KV event stream, one JSON line per event",
                            description="Follow the KV events a daemon publishes for routers "
                                        "(--kv-events-listen): one JSON line per event (its batch's "
                                        "seq and time, its type, its fields), as a router receives "
                                        "them. Exit 1 if the daemon publishes none.")
    _add_url(events)
    events.add_argument("--from-start", action="store_true",
                        help="first replay every batch the daemon kept (from seq 0), then follow")
    events.add_argument("--count", type=int, metavar="N", help="stop after N events (default: never)")
    events.add_argument("--idle-timeout", type=float, metavar="S",
                        help="stop once no event came for S seconds (default: never)")
    events.set_defaults(func=cmd_kv_events)
    clear = sub.add_parser("clear", help="empty a daemon's CPU pool (and, with --tiers, its lower tiers)",
                           description="Drop every chunk from the daemon's CPU pool (chunks under "
                                       "lease or being written stay). With --tiers, also every chunk "
                                       "of the daemon's namespace in each lower tier, all models: "
                                       "shared tiers are emptied for every daemon that uses them. "
                                       "With --pool-file, remove a stopped daemon's pool file "
                                       "instead, and the memory it holds (a running daemon's pool "
                                       "is emptied by plain `clear`). With --model, drop that model's "
                                       "chunks alone, from the pool and every lower tier (as vLLM's "
                                       "reset_prefix_cache with reset_connector does); exit 1 if a "
                                       "tier could not.")
    _add_url(clear)
    clear.add_argument("--tiers", action="store_true",
                       help="also empty the lower tiers (disk, Redis); a v1 server cannot be emptied")
    clear.add_argument("--model", action="append", metavar="NAME",
                       help="only this model's chunks, every tier (repeat for several): its name as its "
                            "workers register it, MODEL@DIGEST (`lmcache-mp status` lists them)")
    clear.add_argument("--pool-file", metavar="PATH", nargs="?", const="auto",
                       help="remove this pool file (no daemon may be using it) instead of asking a "
                            "daemon; without PATH, the default one of a daemon at --url")
    clear.set_defaults(func=cmd_clear, timeout=60.0)
    keygen = sub.add_parser("keygen", help="make a CURVE key pair (for the daemon or a client)",
                            description="Write NAME.key (the public key: give it to the other side) "
                                        "and NAME.key_secret (keep it; mode 0600) into DIR. The "
                                        "daemon takes its own secret file (--curve-secret-key) and a "
                                        "directory of its clients' public files (--curve-allowed-keys); "
                                        "a client takes the daemon's public file and its own secret one.")
    keygen.add_argument("dir", type=Path, help="directory to write the two files into")
    keygen.add_argument("--name", default="lmcache-mp", help="file name stem (default: %(default)s)")
    keygen.set_defaults(func=cmd_keygen)
    pools.add_parser(sub)
    _add_remote_server(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = settings.resolve(config.ServerConfig, args, config_file=args.config)
        if args.print_config:
            print(settings.to_toml(cfg), end="")
            return 0
        cfg.validate()
    except ValueError as err:
        print(f"lmcache-mp serve: cannot start: {err}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level, cfg.log_format)
    _raise_descriptor_limit()
    if cfg.pool_path is not None:
        remove_stale(cfg.pool_path, cfg.pool_file_ttl_s)
    # `kill -USR1 <pid>` writes every thread's stack to stderr (the log), from the signal handler
    # itself: it needs no GIL, so it also shows a daemon whose threads are all stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Here, once the settings are good: `ping` and `status` need neither the server nor
    # prometheus_client.
    from lmcache_mp.daemon.daemon import Daemon

    try:
        daemon = Daemon(cfg)
    except (ValueError, OSError) as err:
        logger.error("cannot start: %s", err)
        return 2
    signalled = threading.Event()
    wake = threading.Event()  # a signal, or the engine build ended

    def on_signal(signum: int, frame: object) -> None:
        signalled.set()
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def on_built() -> None:
        # Logged here, on the build thread, not by the main thread once it wakes: a SIGTERM that
        # comes as soon as STATUS says "serving" must not leave a daemon that served unlogged.
        # `stop` joins this thread, so the line always precedes "stopped".
        if daemon.serving:
            _log_ready(daemon)
        wake.set()

    logger.info("lmcache-mp %s starting pid=%d endpoints=%s: answering HELLO, PING and STATUS; "
                "building the engine (pool %.2f GiB)", __version__, os.getpid(), " ".join(daemon.endpoints),
                cfg.l1_size_gb)
    daemon.start(on_built=on_built)
    sd_notify.notify_when_ready(daemon.readiness, signalled)
    # Short waits: the kernel may deliver SIGTERM to any thread, and Python runs its handler
    # only when the main thread next runs; a long wait would ignore it until the wait ended.
    while not wake.wait(_SIGNAL_CHECK_S):
        pass
    if not signalled.is_set():
        if daemon.failure is not None:
            logger.error("cannot start: %s", _why(daemon.failure))
            daemon.stop()
            return 2
        while not signalled.wait(_SIGNAL_CHECK_S):
            if daemon.server.failure is not None:
                _exit_failed(daemon)
    logger.info("shutting down")
    sd_notify.notify("STOPPING=1")
    daemon.stop()
    logger.info("stopped")
    return 0


def _exit_failed(daemon: Daemon) -> NoReturn:
    """The daemon cannot serve on (Server.failure, logged CRITICAL when met): answer what can still
    be answered, then exit EXIT_FAILED for its supervisor to restart it (systemd: Restart=on-failure).
    Not `daemon.stop()` nor Python's own exit: both join every worker thread, and one may be blocked
    for good in a CUDA wait, which nothing can interrupt; and the engine's close unpins the pool
    through a CUDA context that may be broken. Nothing is left that a restart does not clean up: it
    removes stale sockets, and the kernel and the driver release the claims' locks and the pinned
    memory."""
    sd_notify.notify("STOPPING=1")
    daemon.server.stop(join=False)
    logger.info("exiting with status %d", EXIT_FAILED)
    logging.shutdown()  # flushes every log handler: the lines are out before the process is gone
    os._exit(EXIT_FAILED)


def _raise_descriptor_limit() -> None:
    """Take the hard limit of open descriptors as the soft one: every client connection costs
    the daemon one, and libzmq aborts the process when an accept finds none left (the attach
    socket keeps a reserve below the limit; ZeroMQ's sockets cannot)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        logger.info("open descriptor limit raised from %d to %d", soft, hard)


def _why(err: Exception) -> str:
    """An engine build's failure in one line: the expected kinds (memory, a tier's directory or
    address, a module missing) by their message, anything else with its type."""
    if isinstance(err, (ValueError, OSError, ImportError, PoolFileError)):
        return str(err)
    return f"building the engine failed: {type(err).__name__}: {err}"


def _log_ready(daemon: Daemon) -> None:
    cfg = daemon.config
    metrics = f" metrics=http://{cfg.metrics_host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else ""
    tiers = f" l2={','.join(map(redact_url, cfg.l2))}" if cfg.l2 else ""
    logger.info("lmcache-mp %s ready (node-local) pid=%d endpoints=%s chunk_size=%d pool=%.2f GiB%s%s "
                "(engine built in %.2f s, %.2f s of it importing torch)", __version__, os.getpid(),
                " ".join(daemon.endpoints), cfg.chunk_size, cfg.l1_size_gb, tiers, metrics, daemon.build_s,
                daemon.import_s)


def cmd_ping(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        start = time.perf_counter()
        hello = client.handshake("lmcache-mp ping", timeout_s=args.timeout)
        hello_ms = (time.perf_counter() - start) * 1e3
        rtts = []
        for nonce in range(args.count):
            start = time.perf_counter()
            client.submit(RequestType.PING, [nonce]).result(args.timeout)
            rtts.append((time.perf_counter() - start) * 1e6)
    except LMCacheMPError as err:
        print(f"no answer from {args.url}: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"{args.url}: lmcache-mp {hello.server_version}, protocol {hello.protocol_version}, "
          f"chunk size {hello.chunk_size}, {hello.phase}")
    print(f"HELLO {hello_ms:.2f} ms; PING x{len(rtts)}: min {min(rtts):.0f} us, "
          f"median {statistics.median(rtts):.0f} us, max {max(rtts):.0f} us")
    return 0


def _ask(args: argparse.Namespace, client_name: str, ask: Callable[[MessageQueueClient], T]) -> T | None:
    """Connect, say HELLO and run `ask`; None, after saying why, when the daemon does not answer."""
    client = _client(args)
    try:
        client.handshake(client_name, timeout_s=args.timeout)
        return ask(client)
    except LMCacheMPError as err:
        print(f"no answer from {args.url}: {err}", file=sys.stderr)
        return None
    finally:
        client.close()


def cmd_status(args: argparse.Namespace) -> int:
    report = _ask(args, "lmcache-mp status", lambda c: c.submit(RequestType.STATUS, []).result(args.timeout))
    if report is None:
        return 1
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), indent=2))
    else:
        print(render_status(args.url, report))
    return 0


def cmd_kv_events(args: argparse.Namespace) -> int:
    report = _ask(args, "lmcache-mp kv-events",
                  lambda c: c.submit(RequestType.STATUS, []).result(args.timeout))
    if report is None:
        return 1
    if not report.kv_events_endpoints:
        print(f"{args.url} publishes no KV events: start it with --kv-events-listen URL", file=sys.stderr)
        return 1
    from lmcache_mp.cli.follow import follow

    pub, replay = report.kv_events_endpoints
    curve = ClientCurve(args.server_key, args.client_key) if args.server_key else None
    try:
        follow(pub, replay, curve=curve, from_start=args.from_start, count=args.count,
               idle_timeout_s=args.idle_timeout, write=lambda line: print(line, flush=True))
    except TimeoutError as err:
        print(f"lmcache-mp kv-events: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    if args.pool_file is not None:
        return _discard_pool_file(args)

    def clear(client: MessageQueueClient) -> tuple[int, list[TierCleared]]:
        if args.model:
            reset = client.submit(RequestType.RESET_MODEL, [ModelScope(args.model)]).result(args.timeout)
            return reset.pool_chunks, reset.tiers
        dropped = client.submit(RequestType.CLEAR, []).result(args.timeout)
        tiers = client.submit(RequestType.CLEAR_TIERS, []).result(args.timeout) if args.tiers else []
        return dropped, tiers

    cleared = _ask(args, "lmcache-mp clear", clear)
    if cleared is None:
        return 1
    dropped, tiers = cleared
    print(f"CPU pool: {dropped:,} chunks dropped")
    for tier in tiers:
        outcome = f"not cleared: {tier.error}" if tier.error else f"{tier.removed:,} chunks removed"
        print(f"{tier.name}: {outcome}")
    return 1 if any(tier.error for tier in tiers) else 0


def _discard_pool_file(args: argparse.Namespace) -> int:
    path = default_pool_file([args.url]) if args.pool_file == "auto" else Path(args.pool_file)
    try:
        removed = discard_pool_file(path)
    except (PoolFileError, OSError) as err:
        print(f"pool file {path}: not removed: {err}", file=sys.stderr)
        return 1
    print(f"pool file {path}: {'removed' if removed else 'there is none'}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    try:
        public, secret = generate_keys(args.dir, args.name)
    except OSError as err:
        print(f"lmcache-mp keygen: {err}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _add_remote_server(sub: argparse._SubParsersAction) -> None:
    remote = sub.add_parser(
        "remote-server", help="run a standalone store that speaks LMCache's v1 remote protocol",
        description="Run an in-memory, LRU-bounded KV store speaking the v1 remote TCP protocol "
                    "(the wire format of LMCache's lmcache_server) until SIGTERM or SIGINT.")
    remote.add_argument("--listen", default=f"tcp://127.0.0.1:{DEFAULT_PORT}", metavar="URL",
                        help="tcp://HOST:PORT to listen on; port 0 picks a free one "
                             "(default: %(default)s)")
    remote.add_argument("--size-gb", type=float, default=4.0,
                        help="memory for stored objects in GiB; the least recently used objects are "
                             "evicted to make room (default: %(default)s)")
    remote.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --listen address. The protocol has no "
                             "authentication or encryption: anyone who can reach the port can read, "
                             "overwrite and fill the store. Only on a trusted network")
    remote.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="client connections served at once; more are accepted and closed at "
                             "once (default: %(default)s)")
    remote.add_argument("--max-connections-per-host", type=int, default=None, metavar="N",
                        help="of those, the most one host may hold (an IPv4 address, or an IPv6 /64), "
                             "so that one client cannot take every one; on loopback every local "
                             "client is one host (default: a quarter of --max-connections)")
    # 60 s, as server.DEFAULT_IDLE_TIMEOUT_S: not imported from there, as it would pull numpy into
    # every lmcache-mp command.
    remote.add_argument("--idle-timeout-s", type=float, default=60.0, metavar="S",
                        help="close a connection that sends no request for S seconds, so that "
                             "forgotten or dead clients do not hold --max-connections slots; a "
                             "message once begun must also finish within S seconds plus its size at "
                             "1 MiB/s. Clients must reconnect after a quiet spell longer than this "
                             "(default: %(default)s)")
    remote.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log verbosity; DEBUG also logs every connection that closes "
                             "(default: %(default)s)")
    remote.set_defaults(func=cmd_remote_server)


def cmd_remote_server(args: argparse.Namespace) -> int:
    from lmcache_mp.v1remote.server import RemoteServer, parse_listen_url

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_listen_url(args.listen, args.allow_remote)
        if not args.size_gb > 0:
            raise ValueError(f"--size-gb must be positive, not {args.size_gb}")
        server = RemoteServer(host, port, capacity_bytes=int(args.size_gb * 2**30),
                              max_connections=args.max_connections,
                              max_connections_per_host=args.max_connections_per_host,
                              idle_timeout_s=args.idle_timeout_s)
    except (ValueError, OSError) as err:
        logger.error("cannot start: %s", err)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.stop())
    logger.info("v1 remote server listening on %s:%d capacity=%.3f GiB (%d bytes) max_connections=%d "
                "(%d per host) idle_timeout_s=%g pid=%d", *server.address, args.size_gb,
                server.store.capacity, args.max_connections, server.max_connections_per_host,
                server.idle_timeout_s, os.getpid())
    try:
        server.serve_forever()
    finally:
        server.close()
    logger.info("stopped: %s", server.stats())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
