"""A worker's registration with the daemon: its instance id, attach channel, probes and refusals.

- a worker registers under a random 63-bit instance id, never its pid (pids repeat across
  containers sharing one daemon, and one worker's RETRIEVEs would land in another's cache). An
  id the daemon has registered already is never taken over: the worker picks another;
- the registration lives as long as its attach channel (the Unix socket its caches' descriptors
  went over): once the daemon has closed its end, the worker registers again by itself when the
  daemon is back. Until then it fails closed (`ensure_registered` is False);
- a daemon that is away or still starting is probed with HELLO every `MAX_PROBE_INTERVAL_S` at
  most, never waited on; the registration runs once one has answered that it serves;
- a registration the daemon refuses as invalid (unsupported layout, a chunk larger than its
  pool, caches read in other blocks than vLLM's) is not retried: one ERROR, then the worker
  serves without the cache until that daemon is gone. Other failures are retried with
  exponential backoff.
"""

from __future__ import annotations

import logging
import secrets
import time

import torch

from lmcache_mp.errors import KVExportError, LMCacheMPError, ServerError
from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import (
    PERMANENT_ERRORS,
    PHASE_STARTING,
    PROTOCOL_VERSION,
    ErrorCode,
    KVCacheRegistration,
    RegisterReply,
    RequestType,
)
from lmcache_mp.transfer.attach_channel import AttachChannel
from vllm_adapter.fences import Fences, Target
from vllm_adapter.kv_export import export_kv_caches
from vllm_adapter.ops import KeyMaker

logger = logging.getLogger(__name__)

REREGISTER_INTERVAL_S = 1.0
# A probe sent just as the daemon died is lost with its connection; waiting out a long probe
# timeout then delays re-registration after a restart. Probes are tiny: retry them quickly.
MAX_PROBE_INTERVAL_S = 0.25
# Registration attempts that failed for a reason that may pass (timeout, overloaded daemon,
# attach socket error) are retried after a delay doubling from the first to the last.
FIRST_RETRY_S = 0.25
MAX_RETRY_S = 30.0


def new_instance_id() -> int:
    """A random instance id: unique per worker among every container sharing a daemon (a pid is
    not: it repeats across PID namespaces). 63 bits, so it fits any signed 64-bit field."""
    return secrets.randbits(63)


