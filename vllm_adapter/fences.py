"""Fences: a worker's loads and stores that got no reply in time, held until the daemon confirms.

A RETRIEVE or STORE whose reply did not come within the worker's timeout may still run in the
daemon (queued behind other work, or copying while it was slow or stopped). Once vLLM has
handed its blocks to another request, a late RETRIEVE would overwrite that request's KV and a
late STORE would cache it under the first request's keys. So such an operation is *fenced*:
the worker sends CANCEL_TRANSFERS (batched per registration, each try bounded by the timeout,
re-sent until answered), and the fence is released (its blocks handed back to vLLM) only once
the daemon has answered it, or is gone: its end of the attach channel the registration lives
on has closed, which happens only at exit, after its last copy. A daemon that answers the
CANCEL with an error no retry changes (stopping, or too old to know CANCEL_TRANSFERS) is waited
out until it is gone.

Fail closed: blocks the daemon might still touch are never released on a timer. While a
daemon is alive but silent (e.g. SIGSTOPped), fenced requests hold their blocks (one ERROR
after `FENCE_ERROR_AFTER_S`) until it is killed or resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmcache_mp.errors import ServerError
from lmcache_mp.mq.client import MessageQueueClient, MessagingFuture
from lmcache_mp.protocol import PERMANENT_ERRORS, ErrorCode, RequestType
from lmcache_mp.transfer.attach_channel import AttachChannel

logger = logging.getLogger(__name__)

# A request fenced this long (the daemon neither confirms its CANCEL nor goes away) is logged as
# an ERROR.
FENCE_ERROR_AFTER_S = 60.0
# How often `wait` checks whether the daemon has gone (or a CANCEL is due again).
_POLL_S = 0.05
# CANCEL_TRANSFERS answers after which no confirmation will come from this daemon: it is stopping
# (it closes the attach channels once its last copy is done), or does not know the request.
_CANNOT_CANCEL = PERMANENT_ERRORS | {ErrorCode.SHUTTING_DOWN}


@dataclass(frozen=True)
class Target:
    """Where an operation was sent: the registration its blocks were named under."""

    instance_id: int
    channel: AttachChannel


@dataclass(eq=False)
class Fence:
    """One request's load or store, held: `release` runs once the daemon has confirmed."""

    request_id: str
    what: str  # "load" or "store", for the logs
    target: Target
    release: Callable[[], None]
    keepalive: object = None  # what the daemon may still use until it confirms (CUDA events)
    since: float = field(default_factory=time.monotonic)
    cancel: MessagingFuture[int] | None = None
    # The daemon answered the CANCEL with an error no retry changes: only its exit releases it.
    until_gone: bool = False
    overdue_logged: bool = False

    def resolved(self) -> bool:
        if not self.target.channel.is_open():
            return True  # the daemon has exited: nothing of it touches the blocks any more
        cancel = self.cancel
        if cancel is None or not cancel.query():
            return False
        error = cancel.exception()
        if isinstance(error, ServerError) and error.code in _CANNOT_CANCEL:
            self.until_gone = True
        return error is None

    def needs_cancel(self) -> bool:
        """Whether a CANCEL is due: none sent yet, or the last one failed (a timeout, an
        overloaded daemon) and its deadline passed: at most one try per timeout."""
        if self.until_gone:
            return False
        return self.cancel is None or (self.cancel.query() and self.cancel.exception() is not None
                                       and time.monotonic() >= self.cancel.deadline)


class Fences:
    """A worker's fences, and the attach channels of earlier registrations that some still watch
    (closed once none does: closing one makes the daemon drop that registration, not stop its
    copies)."""

    def __init__(self, client: MessageQueueClient, server_url: str, timeout_s: float):
        self._client = client
        self._server_url = server_url
        self._timeout_s = timeout_s
        self._fences: list[Fence] = []
        self._retired: list[AttachChannel] = []

    def hold(self, what: str, request_id: str, target: Target, release: Callable[[], None],
             keepalive: object = None) -> None:
        """Fence `what` ("load" or "store") of this request (one WARNING); `release` runs once the
        daemon behind `target` has confirmed."""
        logger.warning("lmcache-mp at %s did not answer a %s of request %s within %.1f s; it may still "
                       "touch its blocks: holding them until it confirms the %s is cancelled (or exits)",
                       self._server_url, what, request_id, self._timeout_s, what)
        self._fences.append(Fence(request_id, what, target, release, keepalive))

    def advance(self) -> None:
        """Release the fences the daemon has resolved; send CANCEL_TRANSFERS for the others that
        need one, one per registration."""
        now = time.monotonic()
        due: dict[Target, list[Fence]] = {}
        for fence in list(self._fences):
            if fence.resolved():
                self._fences.remove(fence)
                fence.release()
                continue
            if fence.needs_cancel():
                due.setdefault(fence.target, []).append(fence)
            if not fence.overdue_logged and now - fence.since > FENCE_ERROR_AFTER_S:
                fence.overdue_logged = True
                logger.error("the %s of request %s is still held after %.0f s: lmcache-mp at %s neither "
                             "confirms it is cancelled nor exits; its blocks stay unused until it does "
                             "(restart or kill the daemon)", fence.what, fence.request_id,
                             now - fence.since, self._server_url)
        for target, fences in due.items():
            request_ids = sorted({fence.request_id for fence in fences})
            cancel = self._client.submit(RequestType.CANCEL_TRANSFERS, [target.instance_id, request_ids],
                                         timeout_s=self._timeout_s)
            for fence in fences:
                fence.cancel = cancel
        self._close_retired()

    def wait(self, request_ids: set[str]) -> None:
        """Block until the fences of these requests are released."""
        while True:
            self.advance()
            waiting = [f for f in self._fences if f.request_id in request_ids]
            if not waiting:
                return
            # Wake up for the first CANCEL answered, or at the poll interval (the channel, a re-send).
            cancel = next((f.cancel for f in waiting if f.cancel is not None and not f.cancel.query()), None)
            if cancel is not None:
                cancel.wait(_POLL_S)
            else:
                time.sleep(_POLL_S)

    def retire(self, channel: AttachChannel) -> None:
        """A registration was replaced: close its channel once no fence watches it."""
        self._retired.append(channel)
        self._close_retired()

    def close(self) -> None:
        for channel in self._retired:
            channel.close()
        self._retired = []

    def _close_retired(self) -> None:
        watched = {id(fence.target.channel) for fence in self._fences}
        for channel in [c for c in self._retired if id(c) not in watched]:
            self._retired.remove(channel)
            channel.close()
