"""The soak's client processes (`scripts/soak/soak.py`): vLLM stand-ins that store, look up and
retrieve prompts whose every chunk's content is a function of its key, so that any process can
check any chunk, whoever stored it; and the shrinking worker, which also tries to cut its
registered cache short."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.protocol import ErrorCode
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp
from vllm_adapter.ops import striding_block_hashes

MODEL = "soak-model"
LAYOUT = "CPU_ATTN"
DTYPE = torch.bfloat16
BLOCKS_PER_CHUNK = CHUNK // BLOCK
POISON = -7.0  # what a block holds before a RETRIEVE: a block the daemon did not write shows it
PR_SET_PDEATHSIG = 1
RESTORE_FRACTION = 0.2
FAILED_ROUND_PAUSE_S = 0.05
END_TIME_REREAD_S = 1.0  # how often a client reads the soak's end time again (it may move later)
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


class SharedEndTime:
    """The soak's end time, set once the clients serve and moved later by an extended run: read from
    `path` at most once every END_TIME_REREAD_S; `initial` until the file exists."""

    def __init__(self, path: str, initial: float):
        self.path = path
        self.value = initial
        self.next_read = 0.0

    def __call__(self) -> float:
        now = time.monotonic()
        if self.path and now >= self.next_read:
            self.next_read = now + END_TIME_REREAD_S
            with contextlib.suppress(OSError, ValueError):  # not written yet: the initial end holds
                self.value = float(Path(self.path).read_text())
        return self.value


@dataclass
class ClientConfig:
    index: int
    url: str
    seed: int
    prompt_seed: int
    num_prompts: int
    num_prefixes: int
    end_time: float  # time.time() at which the client stops its load, until end_time_path says otherwise
    timeout_s: float
    grace_s: float
    freeze_s: float
    stats_path: str
    pairs_path: str
    log_path: str
    shrink_every_s: float = 0.0  # > 0: a ShrinkingWorker, a fresh registration this often
    # Where each acknowledged STORE is written down ("TIME PROMPT": the whole prompt is in the
    # daemon from then on), for the warm-restart checks; "": nowhere
    acked_path: str = ""
    # Where the soak writes the end time once it knows it (its clock starts when the clients serve)
    # and each time it moves it later (--min-restarts); "": nowhere
    end_time_path: str = ""


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
        self.acked = open(cfg.acked_path, "a", buffering=1) if cfg.acked_path else None  # noqa: SIM115
        self.seq = 0
        self.next_snapshot = 0.0
        self.end_time = SharedEndTime(cfg.end_time_path, cfg.end_time)
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
        while time.time() < self.end_time():
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
        if stored and self.acked is not None:  # its first chunks were hits: the prompt is all there
            self.acked.write(f"{time.time():.6f} {prompt}\n")
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
    """A worker registers its CPU caches (the adapter moves them into a
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
        time.sleep(max(0.0, min(self.cfg.shrink_every_s, self.end_time() - time.time())))

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


