"""`lmcache-mp`: run the daemon and talk to it. Argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time

import msgspec

from lmcache_mp import __version__, config
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType

logger = logging.getLogger("lmcache_mp")


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=config.default_url(),
                        help="daemon endpoint, ipc://PATH or tcp://HOST:PORT (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each reply (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp",
        description="A long-lived KV-cache daemon for LLM serving (node-local), and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-mp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Run the KV-cache daemon until SIGTERM or SIGINT.")
    serve.add_argument("--listen", action="append", metavar="URL",
                       help="endpoint to bind; repeat for several. ipc://PATH (a Unix socket, "
                            "created mode 0600) or tcp://127.0.0.1:PORT. "
                            f"Default: {config.default_url()}")
    serve.add_argument("--allow-remote", action="store_true",
                       help="allow binding TCP addresses other than loopback. The daemon has "
                            "no authentication: only do this on a trusted network")
    serve.add_argument("--chunk-size", type=int, default=config.DEFAULT_CHUNK_SIZE,
                       help="tokens per stored chunk; must be a multiple of vLLM's block size "
                            "(default: %(default)s)")
    serve.add_argument("--l1-size-gb", type=float, default=config.DEFAULT_L1_SIZE_GB,
                       help="CPU memory pool size in GiB, allocated once at start "
                            "(default: %(default)s)")
    serve.add_argument("--l2", action="append", default=[], metavar="URL",
                       help="a storage tier below the CPU pool; repeat for several, fastest first. "
                            "disk:///ABS/PATH?size_gb=N: a local (NVMe) directory, kept across "
                            "restarts, LRU-evicted beyond N GiB, locked against a second daemon. "
                            "redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS), "
                            "redis+cluster://HOST:PORT[,HOST:PORT...]: Valkey/Redis, shared by a fleet "
                            "(?prefix=NAME namespaces keys, ?ttl_s=S expires them). "
                            "lmcache://HOST:PORT: a v1 remote server. Network tiers take ?timeout_s=T "
                            "(default 1) and turn failures into misses, retried in the background. "
                            "Chunks are written behind STOREs and read back (verified) by LOOKUPs")
    serve.add_argument("--l2-queue-gb", type=float, default=None,
                       help="write-behind queue per lower tier: chunks waiting to be written stay "
                            "pinned in the CPU pool up to this size; past it, new chunks are not "
                            "written to that tier (counted as skipped). Default: a quarter of "
                            "--l1-size-gb")
    serve.add_argument("--lease-ttl-s", type=float, default=config.DEFAULT_LEASE_TTL_S,
                       help="seconds a LOOKUP keeps its hits leased for the RETRIEVE that "
                            "follows, if the client never retrieves or ends the session "
                            "(default: %(default)s)")
    serve.add_argument("--max-workers", type=int, default=config.DEFAULT_MAX_WORKERS,
                       help="threads that run copies and registrations; a RETRIEVE of several chunks is "
                            "split over the idle ones (default: %(default)s)")
    serve.add_argument("--max-queued-requests", type=int,
                       default=config.DEFAULT_MAX_QUEUED_REQUESTS,
                       help="requests waiting for a worker thread before new ones are refused "
                            "with OVERLOADED (default: %(default)s)")
    serve.add_argument("--queue-deadline-s", type=float, default=config.DEFAULT_QUEUE_DEADLINE_S,
                       help="a queued request not started within this many seconds is refused "
                            "with OVERLOADED instead of run late; keep it below the clients' "
                            "timeout (default: %(default)s)")
    serve.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus metrics over HTTP on this port (default: off)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="address for the metrics endpoint; non-loopback needs --allow-remote "
                            "(default: %(default)s)")
    serve.add_argument("--log-level", default="INFO",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="log verbosity (default: %(default)s)")
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
    _add_remote_server(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from lmcache_mp.daemon import Daemon
    from lmcache_mp.storage.tiers import redact_url

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config.ServerConfig(
        listen=args.listen or [config.default_url()],
        chunk_size=args.chunk_size,
        l1_size_gb=args.l1_size_gb,
        lease_ttl_s=args.lease_ttl_s,
        max_workers=args.max_workers,
        max_queued_requests=args.max_queued_requests,
        queue_deadline_s=args.queue_deadline_s,
        allow_remote=args.allow_remote,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        l2=args.l2,
        l2_queue_gb=args.l2_queue_gb,
    )
    try:
        daemon = Daemon(cfg)
    except (ValueError, OSError) as err:
        logger.error("cannot start: %s", err)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    daemon.start()
    metrics = f" metrics=http://{cfg.metrics_host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else ""
    tiers = f" l2={','.join(map(redact_url, cfg.l2))}" if cfg.l2 else ""
    logger.info("lmcache-mp %s ready (node-local) pid=%d endpoints=%s chunk_size=%d pool=%.2f GiB%s%s",
                __version__, os.getpid(), " ".join(daemon.endpoints), cfg.chunk_size, cfg.l1_size_gb,
                tiers, metrics)
    while not stop.wait(3600):
        pass
    logger.info("shutting down")
    daemon.stop()
    logger.info("stopped")
    return 0


def cmd_ping(args: argparse.Namespace) -> int:
    client = MessageQueueClient(args.url)
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
          f"chunk size {hello.chunk_size}")
    print(f"HELLO {hello_ms:.2f} ms; PING x{len(rtts)}: min {min(rtts):.0f} us, "
          f"median {statistics.median(rtts):.0f} us, max {max(rtts):.0f} us")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = MessageQueueClient(args.url)
    try:
        client.handshake("lmcache-mp status", timeout_s=args.timeout)
        report = client.submit(RequestType.STATUS, []).result(args.timeout)
    except LMCacheMPError as err:
        print(f"no answer from {args.url}: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    data = msgspec.to_builtins(report)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    tiers = data.pop("tiers")
    width = max(map(len, data))
    for name, value in data.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{name:<{width}}  {value}")
    for tier in tiers:
        print(f"\ntier {tier.pop('name')}")
        for name, value in tier.items():
            print(f"  {name:<{width}}  {round(value, 3) if isinstance(value, float) else value}")
    return 0


def _add_remote_server(sub: argparse._SubParsersAction) -> None:
    from lmcache_mp.v1remote.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT

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
                              max_connections=args.max_connections)
    except (ValueError, OSError) as err:
        logger.error("cannot start: %s", err)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.stop())
    logger.info("v1 remote server listening on %s:%d capacity=%.3f GiB (%d bytes) max_connections=%d "
                "pid=%d", *server.address, args.size_gb, server.store.capacity, args.max_connections,
                os.getpid())
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
