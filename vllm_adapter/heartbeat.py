"""Whether the daemon answers, as the scheduler sees it: one PING per interval."""

from __future__ import annotations

import logging
import time

from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import RequestType

logger = logging.getLogger(__name__)


class Heartbeat:
    """Whether the daemon answers: one PING per interval, each allowed one interval. While
    the daemon is away, lookups count as misses at once instead of keeping requests waiting
    for their timeout, and no stores are planned."""

    def __init__(self, client: MessageQueueClient, interval_s: float):
        self._client = client
        self._interval_s = interval_s
        self._alive = True
        self._ping = self._send()

    def _send(self) -> MessagingFuture[int]:
        self._next_at = time.monotonic() + self._interval_s
        return self._client.submit(RequestType.PING, [0], timeout_s=self._interval_s)

    def alive(self) -> bool:
        if self._ping.query():
            alive = self._ping.exception() is None
            if alive != self._alive:
                if alive:
                    logger.info("lmcache-mp daemon is back")
                else:
                    logger.warning("lmcache-mp daemon does not answer: serving without it until it does")
                self._alive = alive
            if time.monotonic() >= self._next_at:
                self._ping = self._send()
        return self._alive
