#!/usr/bin/env python
"""Chaos soak: client processes store, look up and retrieve KV through the real daemon while it is
killed, restarted and sent garbage; every byte a RETRIEVE reports loaded is checked.

    .venv/bin/python scripts/soak.py [--duration-s 600] [--clients 4] [--out bench-out]

Each client process is a vLLM stand-in: a scheduler adapter and a worker adapter with real
shared-memory CPU caches ("CPU_ATTN"). It loops over a few hundred prompts built from a small set
of shared prefixes plus random suffixes (vLLM-like chained block hashes, the same in every
process): LOOKUP (leasing the hits), RETRIEVE of the hits into poisoned blocks, STORE of the
rest, END_SESSION, then a read-back (LOOKUP + RETRIEVE of the whole prompt). A chunk's content
is a function of its key, so any client can check any chunk, whoever stored it.

Meanwhile the parent's chaos loop, every --chaos-interval-s, SIGKILLs a client (a replacement
starts) and, every other time, restarts the daemon (SIGTERM or SIGKILL, then a new daemon on the
same socket with the same disk tier, so chunks survive) or freezes it (SIGSTOP past the clients'
timeouts, then SIGCONT). A thread sends, every half interval, a burst of malformed traffic from
a raw ZeroMQ socket (garbage frames, unknown types, bad payloads, bad block ids, unknown
instance ids, an oversized message, a registration whose attach channel never opens). Hostile
workers too, each on a schedule of its own (issue 25): every interval a registered worker floods
CANCEL_TRANSFERS for its own instance past what the daemon keeps per instance (OVERLOADED), and
every other flood names the clients' instances too (FORBIDDEN); a shrinking worker process
registers a fresh cache every interval, tries to ftruncate its memfd (the seal must refuse it),
then serves a round like any client; every other interval, --idle-connections ZeroMQ
connections and as many raw connections to the attach socket say nothing for a while, during
which a worker must still register and STATUS be answered. Restarts stop for the last
--last-daemon-frac of the run, all chaos --settle-s before the end; then the clients stop,
their leases are released, and the last daemon's RSS, open descriptors and leases are compared
with a fresh daemon's.

Fails (exit 1) on: any wrong byte served, any request without a reply (a future that did not
settle within its timeout plus a grace period, or a malformed or flooding request the daemon
never answered), a restart after which no client stored and read back a prompt before the next
one, a daemon traceback, a client's instance cancelled by another connection, a registered
cache shrunk, a registration or STATUS not served while idle connections were held, or
resources beyond the tolerances. Prints a report, writes soak.json and, where matplotlib is
installed, soak.png (a timeline) to --out; the exit status is the checks' either way.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.*: the stand-in worker's helpers

from lmcache_mp.cancellation import DEFAULT_MAX_CANCELLED_PER_INSTANCE
from lmcache_mp.custom_types import IPCCacheEngineKey, get_customized_encoder
from lmcache_mp.errors import LMCacheMPError, ServerError
from lmcache_mp.launcher import DaemonProcess, daemon_status, start_daemon
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.mq.frames import MAX_FRAME_BYTES, REQUEST_ID
from lmcache_mp.protocol import CANCEL_PAYLOAD, ErrorCode, KVCacheRegistration, RequestType, StatusReport
from tests.helpers import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, SHAPE, block_hashes, freeze
from tests.kv_worker import make_caches, pages
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp
from vllm_adapter.kv_export import export_kv_caches
from vllm_adapter.ops import striding_block_hashes

MODEL = "soak-model"
LAYOUT = "CPU_ATTN"
DTYPE = torch.bfloat16
BLOCKS_PER_CHUNK = CHUNK // BLOCK
POISON = -7.0  # what a block holds before a RETRIEVE: a block the daemon did not write shows it
# Resource tolerances, idle fresh daemon vs idle daemon after the load: the daemon's RSS settles
# within a few MiB (allocator caches, imported code paths); a descriptor or two may be an
# epoll/eventfd that libzmq creates lazily on the first connection.
RSS_TOLERANCE_MIB = 48.0
FD_TOLERANCE = 4
PR_SET_PDEATHSIG = 1
RESTORE_FRACTION = 0.2
FAILED_ROUND_PAUSE_S = 0.05
MAX_KEYS_KEPT = 2000  # per client, of the chunk-key lists in its stats


# ---- prompts and their content, identical in every process ---------------------------------


def make_prompts(seed: int, num_prompts: int, num_prefixes: int) -> list[list[bytes]]:
    """Block hashes of `num_prompts` prompts: one of `num_prefixes` shared 2-chunk prefixes plus
    a random suffix of 1-3 chunks. Depends only on `seed`."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(2 * CHUNK)] for _ in range(num_prefixes)]
    prompts = []
    for _ in range(num_prompts):
        suffix = [rng.randrange(50_000) for _ in range(rng.randint(1, 3) * CHUNK)]
        prompts.append(block_hashes(rng.choice(prefixes) + suffix))
    return prompts