class WorkerRegistration:
    """One worker's caches as registered with the daemon (`keys`: under which model, world size
    and rank). `fences` learns of each attach channel the worker gives up."""

    def __init__(self, client: MessageQueueClient, server_url: str, keys: KeyMaker, fences: Fences, *,
                 timeout_s: float, reregister_interval_s: float, instance_id: int | None,
                 replicated: bool):
        self._client = client
        self._server_url = server_url
        self._keys = keys
        self._fences = fences
        self._timeout_s = timeout_s
        self._probe_interval_s = min(reregister_interval_s, MAX_PROBE_INTERVAL_S)
        self._replicated = replicated
        self._name = f"vllm-worker-{keys.worker_id}"
        self.instance_id = new_instance_id() if instance_id is None else instance_id
        self._forced_id = instance_id is not None
        self._epoch: int | None = None  # the restart epoch (HELLO) of the daemon last registered with
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layout = ""
        self.channel: AttachChannel | None = None
        self._registered = False
        self.refused = False  # the daemon refused the registration as invalid: not retried
        self._retry_s = FIRST_RETRY_S  # delay after the next failed registration attempt
        self._next_try = 0.0  # no probe (and so no registration attempt) before this time
        self._probe: MessagingFuture | None = None  # HELLO sent while the daemon was away

    def target(self) -> Target | None:
        """Where an operation sent now goes (to fence it, should it time out)."""
        return Target(self.instance_id, self.channel) if self.channel is not None else None

    def register(self, kv_caches: dict[str, torch.Tensor], layout: str | None) -> None:
        """See `LMCacheMPWorkerAdapter.register_kv_caches`."""
        self.kv_caches = kv_caches
        self._layout = layout or ""
        self.refused = False
        self._retry_s = FIRST_RETRY_S
        self._register()

    def lost(self) -> None:
        """The daemon no longer knows this registration (it restarted): register again."""
        self._registered = False

    def _register(self) -> None:
        try:
            try:
                reply = self._register_as(self.instance_id)
            except ServerError as err:
                if err.code is not ErrorCode.ALREADY_REGISTERED:
                    raise
                # Another worker's id (forced ids), or our own registration that the daemon has
                # not dropped yet (its attach channel was closed just now): never take it over.
                taken, self.instance_id = self.instance_id, new_instance_id()
                logger.warning("instance id %d is already registered with lmcache-mp at %s; "
                               "registering as %d", taken, self._server_url, self.instance_id)
                reply = self._register_as(self.instance_id)
            if reply.block_size != self._keys.block_size:
                self._withdraw(reply)  # raises: refused for good
        except (LMCacheMPError, OSError) as err:
            self._registration_failed(err)
            raise
        self._registered = True
        self._retry_s = FIRST_RETRY_S
        logger.info("registered %d KV cache layers with lmcache-mp at %s as %s (%d-byte chunks)",
                    len(self.kv_caches), self._server_url, reply.layout, reply.chunk_bytes)

    def _register_as(self, instance_id: int) -> RegisterReply:
        try:
            handles, fds = export_kv_caches(self.kv_caches)
        except (RuntimeError, ValueError) as err:
            # E.g. a cuMem/VMM or expandable-segments allocation, which CUDA IPC cannot export.
            raise KVExportError(f"cannot share this worker's KV caches with the daemon: {err}") from err
        hello = self._client.handshake(self._name, timeout_s=self._timeout_s)
        if hello.phase == PHASE_STARTING:  # its attach socket is not there yet
            raise ServerError(ErrorCode.STARTING, "the daemon is starting: registering once it serves")
        if self._epoch is not None and hello.epoch != self._epoch and not self._forced_id:
            # A restarted daemon: requests sent to the last one may still sit in the socket's queue
            # and reach this one; they name the old id, which this daemon never knows, so they are
            # refused rather than carried out on block ids this worker may have reused since.
            instance_id = self.instance_id = new_instance_id()
        self._epoch = hello.epoch
        if self.channel is not None:
            self._fences.retire(self.channel)  # the daemon drops the registration it kept alive
            self.channel = None
        self.channel = AttachChannel.open(hello.attach_socket, fds, timeout_s=self._timeout_s)
        keys = self._keys
        registration = KVCacheRegistration(keys.model_name, keys.world_size, keys.worker_id,
                                           self._layout, self.channel.token,
                                           block_size=keys.block_size, replicated=self._replicated)
        return self._client.submit(RequestType.REGISTER_KV_CACHE,
                                   [instance_id, handles, registration]).result(self._timeout_s)

    def _withdraw(self, reply: RegisterReply) -> None:
        """A daemon that reads the caches in blocks other than vLLM's (one that predates
        `KVCacheRegistration.block_size`, whose kernel blocks it takes for vLLM's) would count
        other block ids per chunk than this worker sends and refuse every STORE and RETRIEVE:
        unregister, and refuse for good (`_registration_failed`), rather than keep a cache that
        silently fails every operation. The attach channel stays open: a restarted daemon gets
        another try."""
        try:
            self._client.submit(RequestType.UNREGISTER_KV_CACHE, [self.instance_id]).result(self._timeout_s)
        except LMCacheMPError as err:
            # Nothing is sent to it any more; the daemon drops it when this worker exits.
            logger.warning("unregistering the unusable registration failed: %s", err)
        raise KVExportError(f"the daemon reads these caches in blocks of {reply.block_size} tokens, "
                            f"vLLM's are {self._keys.block_size} tokens: upgrade the daemon, which "
                            "then groups the attention backend's kernel blocks into vLLM's blocks")

    def _registration_failed(self, err: LMCacheMPError | OSError) -> None:
        if isinstance(err, ServerError) and err.code is ErrorCode.STARTING:
            # As for a daemon that is not there yet: probed again soon, no backoff.
            logger.debug("lmcache-mp at %s is starting; registering the KV caches once it serves",
                         self._server_url)
            self._next_try = time.monotonic() + self._probe_interval_s
            return
        if isinstance(err, KVExportError) or (isinstance(err, ServerError) and err.code in PERMANENT_ERRORS):
            self.refused = True
            logger.error("KV offload to lmcache-mp at %s is off for this worker (lookups miss, stores "
                         "are skipped) until the daemon restarts, not retrying: %s", self._server_url,
                         err if isinstance(err, KVExportError) else f"it refused the KV caches: {err}")
            return
        logger.warning("registering the KV caches with lmcache-mp at %s failed (%s); KV offload paused, "
                       "retrying in %.2f s", self._server_url, err, self._retry_s)
        self._next_try = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, MAX_RETRY_S)

    def _refused_by_daemon(self) -> bool:
        """Whether the daemon refused our caches for good. That holds as long as the daemon that
        said it: once it is gone (it closed its end of the attach channel), the next one, maybe
        configured otherwise, gets one more try."""
        if self.refused and self.channel is not None and not self.channel.is_open():
            self.refused = False
            self._retry_s = FIRST_RETRY_S
        return self.refused

    def ensure_registered(self) -> bool:
        """Fail closed while the daemon is away; re-register when it is back. Never waits
        on an absent daemon: a HELLO probe goes out (at most once per interval, or after the
        backoff of a failed registration) and the registration runs only after the daemon has
        answered one. The probes themselves do not back off: they cost the daemon nothing while
        it is away, and find it soon after it restarts."""
        if self._registered and self.channel is not None and self.channel.is_open():
            return True
        self._registered = False
        if not self.kv_caches or self._refused_by_daemon():
            return False
        probe = self._probe
        if probe is not None and probe.query():
            self._probe = None
            # A daemon still starting answers HELLO, but takes registrations only once it serves.
            if probe.exception() is None and probe.result().phase != PHASE_STARTING:
                try:
                    self._register()  # logs its failure
                except (LMCacheMPError, OSError):
                    return False
                return True
        if self._probe is None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + self._probe_interval_s
            self._probe = self._client.submit(RequestType.HELLO, [PROTOCOL_VERSION, self._name],
                                              timeout_s=self._probe_interval_s)
        return False

    def close(self) -> None:
        """Unregister (if registered) and close the attach channel."""
        try:
            if self._registered:
                self._client.submit(RequestType.UNREGISTER_KV_CACHE, [self.instance_id]).result(5.0)
        except (LMCacheMPError, ServerError) as err:
            logger.info("unregister at shutdown failed (%s); the daemon drops us anyway", err)
        finally:
            if self.channel is not None:
                self.channel.close()
