"""The worker's loads (RETRIEVEs), from submission until each request's outcome is known.

Every load is tracked per request id, also inside a batch (one RETRIEVE for several requests
counts for each), so that no request id is lost. A request is done when all of its RETRIEVEs
are; it failed if any failed or was refused (reported, never passed off as loaded: vLLM then
recomputes instead of attending over garbage), and it is *unanswered* if any got no reply in
time: the daemon may still write into its blocks, so the worker fences it (`fences.py`) before
vLLM gets them back. `LoadTracker` holds the books; the worker adapter decides what to report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lmcache_mp.errors import RequestTimeoutError
from lmcache_mp.mq.client import MessagingFuture
from lmcache_mp.protocol import RetrieveResult
from vllm_adapter.fences import Target
from vllm_adapter.ops import LoadStoreOp, kept_blocks


@dataclass(frozen=True)
class LoadOutcome:
    failure: str | None  # None: all of the request's operations succeeded
    unanswered: bool  # some operation got no reply before its deadline (the daemon may still run it)


@dataclass
class SentLoad:
    """Where a request's operations went, and the CUDA events they carry: the daemon opens an
    event's IPC handle when it runs the operation, so the event lives until the daemon is done
    with it (replied, or confirmed the cancel of an operation that got no reply)."""

    target: Target
    events: list[torch.cuda.Event] = field(default_factory=list)


class LoadTracker:
    """Outstanding operations per request id. A batched operation counts for each of its
    requests; a request is done when all of its operations are."""

    def __init__(self) -> None:
        self._pending: dict[str, list[MessagingFuture]] = {}
        self._blocks: dict[str, list[int]] = {}
        self._sent: dict[str, SentLoad] = {}

    def add(self, request_ids: list[str], ops: list[LoadStoreOp], future: MessagingFuture,
            target: Target | None = None, event: torch.cuda.Event | None = None) -> None:
        for request_id, op in zip(request_ids, ops, strict=True):
            self._pending.setdefault(request_id, []).append(future)
            self._blocks.setdefault(request_id, []).extend(kept_blocks(op))
            if target is not None:
                sent = self._sent.setdefault(request_id, SentLoad(target))
                sent.target = target
                if event is not None:
                    sent.events.append(event)

    def wait(self, request_ids: Iterable[str] | None, timeout_s: float) -> None:
        """Block until the given requests' operations (None: all) are done, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        for request_id in list(self._pending) if request_ids is None else request_ids:
            for future in self._pending.get(request_id, ()):
                future.wait(max(0.0, deadline - time.monotonic()))

    def poll(self) -> dict[str, LoadOutcome]:
        """Requests whose operations are all done -> how they went."""
        done: dict[str, LoadOutcome] = {}
        for request_id, futures in list(self._pending.items()):
            if not all(f.query() for f in futures):
                continue
            del self._pending[request_id]
            failure = next(filter(None, map(_failure, futures)), None)
            done[request_id] = LoadOutcome(failure, any(isinstance(f.exception(), RequestTimeoutError)
                                                        for f in futures))
        return done

    def take_blocks(self, request_id: str) -> list[int]:
        return self._blocks.pop(request_id, [])

    def take_sent(self, request_id: str) -> SentLoad | None:
        return self._sent.pop(request_id, None)


@dataclass
class SyncLoad:
    """A synchronous load on its way (`LMCacheMPWorkerAdapter.start_retrieve`)."""

    request_ids: list[str]
    tracker: LoadTracker


def _failure(future: MessagingFuture) -> str | None:
    error = future.exception()
    if error is not None:
        return str(error)
    result = future.result()
    if isinstance(result, RetrieveResult) and not result.ok:
        return result.reason or "retrieve refused"
    return None