@lru_cache(maxsize=4096)
def expected_block(chunk_key: bytes, index_in_chunk: int) -> torch.Tensor:
    """The content of one block (all layers) of the chunk stored under `chunk_key`."""
    digest = hashlib.blake2b(chunk_key + bytes([index_in_chunk]), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn([LAYERS, *SHAPE[1:]], generator=gen).to(DTYPE)


def chunk_keys(hashes: list[bytes]) -> list[bytes]:
    """The key of each chunk, as the adapters make it."""
    return list(striding_block_hashes(hashes, BLOCKS_PER_CHUNK))


# ---- a client process -----------------------------------------------------------------------


@dataclass
class ClientConfig:
    index: int
    url: str
    seed: int
    prompt_seed: int
    num_prompts: int
    num_prefixes: int
    end_time: float  # time.time() at which the client stops its load and shuts down
    timeout_s: float
    grace_s: float
    freeze_s: float
    stats_path: str
    pairs_path: str
    log_path: str
    shrink_every_s: float = 0.0  # > 0: a ShrinkingWorker, a fresh registration this often


@dataclass
class ClientStats:
    index: int
    pid: int
    ops: Counter = field(default_factory=Counter)  # completed operations and outcomes, by type
    errors: Counter = field(default_factory=Counter)  # failed operations, "TYPE: reason class"
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    unreplied: int = 0
    timeouts_sent_at: list[float] = field(default_factory=list)  # time.time() of the request
    timed_out_store_keys: list[str] = field(default_factory=list)  # chunk keys of STOREs timed out
    wrong_keys: list[str] = field(default_factory=list)  # chunk keys that were served wrong
    wrong_examples: list[str] = field(default_factory=list)
    other_reasons: list[str] = field(default_factory=list)
    shrink: Counter = field(default_factory=Counter)  # a ShrinkingWorker's ftruncate outcomes
    clean_exit: bool = False


class _FailureLog(logging.Handler):
    """The adapters report why a lookup, store or retrieve failed only in their log: keep the
    reason per (operation, request id)."""

    PREFIXES = {"lookup for request": "LOOKUP", "store for request": "STORE",
                "retrieve for request": "RETRIEVE"}

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: dict[tuple[str, str], str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for prefix, op in self.PREFIXES.items():
            if isinstance(record.msg, str) and record.msg.startswith(prefix) and record.args:
                args = record.args if isinstance(record.args, tuple) else (record.args,)
                self.reasons[(op, str(args[0]))] = str(args[-1])


def reason_class(reason: str) -> str:
    if "no reply" in reason:
        return "timeout"
    if "unavailable" in reason:
        return "daemon unavailable"
    if "closed" in reason:
        return "client closed"
    for code in ErrorCode:
        if reason.startswith(code.name) or f"{code.name}:" in reason:
            return code.name
    return "other"


class SoakClient:
    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.prompts = make_prompts(cfg.prompt_seed, cfg.num_prompts, cfg.num_prefixes)
        self.stats = ClientStats(cfg.index, os.getpid())
        self.failures = _FailureLog()
        logging.getLogger("vllm_adapter").addHandler(self.failures)
        self.pairs = open(cfg.pairs_path, "a", buffering=1)  # noqa: SIM115 (open for the process)
        self.seq = 0
        self.next_snapshot = 0.0
        self.scheduler = self._connect(LMCacheMPSchedulerAdapter)
        self.new_worker()

    def new_worker(self) -> None:
        """A worker adapter with fresh caches, registered (the adapter moves them into a memfd)."""
        self.caches = make_caches(SHAPE, DTYPE, LAYERS, seed=None)
        self.worker = self._connect(LMCacheMPWorkerAdapter)
        with contextlib.suppress(LMCacheMPError, OSError):  # not up yet: ensure_registered retries
            self.worker.register_kv_caches(self.caches, LAYOUT)

    def _connect(self, cls: type) -> Any:
        """The adapters' constructors say HELLO: retry while the daemon restarts."""
        deadline = time.time() + 60
        while True:
            try:
                return cls(self.cfg.url, None, MODEL, 1, 0, BLOCK, timeout_s=self.cfg.timeout_s,
                           connect_timeout_s=1.0)
            except LMCacheMPError:
                if time.time() > deadline:
                    raise

    def run(self) -> None:
        while time.time() < self.cfg.end_time:
            errors = self.stats.errors.total()
            self.one_round(self.rng.randrange(len(self.prompts)))
            if self.stats.errors.total() > errors:
                # Failures while the daemon is away come back at once: a client spinning on them
                # would starve the restarting daemon of the machine's CPUs. vLLM, too, spends a
                # forward pass between two steps.
                time.sleep(FAILED_ROUND_PAUSE_S)
            if time.time() >= self.next_snapshot:
                self.snapshot()
        self.scheduler.shutdown()
        self.worker.shutdown()
        self.stats.clean_exit = True
        self.snapshot()

    def snapshot(self) -> None:
        self.next_snapshot = time.time() + 0.5
        tmp = self.cfg.stats_path + ".tmp"
        Path(tmp).write_text(json.dumps(vars(self.stats)))  # not asdict: it mangles Counters
        os.replace(tmp, self.cfg.stats_path)

    # ---- one prompt, as vLLM would serve it ------------------------------------------------

    def one_round(self, prompt: int) -> None:
        hashes = self.prompts[prompt]
        num_chunks = len(hashes) // BLOCKS_PER_CHUNK
        rid = self._request_id()
        hit = self.lookup(rid, hashes)
        if hit is None:
            return
        if hit:
            self.retrieve(rid, hashes[: hit * BLOCKS_PER_CHUNK])
        # Now and then the whole prompt again, chunks present or not: STOREs of keys that other
        # processes store at the same time, or that are on disk only.
        from_chunk = 0 if self.rng.random() < RESTORE_FRACTION else hit
        stored_at = time.time()
        stored = from_chunk < num_chunks and self.store(rid, hashes, from_chunk)
        self.end_session(rid)
        if stored:  # read back what was just stored: the store+retrieve pair that proves recovery
            rid = self._request_id()
            if self.lookup(rid, hashes) == num_chunks and self.retrieve(rid, hashes):
                self.pairs.write(f"{stored_at:.6f} {time.time():.6f}\n")
            self.end_session(rid)

    def _request_id(self) -> str:
        self.seq += 1
        return f"soak-{self.cfg.index}-{self.seq}"

    def _deadline(self, held_s: float = 0.0) -> float:
        """Every future settles within the adapter's timeout; past this (and `held_s` more, for
        a report the adapter may hold back) it never will."""
        return time.monotonic() + self.cfg.timeout_s + self.cfg.grace_s + held_s

    def _failed(self, op: str, rid: str, sent: float) -> str:
        """Why the operation failed ("" if it did not): its reason class."""
        reason = self.failures.reasons.pop((op, rid), None)
        if reason is None:
            return ""
        kind = reason_class(reason)
        self.stats.errors[f"{op}: {kind}"] += 1
        if kind == "timeout" and len(self.stats.timeouts_sent_at) < 10_000:
            self.stats.timeouts_sent_at.append(sent)
        if kind == "other" and len(self.stats.other_reasons) < 10:
            self.stats.other_reasons.append(f"{op}: {reason}")
        return kind

    def _unreplied(self, op: str, rid: str) -> None:
        self.stats.unreplied += 1
        self.stats.errors[f"{op}: never settled"] += 1
        self.snapshot()

    def lookup(self, rid: str, hashes: list[bytes]) -> int | None:
        """Chunks hit (leased to `rid`), or None if the lookup never settled."""
        sent = time.time()
        self.scheduler.maybe_submit_lookup_request(rid, block_hashes=hashes)
        deadline = self._deadline()
        while (tokens := self.scheduler.check_lookup_result(rid)) is None:
            if time.monotonic() > deadline:
                self._unreplied("LOOKUP", rid)
                return None
            time.sleep(0.0005)
        self.scheduler.cleanup_lookup_result(rid)
        self.stats.ops["LOOKUP"] += 1
        if not self._failed("LOOKUP", rid, sent):
            self.stats.ops["LOOKUP ok"] += 1
            self.stats.ops["chunks hit"] += tokens // CHUNK
        return tokens // CHUNK

    def _blocks(self, count: int) -> list[int]:
        return self.rng.sample(range(NUM_BLOCKS), count)

    def retrieve(self, rid: str, hashes: list[bytes]) -> bool:
        """RETRIEVE `hashes`' chunks into poisoned blocks; True if it loaded them and every byte
        is what was stored under their keys."""
        block_ids = self._blocks(len(hashes))
        for layer in self.caches.values():
            layer[block_ids] = POISON
        sent = time.time()
        self.worker.submit_retrieve_request(rid, LoadStoreOp(block_ids, block_hashes=hashes), None)
        # A RETRIEVE that timed out is reported only once the daemon confirms that it has been
        # cancelled: after a freeze, when the daemon is thawed.
        deadline = self._deadline(held_s=self.cfg.freeze_s)
        while rid not in self.worker.get_finished(set())[1]:
            if time.monotonic() > deadline:
                self._unreplied("RETRIEVE", rid)
                return False
            time.sleep(0.0005)
        failed = rid in self.worker.take_failed_retrieves()
        self.stats.ops["RETRIEVE"] += 1
        if self._failed("RETRIEVE", rid, sent) or failed:
            return False
        self.stats.ops["RETRIEVE ok"] += 1
        return self.verify(chunk_keys(hashes), block_ids)

    def verify(self, keys: list[bytes], block_ids: list[int]) -> bool:
        loaded = pages(self.caches, LAYOUT, SHAPE, block_ids)  # layers x blocks x ...
        wrong_chunks = 0
        for c, key in enumerate(keys):
            wrong = 0
            for j in range(BLOCKS_PER_CHUNK):
                got = loaded[:, c * BLOCKS_PER_CHUNK + j].contiguous().view(torch.uint8)
                wrong += int((got != expected_block(key, j).view(torch.uint8)).sum())
            self.stats.ops["chunks verified"] += 1
            if wrong:
                wrong_chunks += 1
                self.stats.wrong_bytes += wrong
                if key.hex() not in self.stats.wrong_keys and len(self.stats.wrong_keys) < MAX_KEYS_KEPT:
                    self.stats.wrong_keys.append(key.hex())
                if len(self.stats.wrong_examples) < 10:
                    self.stats.wrong_examples.append(
                        f"client {self.cfg.index}: chunk {c} ({key.hex()[:16]}) of {len(keys)} in block ids "
                        f"{block_ids}: {wrong} bytes wrong")
        if wrong_chunks:
            self.stats.wrong_chunks += wrong_chunks
            self.snapshot()
        return not wrong_chunks

    def store(self, rid: str, hashes: list[bytes], from_chunk: int) -> bool:
        """STORE the prompt's chunks from `from_chunk` on, filled with their expected content."""
        tail = hashes[from_chunk * BLOCKS_PER_CHUNK :]
        block_ids = self._blocks(len(tail))
        for c, key in enumerate(chunk_keys(tail)):
            for j in range(BLOCKS_PER_CHUNK):
                content = expected_block(key, j)
                for layer, t in enumerate(self.caches.values()):
                    t[block_ids[c * BLOCKS_PER_CHUNK + j]] = content[layer]
        sent = time.time()
        self.worker.submit_store_request(rid, LoadStoreOp(block_ids, block_hashes=tail), None)
        # A store that did not land is tried again for another timeout (each try bounded by the
        # timeout), and one made while the daemon is frozen is held until it answers.
        deadline = self._deadline(held_s=2 * self.cfg.timeout_s + self.cfg.freeze_s)
        while rid not in self.worker.get_finished({rid})[0]:
            if time.monotonic() > deadline:
                self._unreplied("STORE", rid)
                return False
            time.sleep(0.0005)
        self.stats.ops["STORE"] += 1
        failure = self._failed("STORE", rid, sent)
        if failure == "timeout" and len(self.stats.timed_out_store_keys) < MAX_KEYS_KEPT:
            # The daemon may still run it, later, from blocks reused since: see the report.
            self.stats.timed_out_store_keys.extend(k.hex() for k in chunk_keys(tail))
        if failure:
            return False
        self.stats.ops["STORE ok"] += 1
        return True

    def end_session(self, rid: str) -> None:
        self.scheduler.end_session(rid)  # fire and forget, as in vLLM
        self.stats.ops["END_SESSION"] += 1


SHRINK_REFUSED = "ftruncate refused (EPERM)"
SHRINK_NOT_TRIED = "not tried: the cache is not in the adapter's memfd"
SHRINK_SUCCEEDED = "ftruncate SUCCEEDED"


class ShrinkingWorker(SoakClient):
    """Issue 25 item 3, repeated: a worker registers its CPU caches (the adapter moves them into a
    memfd, which the daemon maps), cuts that file short, then serves a round like any client
    (its STOREs and read-backs checked byte for byte). A shrink under the daemon's mapping and
    a STORE once killed the daemon with SIGBUS; the adapter seals the memfd against shrinking,
    so the ftruncate must fail with EPERM. A fresh cache and registration every round."""

    def one_round(self, prompt: int) -> None:
        if self.stats.shrink:  # not the first round: a new memfd, registered afresh
            self.worker.shutdown()
            self.new_worker()
        self.try_to_shrink()
        super().one_round(prompt)
        time.sleep(max(0.0, min(self.cfg.shrink_every_s, self.cfg.end_time - time.time())))

    def try_to_shrink(self) -> None:
        storage = next(iter(self.caches.values())).untyped_storage()
        # _share_fd_cpu_ on a storage not shared yet would move it (into torch's own file): no.
        fd = storage._share_fd_cpu_()[0] if storage.is_shared() else -1
        if fd < 0 or "memfd:lmcache-mp-kv" not in os.readlink(f"/proc/self/fd/{fd}"):
            self.stats.shrink[SHRINK_NOT_TRIED] += 1
            return
        try:
            os.ftruncate(fd, 0)
        except PermissionError:
            self.stats.shrink[SHRINK_REFUSED] += 1
            return
        except OSError as err:
            self.stats.shrink[f"ftruncate failed otherwise: {err}"] += 1
            return
        self.stats.shrink[SHRINK_SUCCEEDED] += 1
        self.snapshot()
        os._exit(3)  # its caches are gone (a touch is SIGBUS): the report fails the soak


def client_main(cfg: ClientConfig) -> None:
    # Die with the soak, whatever kills it: no orphans.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    logging.basicConfig(filename=cfg.log_path, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    (ShrinkingWorker if cfg.shrink_every_s > 0 else SoakClient)(cfg).run()


# ---- malformed traffic ------------------------------------------------------------------------


class GarbageSender:
    """Malformed and hostile requests from a raw DEALER, none of which may change what a client
    reads back: bad block ids and other models' keys only, never a valid RETRIEVE into a
    client's caches."""

    def __init__(self, url: str, rng: random.Random):
        self.url = url
        self.rng = rng
        self.encode = get_customized_encoder().encode
        self.next_id = 1 << 40
        self.sent = 0
        self.replies: Counter = Counter()  # by status name
        self.unreplied_kinds: Counter = Counter()
        self.oversized = 0  # messages over the daemon's size limit: dropped with their connection
        self.handles, _ = export_kv_caches(make_caches([4, *SHAPE[1:]], DTYPE, LAYERS, seed=None))

    def _key(self) -> IPCCacheEngineKey:
        return IPCCacheEngineKey("garbage-model", 1, 0, chunk_hash=self.rng.randbytes(32),
                                 request_id=f"garbage-{self.rng.randrange(1000)}")

    def _request(self, request_type: int, *payload: Any) -> list[bytes]:
        self.next_id += 1
        return [REQUEST_ID.pack(self.next_id), self.encode(request_type), self.encode(list(payload))]

    def messages(self, instances: list[int]) -> dict[str, list[bytes]]:
        """One message of each kind, by what is wrong with it."""
        r = self.rng
        real = r.choice(instances) if instances else r.getrandbits(63)
        nobody = r.getrandbits(63)  # an instance id that is not registered
        keys = [self._key() for _ in range(r.randint(1, 4))]
        n = len(keys) * BLOCKS_PER_CHUNK  # block ids that go with the keys
        store, retrieve = int(RequestType.STORE), int(RequestType.RETRIEVE)
        return {
            "noise": [r.randbytes(r.randrange(64)) for _ in range(r.randint(1, 4))],
            "an id alone": [r.randbytes(8)],
            "unknown type": self._request(999),
            "undecodable type": [REQUEST_ID.pack(r.getrandbits(64)), r.randbytes(5)],
            "no payload": self._request(int(RequestType.LOOKUP)),
            "garbage payload": [*self._request(store), r.randbytes(40), b"x", b"y", b"z"],
            "garbage registration": self._request(int(RequestType.REGISTER_KV_CACHE), r.getrandbits(63),
                                                  [r.randbytes(9)], "no"),
            "STORE, unknown instance": self._request(store, keys, nobody, list(range(n)), b""),
            "RETRIEVE, unknown instance": self._request(retrieve, keys, nobody, list(range(n)), b""),
            "STORE, block ids out of range": self._request(store, keys, real,
                                                           [NUM_BLOCKS + r.randrange(10**6)] * n, b""),
            "RETRIEVE, negative block ids": self._request(retrieve, keys, real, [-(2**40)] * n, b""),
            "RETRIEVE, too few block ids": self._request(retrieve, keys, real, list(range(n - 1)), b""),
            "STORE, bogus event handle": self._request(store, keys, real, [0] * n, b"not an event handle"),
            "LOOKUP, another model": self._request(int(RequestType.LOOKUP), keys),
            "END_SESSION, unknown": self._request(int(RequestType.END_SESSION), f"garbage-{nobody}"),
            "UNREGISTER, unknown": self._request(int(RequestType.UNREGISTER_KV_CACHE), nobody),
            "PING": self._request(int(RequestType.PING), r.getrandbits(63)),
            # Well-formed caches whose attach channel never opens: the daemon waits for it.
            "REGISTER, attach channel never opened": self._request(
                int(RequestType.REGISTER_KV_CACHE), r.getrandbits(63), self.handles,
                KVCacheRegistration("garbage-model", 1, 0, LAYOUT, r.randbytes(16))),
        }

    def _socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        return sock

    def oversize(self) -> None:
        """One message over the daemon's size limit; libzmq drops it with the connection, so
        it gets no reply: its own socket, and nothing waited for."""
        sock = self._socket()
        try:
            sock.send_multipart([*self._request(int(RequestType.LOOKUP)), bytes(MAX_FRAME_BYTES + 1)])
            self.oversized += 1
            sock.poll(100)
        finally:
            sock.close(linger=0)

    def burst(self, instances: list[int], timeout_s: float) -> None:
        """Send one round of every kind, then wait for one reply per message."""
        self.oversize()
        sock = self._socket()
        try:
            batch = self.messages(instances)
            waiting = {}  # first frame (echoed in the reply) -> kind
            for kind, frames in batch.items():
                sock.send_multipart(frames)
                waiting[frames[0]] = kind
            self.sent += len(batch)
            deadline = time.monotonic() + timeout_s
            while waiting and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                reply = sock.recv_multipart()
                waiting.pop(reply[0], None)
                status = msgspec.msgpack.decode(reply[1]) if len(reply) == 3 else -1
                self.replies[ErrorCode(status).name if status in ErrorCode._value2member_map_
                             else f"malformed reply {len(reply)} frames"] += 1
            self.unreplied_kinds.update(waiting.values())
        finally:
            sock.close(linger=0)


# ---- hostile workers: cheap attacks, each repeated on a schedule of its own (issue 25) --------

# Ids of 47 characters (see `CancelFlooder.flood`): ~196 KiB of msgpack per CANCEL_TRANSFERS,
# within the daemon's cap on one request's payload (a bigger one is refused BAD_PAYLOAD unread).
FLOOD_IDS_PER_REQUEST = 4096
assert FLOOD_IDS_PER_REQUEST * 50 < CANCEL_PAYLOAD
# Past what the daemon keeps per instance: the last request finds the instance's record full.
FLOOD_REQUESTS = DEFAULT_MAX_CANCELLED_PER_INSTANCE // FLOOD_IDS_PER_REQUEST + 1
FLOOD_VICTIMS = 2  # clients' instances named by every other flood
IDLE_HOLD_S = 3.0  # at most; half a chaos interval in shorter runs


def registered_worker(url: str, model: str, timeout_s: float) -> LMCacheMPWorkerAdapter:
    """A worker adapter with a small CPU cache registered; raises what made that fail."""
    worker = LMCacheMPWorkerAdapter(url, None, model, 1, 0, BLOCK, timeout_s=timeout_s,
                                    connect_timeout_s=timeout_s)
    try:
        worker.register_kv_caches(make_caches([4, *SHAPE[1:]], DTYPE, LAYERS, seed=None), LAYOUT)
    except BaseException:
        worker.shutdown()
        raise
    return worker


class CancelFlooder:
    """Issue 25 item 1: a registered worker floods CANCEL_TRANSFERS. For its own instance the
    daemon keeps what it is told (a confirmed cancel is a promise it never forgets early), so
    the record is bounded per instance: past the bound, OVERLOADED, and the clients' cancels
    still find room. For another connection's instance, FORBIDDEN: anything else would let any
    client cancel a worker's transfers (its flood once evicted a worker's confirmed cancel)."""

    def __init__(self, url: str, seed: int, timeout_s: float):
        self.url = url
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.floods = 0
        self.answers: Counter = Counter()  # "own instance: OVERLOADED", "a client's instance: FORBIDDEN"...
        self.unanswered = 0
        self.failures: list[str] = []  # an answer no correct daemon gives

    def flood(self, clients: list[int]) -> None:
        try:
            worker = registered_worker(self.url, "soak-cancel-flood", self.timeout_s)
        except (LMCacheMPError, OSError) as err:
            self.answers[f"not registered ({reason_class(str(err))})"] += 1
            return
        try:
            self.floods += 1
            for n in range(FLOOD_REQUESTS):
                ids = [f"flood-{self.floods:06d}-{n}-{i:032x}" for i in range(FLOOD_IDS_PER_REQUEST)]
                self._count("own instance", worker.instance_id, self._cancel(worker, worker.instance_id, ids),
                            ("answered", "OVERLOADED"))
            if self.floods % 2 == 0:  # ids shaped like the clients' own request ids
                for victim in self.rng.sample(clients, min(FLOOD_VICTIMS, len(clients))):
                    ids = [f"soak-{self.rng.randrange(8)}-{self.rng.randrange(1, 10**5)}" for _ in range(256)]
                    answer = self._cancel(worker, victim, ids)
                    self._count("a client's instance", victim, answer, ("FORBIDDEN",))
        finally:
            worker.shutdown()

    def _cancel(self, worker: LMCacheMPWorkerAdapter, instance_id: int, ids: list[str]) -> str:
        try:
            worker.mq_client.submit(RequestType.CANCEL_TRANSFERS, [instance_id, ids],
                                    timeout_s=self.timeout_s).result(self.timeout_s)
        except ServerError as err:
            return err.code.name
        except LMCacheMPError:
            return "no reply"
        return "answered"

    def _count(self, whose: str, instance_id: int, answer: str, expected: tuple[str, ...]) -> None:
        if answer not in expected and answer != "no reply" and whose != "own instance":
            report = try_status(self.url)
            if report is not None and instance_id not in report.registered_instances:
                answer += ", the instance gone meanwhile"  # its client was killed: nothing to forbid
                expected = (answer,)
        self.answers[f"{whose}: {answer}"] += 1
        if answer == "no reply":
            self.unanswered += 1
        elif answer not in expected and len(self.failures) < 10:
            self.failures.append(f"CANCEL_TRANSFERS for {whose} {instance_id}: {answer}")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed (a peek that finds the end of the stream)."""
    sock.setblocking(False)  # a socket with a timeout would wait that long for something to read
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class IdleConnections:
    """Connections that never say anything: `count` ZeroMQ DEALERs on the daemon's socket and as
    many raw Unix connections to its attach socket (HELLO's attach_socket, where a worker hands
    its memfds over), held a while, then closed. Stalled clients must neither hold the daemon's
    memory or descriptors once gone (the final checks) nor block anyone while there: meanwhile a
    worker registers through that same attach socket and STATUS is answered. The daemon may
    close an idle attach connection first (a deadline of its own): counted, not a failure."""

    def __init__(self, url: str, count: int, timeout_s: float):
        self.url = url
        self.count = count
        self.timeout_s = timeout_s
        self.rounds = 0
        self.opened: Counter = Counter()  # "ZeroMQ", "attach", "attach refused at connect"
        self.closed_by_daemon = 0  # attach connections the daemon had closed when we closed them
        self.served: Counter = Counter()  # "registration", "STATUS"; "... failed"
        self.registration_s: list[float] = []  # how long a registration took while they were held
        self.failures: list[str] = []

    def hold(self, hold_s: float) -> None:
        """Open them, check that the daemon serves meanwhile, close them after `hold_s`."""
        hello_client = MessageQueueClient(self.url)
        try:
            attach_socket = hello_client.handshake("soak idle connections", self.timeout_s).attach_socket
        except LMCacheMPError:
            return  # daemon away (not during a restart: the soak holds them off); nothing to attack
        finally:
            hello_client.close()
        started = time.monotonic()
        dealers, raws = self._open(attach_socket)
        self.rounds += 1
        registration = threading.Thread(target=self._register, name="idle-connections-probe", daemon=True)
        try:
            registration.start()
            self.served["STATUS" if try_status(self.url) is not None else "STATUS failed"] += 1
            time.sleep(max(0.0, started + hold_s - time.monotonic()))
            self.closed_by_daemon += sum(closed_by_peer(raw) for raw in raws)
        finally:
            for dealer in dealers:
                dealer.close(linger=0)
            for raw in raws:
                raw.close()
        registration.join(4 * self.timeout_s + 5)  # HELLO, attach, REGISTER, UNREGISTER: each bounded
        if registration.is_alive():
            self.served["registration failed"] += 1
            self.failures.append("a registration made while idle connections were held never finished")

    def _open(self, attach_socket: str) -> tuple[list[zmq.Socket], list[socket.socket]]:
        dealers, raws = [], []
        for _ in range(self.count):
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.url)
            dealers.append(dealer)
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(1.0)
            try:
                raw.connect(attach_socket)
            except OSError:  # a daemon that bounds pending attach connections may refuse more
                raw.close()
                self.opened["attach refused at connect"] += 1
                continue
            raws.append(raw)
        self.opened["ZeroMQ"] += len(dealers)
        self.opened["attach"] += len(raws)
        return dealers, raws

    def _register(self) -> None:
        """A worker registering while they are held: HELLO, the attach hand-over, REGISTER."""
        started = time.monotonic()
        try:
            registered_worker(self.url, "soak-idle-probe", self.timeout_s).shutdown()
        except (LMCacheMPError, OSError) as err:
            self.served["registration failed"] += 1
            if len(self.failures) < 10:
                self.failures.append(f"a registration made while idle connections were held failed: {err}")
            return
        self.served["registration"] += 1
        self.registration_s.append(time.monotonic() - started)


# ---- the daemon and its resources -----------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: float | None
    fds: int | None
    leases: int | None
    ops: int  # operations completed by all clients so far (from their snapshots)


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def fd_count(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def try_status(url: str) -> StatusReport | None:
    with contextlib.suppress(LMCacheMPError):
        return daemon_status(url, timeout_s=2.0)
    return None


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.url = f"ipc://{tmp / 'daemon.sock'}"
        disk = tmp / "disk"
        disk.mkdir()
        self.daemon_args = ("--chunk-size", str(CHUNK), "--l1-size-gb", str(args.l1_size_gb),
                            "--l2", f"disk://{disk}?size_gb=1", "--lease-ttl-s", str(args.lease_ttl_s),
                            "--queue-deadline-s", str(min(2.0, args.timeout_s / 2)))
        # The daemon dies with the soak too (setpriv sets its parent-death signal).
        self.prefix = ("setpriv", "--pdeathsig", "KILL") if shutil.which("setpriv") else ()
        self.daemons: list[DaemonProcess] = []
        self.clients: dict[int, mp.process.BaseProcess] = {}
        self.ctx = mp.get_context("spawn")
        self.garbage = GarbageSender(self.url, self.rng)
        self.flooder = CancelFlooder(self.url, args.seed + 1, args.timeout_s + args.grace_s)
        self.idle = IdleConnections(self.url, args.idle_connections, args.timeout_s)
        self.shrinker: mp.process.BaseProcess | None = None
        self.samples: list[Sample] = []
        self.restarts: list[dict] = []
        self.client_kills: list[float] = []
        self.killed: set[int] = set()
        self.restarting = threading.Lock()  # held by a restart or freeze, and by each attack (`every`)
        self.stopping = threading.Event()
        self.attack_errors: list[Exception] = []
        self.start = 0.0
        self.end_time = 0.0

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    def start_daemon(self) -> None:
        self.daemons.append(start_daemon(self.tmp, *self.daemon_args, url=self.url,
                                         command_prefix=self.prefix))

    def start_client(self, index: int, shrink_every_s: float = 0.0) -> mp.process.BaseProcess:
        """A client process; with `shrink_every_s`, the shrinking worker (not in `clients`)."""
        a = self.args
        stem = f"client-{'shrinking' if shrink_every_s else index}"
        cfg = ClientConfig(index, self.url, a.seed * 1000 + index, a.seed, a.prompts, a.prefixes,
                           self.end_time, a.timeout_s, a.grace_s, a.freeze_s,
                           str(self.tmp / f"{stem}.json"), str(self.tmp / f"{stem}.pairs"),
                           str(self.tmp / f"{stem}.log"), shrink_every_s)
        proc = self.ctx.Process(target=client_main, args=(cfg,), name=f"soak-{stem}")
        proc.start()
        if not shrink_every_s:
            self.clients[index] = proc
        return proc

    def client_stats(self) -> list[dict]:
        """Every client's, the shrinking worker's included (a worker too, checked alike)."""
        out = []
        for path in sorted(self.tmp.glob("client-*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text()))
        return out

    def sample(self) -> None:
        pid = self.daemon.proc.pid
        report = try_status(self.url)
        ops = sum(sum(v for k, v in s["ops"].items() if k in RequestType.__members__)
                  for s in self.client_stats())
        self.samples.append(Sample(time.time() - self.start, rss_mib(pid), fd_count(pid),
                                   report.leases if report else None, ops))

    # ---- chaos ---------------------------------------------------------------------------------

    def kill_client(self) -> None:
        alive = sorted(i for i, p in self.clients.items() if p.is_alive())
        if not alive:  # they all crashed: the report says so
            return
        index = self.rng.choice(alive)
        self.killed.add(index)
        self.clients[index].kill()
        self.clients[index].join(10)
        self.client_kills.append(time.time() - self.start)
        self.start_client(max(self.clients) + 1)

    def restart_daemon(self) -> None:
        sig = self.rng.choice((signal.SIGTERM, signal.SIGKILL))
        with self.restarting:
            killed = time.time()
            exit_code = self.daemon.stop(sig, timeout=30)
            stopped = time.time()
            self.start_daemon()
            ready = time.time()
        self.restarts.append({"t": killed - self.start, "signal": sig.name, "exit_code": exit_code,
                              "stop_s": stopped - killed, "down_s": ready - killed,
                              "killed": killed, "ready": ready})

    def freeze_daemon(self) -> None:
        """SIGSTOP the daemon past the clients' timeouts, then SIGCONT: it wakes up to requests
        whose clients gave up on them. Listed with the restarts (signal SIGSTOP)."""
        with self.restarting:
            frozen = time.time()
            freeze(self.daemon.proc)
            time.sleep(self.args.freeze_s)
            self.daemon.proc.send_signal(signal.SIGCONT)
            thawed = time.time()
        self.restarts.append({"t": frozen - self.start, "signal": "SIGSTOP", "exit_code": None,
                              "stop_s": 0.0, "down_s": thawed - frozen, "killed": frozen, "ready": thawed})

    def chaos_loop(self) -> None:
        """SIGKILL a client every other event; in between, restart the daemon or freeze it
        (restarts only before the last daemon's window); malformed traffic and the hostile
        workers' attacks come from threads of their own meanwhile."""
        a = self.args
        next_chaos = time.time() + a.chaos_interval_s
        chaos_end = self.end_time - a.settle_s
        restarts_end = self.end_time - max(a.settle_s, a.last_daemon_frac * a.duration_s)
        hold_s = min(IDLE_HOLD_S, a.chaos_interval_s / 2)
        attacks = [
            self.every("garbage", a.chaos_interval_s / 2, chaos_end,
                       lambda instances: self.garbage.burst(instances, a.timeout_s + a.grace_s)),
            self.every("cancel flood", a.chaos_interval_s, chaos_end, self.flooder.flood),
            self.every("idle connections", 2 * a.chaos_interval_s, chaos_end,
                       lambda _: self.idle.hold(hold_s)),
        ]
        tick = 0
        try:
            while time.time() < self.end_time:
                time.sleep(min(1.0, max(0.0, self.end_time - time.time())))
                self.sample()
                if time.time() < next_chaos or time.time() > chaos_end:
                    continue
                can_restart = time.time() < restarts_end
                can_freeze = a.freeze_s > 0 and time.time() + a.freeze_s < chaos_end
                if tick % 2 and can_freeze and (tick % 4 == 3 or not can_restart):
                    self.freeze_daemon()
                elif tick % 2 and can_restart:
                    self.restart_daemon()
                else:
                    self.kill_client()
                tick += 1
                next_chaos = time.time() + a.chaos_interval_s
        finally:
            self.stopping.set()
            for thread in attacks:
                thread.join()
        if self.attack_errors:
            raise self.attack_errors[0]

    def every(self, name: str, period_s: float, until: float,
              attack: Callable[[list[int]], None]) -> threading.Thread:
        """A thread that runs `attack(the registered instance ids)` every `period_s` until `until`,
        never across a restart or a freeze (it holds the lock they take: the replies to requests
        in flight die with a daemon, and a frozen one answers nothing)."""
        def loop() -> None:
            try:
                while not self.stopping.wait(period_s) and time.time() < until:
                    with self.restarting:
                        report = try_status(self.url)
                        attack(report.registered_instances if report else [])
            except Exception as err:  # handed to the main thread, which fails the run with it
                self.attack_errors.append(err)

        thread = threading.Thread(target=loop, name=name)
        thread.start()
        return thread

    def timeouts_while_up(self, stats: list[dict]) -> int:
        """Client timeouts that no restart explains: the request was sent while the daemon was
        up, and it was not killed within the request's timeout (nor just restarted: a client's
        socket takes a moment to reconnect)."""
        windows = [(r["killed"] - self.args.timeout_s, r["ready"] + 1.0) for r in self.restarts]
        return sum(1 for s in stats for sent in s["timeouts_sent_at"]
                   if not any(lo <= sent <= hi for lo, hi in windows))

    # ---- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        self.start_daemon()
        time.sleep(1.0)  # let the fresh daemon settle before its baseline
        base_pid = self.daemon.proc.pid
        baseline = {"rss_mib": rss_mib(base_pid), "fds": fd_count(base_pid),
                    "leases": daemon_status(self.url).leases}
        self.start = time.time()
        self.end_time = self.start + a.duration_s
        for index in range(a.clients):
            self.start_client(index)
        self.shrinker = self.start_client(-1, shrink_every_s=a.chaos_interval_s)
        self.chaos_loop()
        hung, crashed = self.stop_clients()
        report = self.wait_idle()
        pid = self.daemon.proc.pid
        end = {"rss_mib": rss_mib(pid), "fds": fd_count(pid), "leases": report.leases if report else None,
               "registered_instances": len(report.registered_instances) if report else None,
               "daemon_uptime_s": report.uptime_s if report else None}
        self.sample()
        final_exit = self.daemon.stop(signal.SIGTERM, timeout=30)
        return self.figures(baseline, end, (hung, crashed), final_exit)

    def stop_clients(self) -> tuple[int, int]:
        """Clients stop on their own at the end time; any still running long after is hung.
        Returns (hung, crashed: exited non-zero without being killed by the chaos)."""
        deadline = self.end_time + 2 * (self.args.timeout_s + self.args.grace_s) + 30
        hung = 0
        survivors = [p for i, p in self.clients.items() if i not in self.killed]
        if self.shrinker is not None:  # a client too, never killed by the chaos
            survivors.append(self.shrinker)
        for proc in survivors:
            proc.join(max(0.0, deadline - time.time()))
            if proc.is_alive():
                hung += 1
                proc.kill()
                proc.join(10)
        crashed = sum(1 for p in survivors if p.exitcode != 0)
        return hung, crashed - hung  # a hung client was killed here: not counted twice

    def wait_idle(self) -> StatusReport | None:
        """Until no lease or registration is left: the killed clients' leases expire after the TTL."""
        deadline = time.time() + self.args.lease_ttl_s + 15
        report = try_status(self.url)
        while time.time() < deadline and (report is None or report.leases or report.registered_instances):
            time.sleep(0.5)
            report = try_status(self.url)
        return report

    def recoveries(self) -> list[dict]:
        """For each restart: the first store+read-back pair whose STORE was sent after the new
        daemon answered, if it came before the next restart."""
        pairs: list[tuple[float, float]] = []
        for path in self.tmp.glob("client-*.pairs"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    stored, done = map(float, line.split())
                    pairs.append((stored, done))
        out = []
        for i, r in enumerate(self.restarts):
            until = self.restarts[i + 1]["ready"] if i + 1 < len(self.restarts) else self.end_time
            done = [d for s, d in pairs if s >= r["ready"] and d <= until]
            row = {k: v for k, v in r.items() if k not in ("killed", "ready")}
            row["recovery_s"] = min(done) - r["ready"] if done else None
            out.append(row)
        return out

    def figures(self, baseline: dict, end: dict, hung_crashed: tuple[int, int], final_exit: int) -> dict:
        stats = self.client_stats()
        ops: Counter = Counter()
        errors: Counter = Counter()
        for s in stats:
            ops.update(s["ops"])
            errors.update(s["errors"])
        logs = [d.log() for d in self.daemons]
        wrong_keys = {k for s in stats for k in s["wrong_keys"]}
        timed_out = {k for s in stats for k in s["timed_out_store_keys"]}
        return {
            "config": {k: v for k, v in vars(self.args).items() if k not in ("out", "json")},
            "duration_s": self.args.duration_s,
            "ops": dict(ops),
            "errors": dict(errors),
            "wrong_chunks": sum(s["wrong_chunks"] for s in stats),
            "wrong_bytes": sum(s["wrong_bytes"] for s in stats),
            "wrong_examples": [e for s in stats for e in s["wrong_examples"]],
            "wrong_keys": len(wrong_keys),
            "wrong_keys_stored_by_a_timed_out_store": len(wrong_keys & timed_out),
            "unreplied": sum(s["unreplied"] for s in stats),
            "timeouts_while_daemon_up": self.timeouts_while_up(stats),
            "other_reasons": [e for s in stats for e in s["other_reasons"]],
            "clients_started": len(self.clients),
            "clients_killed": len(self.client_kills),
            "clients_hung": hung_crashed[0],
            "clients_crashed": hung_crashed[1],
            "clients_exited_cleanly": sum(s["clean_exit"] for s in stats),
            "garbage": {"sent": self.garbage.sent, "unreplied": self.garbage.unreplied_kinds.total(),
                        "unreplied_kinds": dict(self.garbage.unreplied_kinds),
                        "oversized_sent": self.garbage.oversized,
                        "replies": dict(self.garbage.replies)},
            "attacks": {
                "cancel_flood": {"floods": self.flooder.floods, "ids_per_request": FLOOD_IDS_PER_REQUEST,
                                 "answers": dict(self.flooder.answers), "unanswered": self.flooder.unanswered,
                                 "failures": self.flooder.failures},
                "shrinking_worker": {"exit_code": self.shrinker.exitcode if self.shrinker else None,
                                     "outcomes": dict(sum((Counter(s["shrink"]) for s in stats), Counter()))},
                "idle_connections": {"rounds": self.idle.rounds, "per_round": self.idle.count,
                                     "opened": dict(self.idle.opened),
                                     "attach_closed_by_daemon": self.idle.closed_by_daemon,
                                     "served_meanwhile": dict(self.idle.served),
                                     "registration_s_max": max(self.idle.registration_s, default=None),
                                     "failures": self.idle.failures},
            },
            "restarts": self.recoveries(),
            "daemon_tracebacks": sum(log.count("Traceback") for log in logs),
            "final_daemon_exit_code": final_exit,
            "resources": {"start": baseline, "end": end,
                          "tolerance": {"rss_mib": RSS_TOLERANCE_MIB, "fds": FD_TOLERANCE, "leases": 0}},
            "timeline": [asdict(s) for s in self.samples],
            "client_kill_times_s": self.client_kills,
        }


def checks_of(f: dict) -> dict[str, bool]:
    start, end = f["resources"]["start"], f["resources"]["end"]
    recovered = [r["recovery_s"] for r in f["restarts"]]
    rss_growth = (end["rss_mib"] or 1e9) - (start["rss_mib"] or 0)
    fd_growth = (end["fds"] or 10**9) - (start["fds"] or 0)
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    forbidden = sum(n for k, n in flood["answers"].items() if k.startswith("a client's"))
    shrinks = shrink["outcomes"]
    return {
        f"work was done ({f['ops'].get('STORE ok', 0)} stores, {f['ops'].get('RETRIEVE ok', 0)} retrieves, "
        f"{f['ops'].get('chunks verified', 0)} chunks verified)":
            f["ops"].get("STORE ok", 0) > 0 and f["ops"].get("chunks verified", 0) > 0,
        f"0 wrong bytes served ({f['wrong_bytes']} in {f['wrong_chunks']} chunks)": f["wrong_bytes"] == 0,
        f"0 requests without a reply ({f['unreplied']} client, {f['garbage']['unreplied']} malformed, "
        f"{flood['unanswered']} CANCEL_TRANSFERS of the flood)":
            f["unreplied"] == 0 and f["garbage"]["unreplied"] == 0 and flood["unanswered"] == 0,
        f"CANCEL_TRANSFERS floods answered as bounded ({flood['floods']} floods; {forbidden} for a client's "
        f"instance; {len(flood['failures'])} answers other than a count, OVERLOADED or FORBIDDEN)":
            not flood["failures"],
        f"every ftruncate of a registered cache refused ({shrinks.get(SHRINK_REFUSED, 0)} of "
        f"{sum(n for k, n in shrinks.items() if k != SHRINK_NOT_TRIED)}; exit {shrink['exit_code']})":
            set(shrinks) <= {SHRINK_REFUSED, SHRINK_NOT_TRIED} and shrink["exit_code"] == 0,
        f"served while idle connections were held ({idle['served_meanwhile']} in {idle['rounds']} rounds)":
            not idle["failures"] and idle["served_meanwhile"].get("STATUS failed", 0) == 0,
        f"no timeout while the daemon was up ({f['timeouts_while_daemon_up']})":
            f["timeouts_while_daemon_up"] == 0,
        f"no client hung or crashed ({f['clients_hung']} hung, {f['clients_crashed']} crashed)":
            f["clients_hung"] == 0 and f["clients_crashed"] == 0,
        f"recovered after every restart ({sum(r is not None for r in recovered)} of {len(recovered)})":
            all(r is not None for r in recovered),
        f"no daemon traceback ({f['daemon_tracebacks']})": f["daemon_tracebacks"] == 0,
        f"daemon RSS flat ({start['rss_mib']:.0f} -> {end['rss_mib'] or 0:.0f} MiB, "
        f"tolerance +{RSS_TOLERANCE_MIB:.0f})": rss_growth <= RSS_TOLERANCE_MIB,
        f"daemon fds flat ({start['fds']} -> {end['fds']}, tolerance +{FD_TOLERANCE})":
            fd_growth <= FD_TOLERANCE,
        f"no lease left ({start['leases']} -> {end['leases']})": end["leases"] == 0,
        f"no registration left ({end['registered_instances']})": end["registered_instances"] == 0,
        f"final daemon stopped cleanly by SIGTERM (exit {f['final_daemon_exit_code']})":
            f["final_daemon_exit_code"] == 0,
    }


def print_report(f: dict) -> None:
    print(f"\nsoak of {f['duration_s']:.0f} s, {f['clients_started']} client processes started, "
          f"{f['clients_killed']} SIGKILLed")
    print(f"\n{'operation':<28}{'count':>10}")
    for name, count in sorted(f["ops"].items()):
        print(f"{name:<28}{count:>10}")
    if f["errors"]:
        print(f"\n{'failed (typed) operation':<40}{'count':>8}")
        for name, count in sorted(f["errors"].items()):
            print(f"{name:<40}{count:>8}")
    g = f["garbage"]
    print(f"\nmalformed requests: {g['sent']} sent, {g['unreplied']} unanswered, replies {g['replies']}; "
          f"{g['oversized_sent']} oversized (no reply expected)")
    if g["unreplied_kinds"]:
        print(f"   unanswered: {g['unreplied_kinds']}")
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    print(f"cancel floods: {flood['floods']} ({flood['ids_per_request']} request ids a CANCEL_TRANSFERS), "
          f"answers {flood['answers']}")
    print(f"shrinking worker: {shrink['outcomes']}")
    reg_s = idle["registration_s_max"]
    print(f"idle connections: {idle['rounds']} rounds of {idle['per_round']} ZeroMQ + {idle['per_round']} "
          f"attach (opened {idle['opened']}, {idle['attach_closed_by_daemon']} attach closed by the daemon "
          f"first); served meanwhile {idle['served_meanwhile']}"
          + (f", registration within {reg_s:.2f} s" if reg_s is not None else ""))
    for line in flood["failures"] + idle["failures"]:
        print("  ", line)
    # down: from the signal until the new daemon answered HELLO (stop: until the old one exited);
    # recovery: from then until a client's first STORE + read-back of a prompt.
    print(f"\n{'restart at s':>12}{'signal':>9}{'exit':>6}{'stop s':>8}{'down s':>8}{'recovery s':>12}")
    for r in f["restarts"]:
        rec = "NEVER" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        print(f"{r['t']:>12.1f}{r['signal']:>9}{r['exit_code']!s:>6}{r['stop_s']:>8.2f}{r['down_s']:>8.2f}"
              f"{rec:>12}")
    start, end = f["resources"]["start"], f["resources"]["end"]
    print(f"\ndaemon at start (fresh) / at end (idle, uptime {end['daemon_uptime_s'] or 0:.0f} s): "
          f"RSS {start['rss_mib']:.1f} / {end['rss_mib'] or 0:.1f} MiB, fds {start['fds']} / {end['fds']}, "
          f"leases {start['leases']} / {end['leases']}")
    if f["wrong_chunks"]:
        print(f"\nwrong chunks served: {f['wrong_chunks']}, under {f['wrong_keys']} distinct keys, "
              f"{f['wrong_keys_stored_by_a_timed_out_store']} of which a STORE that timed out had sent "
              "(the daemon may have run it later, reading blocks the client had reused)")
    for line in f["wrong_examples"] + f["other_reasons"]:
        print("  ", line)


RESTART_STYLES = {"SIGKILL": ("red", "-"), "SIGTERM": ("red", "--"), "SIGSTOP": ("purple", "-")}


def plot(f: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = f["timeline"]
    t = [s["t"] for s in tl]
    rate = [0.0] + [(b["ops"] - a["ops"]) / max(1e-9, b["t"] - a["t"]) for a, b in itertools.pairwise(tl)]
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    series = (("operations/s (all clients)", rate), ("daemon RSS (MiB)", [s["rss_mib"] for s in tl]),
              ("daemon open fds", [s["fds"] for s in tl]), ("leases", [s["leases"] for s in tl]))
    for ax, (label, ys) in zip(axes, series, strict=True):
        ax.plot(t, [float("nan") if y is None else y for y in ys], linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        for r in f["restarts"]:
            color, style = RESTART_STYLES[r["signal"]]
            ax.axvline(r["t"], color=color, linewidth=0.8, linestyle=style)
        for k in f["client_kill_times_s"]:
            ax.axvline(k, color="gray", linewidth=0.6, linestyle=":")
    axes[-1].set_xlabel("seconds (daemon: red SIGKILL, dashed red SIGTERM, purple freeze; "
                        "gray: client SIGKILL)",
                        fontsize=8)
    axes[0].set_title("lmcache-mp chaos soak")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(args: argparse.Namespace, checks: dict[str, bool], figures: dict) -> None:
    """The verdicts; the figures as JSON, always; the chart only where matplotlib is installed
    (a machine without it still gets the figures, and the exit status of the checks)."""
    print()
    for name, ok in checks.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    written = [args.out / "soak.json", *([args.json] if args.json else [])]
    for path in written:
        path.write_text(json.dumps(figures, indent=2))
    try:
        import matplotlib  # noqa: F401  (only the chart needs it)
    except ImportError as err:
        print(f"\nchart skipped: matplotlib cannot be imported ({err})")
    else:
        plot(figures, args.out / "soak.png")
        written.append(args.out / "soak.png")
    print(f"\nwrote {', '.join(map(str, written))}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0,
                        help="how long the clients run their load (the chaos stops --settle-s earlier)")
    parser.add_argument("--clients", type=int, default=4,
                        help="client processes at any time (scheduler + worker adapter pair each)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the prompts, the clients' choices and the chaos; same seed, same plan")
    parser.add_argument("--chaos-interval-s", type=float, default=10.0,
                        help="seconds between chaos events; each sends a burst of malformed requests, "
                        "then alternately SIGKILLs a client or restarts the daemon")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="no chaos in the last seconds of the load, so the last restart can recover")
    parser.add_argument("--last-daemon-frac", type=float, default=0.5,
                        help="no daemon restart in this last fraction of the load: the last daemon serves "
                        "that long (client kills and malformed traffic go on) before its idle RSS and "
                        "descriptors are compared with a fresh daemon's")
    parser.add_argument("--freeze-s", type=float, default=None,
                        help="how long a freeze (SIGSTOP ... SIGCONT) of the daemon lasts; default "
                        "3 x --timeout-s + 1, so each client gives up on a few requests in a row and "
                        "reuses their blocks meanwhile; 0: no freezes")
    parser.add_argument("--prompts", type=int, default=300, help="distinct prompts the clients draw from")
    parser.add_argument("--prefixes", type=int, default=8,
                        help="shared 2-chunk prefixes the prompts start with")
    parser.add_argument("--l1-size-gb", type=float, default=0.01,
                        help="the daemon's CPU pool; small, so chunks are evicted and read up from disk")
    parser.add_argument("--lease-ttl-s", type=float, default=5.0,
                        help="the daemon's lease TTL: how long a killed client's leases outlive it")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="the adapters' request timeout: a request's future settles within it")
    parser.add_argument("--grace-s", type=float, default=5.0,
                        help="past timeout + grace, a future that has not settled counts as unreplied")
    parser.add_argument("--idle-connections", type=int, default=16,
                        help="idle ZeroMQ connections, and as many raw connections to the attach socket, "
                        "held every other chaos interval")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="where to write soak.json and soak.png (the chart: with matplotlib only)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures (JSON) here")
    args = parser.parse_args()
    if args.freeze_s is None:
        args.freeze_s = 3 * args.timeout_s + 1
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-soak-", dir="/tmp"))
    soak = Soak(args, tmp)
    # SIGTERM ends the soak like Ctrl-C: through the finally below, which stops every child.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        figures = soak.run()
    finally:
        for proc in [*soak.clients.values(), *([soak.shrinker] if soak.shrinker else [])]:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for daemon in soak.daemons:
            if daemon.proc.poll() is None:
                daemon.stop(signal.SIGKILL)
    print_report(figures)
    checks = checks_of(figures)
    figures["checks"] = checks
    write_report(args, checks, figures)
    if all(checks.values()):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"daemon and client logs kept in {tmp}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
