"""The scheduler's adapter: LOOKUPs, and the releases of what they leased.

The API follows the seed's `LMCacheMPSchedulerAdapter` (same constructor and method names).
Differences, each fixing a known failure of the seed:
- every lookup is tracked per request id, so no request's answer is lost;
- when the daemon is unreachable it fails closed: a failed lookup counts 0 hits, a miss, never
  a guess;
- a lookup's hits stay leased at the daemon for the RETRIEVE that follows, until
  `release_leases`, `end_session` or the daemon's lease TTL. Releases are fire and forget, but
  one that fails (leases then held until the TTL) is logged, not lost.

And `reset_models`: a model's KV reset (vLLM's `reset_prefix_cache(reset_connector=True)`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import zmq

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import ModelReset, ModelScope, PrefixHit, RequestType, TailHit, TailNote
from vllm_adapter.ops import DEFAULT_TIMEOUT_S, KeyMaker, LoadStoreOp, connect, striding_block_hashes

logger = logging.getLogger(__name__)

# Fire-and-forget requests (END_SESSION, RELEASE_LEASES) whose replies the scheduler adapter
# watches for failures (bounded: past it, the oldest is no longer watched), and how long its
# shutdown waits for those still unanswered.
MAX_WATCHED_RELEASES = 4096
SHUTDOWN_RELEASE_WAIT_S = 1.0


class LMCacheMPSchedulerAdapter:
    """vLLM's scheduler's client of the daemon: how many tokens of a request it holds."""

    def __init__(self, server_url: str, context: zmq.Context | None, model_name: str, world_size: int,
                 kv_rank: int, vllm_block_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float | None = None, curve: ClientCurve | None = None):
        """`kv_rank` is the seed's, unused: a lookup names no rank. `curve`: the keys to
        authenticate with, for a daemon that requires CURVE."""
        self.mq_client, chunk_size = connect(server_url, context, "vllm-scheduler", timeout_s,
                                             vllm_block_size, connect_timeout_s, curve)
        self._keys = KeyMaker(model_name, world_size, None, chunk_size // vllm_block_size, vllm_block_size)
        self.lookup_futures: dict[str, MessagingFuture[int | PrefixHit]] = {}
        self._tails: dict[str, list[TailHit]] = {}  # the tails a settled LOOKUP_PREFIX found
        # (what, reply) of the releases sent, oldest first: the scheduler never waits for them, but
        # one that fails (leases then held until the daemon's TTL) is logged, not lost.
        self._releases: deque[tuple[str, MessagingFuture[None]]] = deque()
        self.unwatched_releases = 0  # dropped from the watch unanswered (MAX_WATCHED_RELEASES)

    @property
    def chunk_size(self) -> int:
        return self._keys.chunk_size

    @property
    def blocks_in_chunk(self) -> int:
        return self._keys.blocks_in_chunk

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes] | None = None,
                                    token_ids: list[int] | None = None, *, tails: bool = False) -> None:
        """Submit one LOOKUP per request id (later calls are no-ops). Its hits stay leased
        for the RETRIEVE that follows, until `end_session` or the daemon's lease TTL. `tails`
        (hash mode): ask for the tails after the hit too (`lookup_tails`)."""
        if request_id in self.lookup_futures:
            return
        if (block_hashes is None) == (token_ids is None):
            raise ValueError("exactly one of block_hashes or token_ids must be given")
        if token_ids is not None:
            aligned_end = len(token_ids) // self.chunk_size * self.chunk_size
            op = LoadStoreOp([], token_ids=token_ids, start=0, end=aligned_end)
            keys = self._keys.keys_for(request_id, op)
            request: tuple[RequestType, list[Any]] | None = (
                (RequestType.LOOKUP, [keys]) if aligned_end else None)
        else:
            # The usual case: every key one chunk hash, their shared fields sent once.
            keys = self._keys
            hashes = list(striding_block_hashes(block_hashes or [], keys.blocks_in_chunk))
            payload: list[Any] = [keys.model_name, keys.world_size, request_id, hashes]
            if tails:  # and the window a tail's last full block must be in (`lmcache_mp.engine.tails`)
                last_chunk = max(0, len(hashes) - 1) * keys.blocks_in_chunk
                payload.append(list((block_hashes or [])[last_chunk:]))
            kind = RequestType.LOOKUP_PREFIX if tails else RequestType.LOOKUP_CHUNKS
            request = (kind, payload) if hashes or tails else None
        if request is None:
            future: MessagingFuture[int | PrefixHit] = MessagingFuture.settled(RequestType.LOOKUP, 0)
        else:
            future = self.mq_client.submit(*request)
        self.lookup_futures[request_id] = future

    def check_lookup_result(self, request_id: str, wait_s: float = 0.0) -> int | None:
        """Tokens hit in whole chunks (a multiple of the chunk size; tails: `lookup_tails`), or
        None while the lookup is pending after waiting up to `wait_s`. A failed lookup (daemon
        down, error) counts as 0: a miss, never a guess."""
        future = self.lookup_futures[request_id]
        if wait_s > 0:
            future.wait(wait_s)
        # Polling drives the socket (settling earlier releases' replies too), but a lookup that
        # was waited on is settled already: then skip the poll's system calls.
        settled = future.done() or future.query()
        self._check_releases()
        if not settled:
            return None
        error = future.exception()
        if error is not None:
            logger.warning("lookup for request %s failed, counting a miss: %s", request_id, error)
            return 0
        hit = future.result()
        if isinstance(hit, PrefixHit):
            self._tails[request_id] = hit.tails
            hit = hit.chunks
        return hit * self.chunk_size

    def lookup_tails(self, request_id: str) -> list[TailHit]:
        """The tails a settled LOOKUP_PREFIX found after its chunk hit, newest first (leased with
        the hit: released alike)."""
        return self._tails.get(request_id, [])

    def note_tails(self, stored: list[TailNote], superseded: list[TailNote]) -> None:
        """Tell the daemon which tails are stored (their STOREs may still be on their way) and
        which are superseded (fire and forget)."""
        keys = self._keys
        self._release(f"NOTE_TAILS of {len(stored)} tail(s)", RequestType.NOTE_TAILS,
                      [keys.model_name, keys.world_size, stored, superseded])

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

    def cleanup_lookup_result(self, request_id: str) -> None:
        self.lookup_futures.pop(request_id, None)
        self._tails.pop(request_id, None)

    def release_leases(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Release the leases the request's lookup took on these chunks (their vLLM block
        hashes, whole chunks as in the lookup): chunks it will not retrieve need not stay
        pinned until `end_session` (fire and forget)."""
        keys = self._keys.keys_for(request_id, LoadStoreOp([], block_hashes=block_hashes))
        if keys:
            self._release(f"RELEASE_LEASES for request {request_id}", RequestType.RELEASE_LEASES, [keys])

    def end_session(self, request_id: str) -> None:
        """Release whatever the request still holds at the daemon (fire and forget: a failure is
        logged once its reply, or its timeout, is seen)."""
        self._release(f"END_SESSION for request {request_id}", RequestType.END_SESSION, [request_id])

    def _release(self, what: str, request_type: RequestType, payload: list[Any]) -> None:
        # Sent with the next request (or within mq.LATER_FLUSH_S): the scheduler doesn't pay a
        # send per finished request, and the leases end only milliseconds later.
        self._releases.append((what, self.mq_client.submit_later(request_type, payload)))
        self._check_releases()
        if len(self._releases) > MAX_WATCHED_RELEASES:  # the oldest is unanswered
            what, _ = self._releases.popleft()
            self.unwatched_releases += 1
            if self.unwatched_releases == 1 or self.unwatched_releases % 1000 == 0:
                logger.warning("%d releases sent to the daemon got no reply yet and are no longer "
                               "watched (the latest: %s); their leases end by the daemon's TTL",
                               self.unwatched_releases, what)

    def _check_releases(self) -> None:
        """Log the failures of the releases answered so far (never waits)."""
        releases = self._releases
        while releases and releases[0][1].done():
            what, future = releases.popleft()
            error = future.exception()
            if error is not None:
                logger.warning("%s failed: %s; the daemon releases its leases after their TTL", what, error)

    def shutdown(self) -> None:
        """Close the connection once the releases sent have been answered (up to
        SHUTDOWN_RELEASE_WAIT_S): closing drops requests still queued in the socket."""
        deadline = time.monotonic() + SHUTDOWN_RELEASE_WAIT_S
        for _, future in self._releases:
            future.wait(max(0.0, deadline - time.monotonic()))
        self._check_releases()
        self.mq_client.close()


def reset_models(client: MessageQueueClient, models: list[str], timeout_s: float) -> bool:
    """Have the daemon drop every chunk of `models` from its pool and every lower tier (RESET_MODEL):
    True once it confirmed that none can be served any more; False, with the reason logged, where
    it could not (unreachable, no reply in time, a tier that failed)."""
    what = f"lmcache-mp: resetting the KV of {', '.join(models)}"
    try:
        reset: ModelReset = client.submit(RequestType.RESET_MODEL, [ModelScope(models)],
                                          timeout_s=timeout_s).result()
    except LMCacheMPError as err:
        logger.error("%s failed: the daemon did not confirm it (%s); what it holds of the model may "
                     "still be served", what, err)
        return False
    tiers = "".join(f"; {t.name}: " + (f"NOT dropped: {t.error}" if t.error else f"{t.removed} dropped")
                    for t in reset.tiers)
    if not reset.ok:
        logger.error("%s failed: %d chunks dropped from the daemon's pool, %d tails forgotten%s",
                     what, reset.pool_chunks, reset.tails, tiers)
        return False
    logger.info("%s: %d chunks dropped from the daemon's pool, %d tails forgotten%s",
                what, reset.pool_chunks, reset.tails, tiers)
    return True
