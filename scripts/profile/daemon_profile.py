#!/usr/bin/env python
"""Run `lmcache-mp serve` with per-phase timers around the LOOKUP / END_SESSION path and the
STORE / RETRIEVE one.

    python scripts/profile/daemon_profile.py OUT.json -- PYTHON -m lmcache_mp.cli serve ARGS...

(the form `launcher.start_daemon(..., command_prefix=[python, this, OUT.json, "--"])` gives).
Before the daemon starts, the functions each phase runs are wrapped with `perf_counter_ns`
timers; when the daemon exits (SIGTERM), OUT.json gets, per phase, its calls and total
nanoseconds, of wall time and of the thread's CPU time (which a loaded machine's preemptions
do not inflate). The production code carries no instrumentation: a daemon started any other way
runs unwrapped. Each wrapper adds ~0.3 us per call, so the profile says where the time goes,
not what a round trip costs (the benchmark's unprofiled daemon says that).
"""

from __future__ import annotations

import atexit
import functools
import json
import runpy
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lmcache_mp import mq
from lmcache_mp.daemon import server
from lmcache_mp.engine import cancellation, capacity_advisor, engine, keys, registry, sessions, transfers
from lmcache_mp.observability import metrics
from lmcache_mp.storage import manager
from lmcache_mp.storage.pool import integrity, pool
from lmcache_mp.transfer import context, threads

# phase name -> (class or module, function): what the daemon's socket thread runs for LOOKUP and
# END_SESSION, then what a worker or load thread runs for STORE and RETRIEVE.
PHASES: dict[str, tuple[Any, str]] = {
    "socket thread, whole request": (server.Server, "_on_request"),
    "decode request": (mq.Codec, "decode_payload"),
    "LOOKUP handler (engine.lookup)": (engine.Engine, "lookup"),
    "LOOKUP_CHUNKS handler (engine.lookup_chunks)": (engine.Engine, "lookup_chunks"),
    "LOOKUP_PREFIX handler (engine.lookup_prefix)": (engine.Engine, "lookup_prefix"),
    "  the tails after the hit (Engine._prefix_hit)": (engine.Engine, "_prefix_hit"),
    "  key mapping (lookup_hashes)": (keys.ChunkMapper, "lookup_hashes"),
    "  key mapping (op_chunks, token keys)": (keys.ChunkMapper, "op_chunks"),
    "  ranks and fingerprints (registry)": (engine.Registry, "format_combos"),
    "  prefix walk + pinning (storage.lookup)": (manager.StorageManager, "lookup"),
    "    pool.pin_prefix": (pool.MemoryPool, "pin_prefix"),
    "END_SESSION handler (engine.end_session)": (engine.Engine, "end_session"),
    "  SessionTable.end": (sessions.SessionTable, "end"),
    "    pool.unpin": (pool.MemoryPool, "unpin"),
    "encode reply + metrics + send (Server._reply)": (server.Server, "_reply"),
    "  encode reply": (mq.Codec, "encode_reply"),
    "  send (MessageQueueServer.reply)": (mq.MessageQueueServer, "reply"),
    "socket thread: other threads' replies out (MessageQueueServer._flush_outbox)": (
        mq.MessageQueueServer, "_flush_outbox"),
    "after a LOOKUP's reply: lease bookkeeping (Engine._lease)": (engine.Engine, "_lease"),
    "  SessionTable.lease": (sessions.SessionTable, "lease"),
    "  capacity advisor (CapacityAdvisor.record)": (capacity_advisor.CapacityAdvisor, "record"),
    # STORE and RETRIEVE, on a worker or load thread (the "whole request" row's time on the
    # socket thread is their decode and hand-off; the reply's rows count them too).
    "worker or load thread, whole request (Server._run_queued)": (server.Server, "_run_queued"),
    "STORE handler (transfers.store)": (transfers.Transfers, "store"),
    "RETRIEVE handler (transfers.retrieve)": (transfers.Transfers, "retrieve"),
    "  instance lookup (Registry.instance)": (registry.Registry, "instance"),
    "  key checks (check_keys_for)": (transfers, "check_keys_for"),
    "  chunks and block-id checks (Transfers._op_chunks)": (transfers.Transfers, "_op_chunks"),
    "  fence begin (Transfers._begin)": (transfers.Transfers, "_begin"),
    "  fence end (TransferFence.end)": (cancellation.TransferFence, "end"),
    "  STORE's copy in, reserve to commit (Transfers._copy_in)": (transfers.Transfers, "_copy_in"),
    "    reserve (StorageManager.reserve)": (manager.StorageManager, "reserve"),
    "      pool.link": (pool.MemoryPool, "link"),
    "      pool.reserve": (pool.MemoryPool, "reserve"),
    "    commit (StorageManager.commit_store)": (manager.StorageManager, "commit_store"),
    "      pool.commit": (pool.MemoryPool, "commit"),
    "      pool file records (StorageManager._records)": (manager.StorageManager, "_records"),
    "      sealer wake-up (PoolIntegrity.poke)": (integrity.PoolIntegrity, "poke"),
    "    sessions.remember": (sessions.SessionTable, "remember"),
    "  RETRIEVE's copy out (Transfers._copy_out)": (transfers.Transfers, "_copy_out"),
    "    pool.pin": (pool.MemoryPool, "pin"),
    "    chunk copies, all threads (CopyThreads.run)": (threads.CopyThreads, "run"),
    "  lease release (Transfers._spend_leases)": (transfers.Transfers, "_spend_leases"),
    "  metrics (Metrics.stored)": (metrics.Metrics, "stored"),
    "  metrics (Metrics.retrieved)": (metrics.Metrics, "retrieved"),
    "  one chunk's pool view (TransferContext.chunk_view)": (context.TransferContext, "chunk_view"),
    "  one chunk's gather (Copies.gather)": (context.Copies, "gather"),
    "    its torch copy call(s) (Copies._gather_into)": (context.Copies, "_gather_into"),
    "  one chunk's scatter (Copies.scatter)": (context.Copies, "scatter"),
    "    one run's torch copy call (TransferContext.write_pages)": (context.TransferContext, "write_pages"),
    "  metrics.request_done (the reply's)": (metrics.Metrics, "request_done"),
}

_totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # calls, wall ns, CPU ns


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    slot = _totals[name]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, start_cpu = wall(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[0] += 1
            slot[1] += wall() - start
            slot[2] += cpu() - start_cpu

    return wrapper


def _dump(path: str) -> None:
    # What the timers themselves cost per wrapped call (system calls, on a VM not free): a phase's
    # figure includes it once, and once more per wrapped phase inside it.
    probe = _timed("timer overhead per wrapped call (an empty call)", lambda: None)
    for _ in range(10_000):
        probe()
    with open(path, "w") as out:
        json.dump({name: {"calls": c, "wall_ns": w, "cpu_ns": t} for name, (c, w, t) in _totals.items()},
                  out, indent=1)


def run_daemon(command: list[str], usage: str | None) -> None:
    """Run `PYTHON -m lmcache_mp.cli serve ARGS...`, given as `command`, in this process (whose
    classes the caller has patched)."""
    if command[1:3] != ["-m", "lmcache_mp.cli"]:
        raise SystemExit(usage)
    sys.argv = ["lmcache_mp.cli", *command[3:]]
    runpy.run_module("lmcache_mp.cli", run_name="__main__")


def main() -> None:
    out, sep, *command = sys.argv[1:]
    if sep != "--":
        raise SystemExit(__doc__)
    for name, (cls, attr) in PHASES.items():
        if hasattr(cls, attr):  # an older tree may lack one (to profile it the same way)
            setattr(cls, attr, _timed(name, getattr(cls, attr)))
    atexit.register(_dump, out)
    run_daemon(command, __doc__)


if __name__ == "__main__":
    main()
