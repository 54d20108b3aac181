"""The adapters of every KV cache group, asked as one.

`vllm_adapter.kv_groups` makes each group of a hybrid model a model of its own in the daemon.
These two classes hold one seed adapter per group and fan each call out: the scheduler's
lookup becomes one LOOKUP per group (the hit is the shortest), the worker's loads and stores one
RETRIEVE and STORE per group with that group's block ids, and a request counts as loaded, or
its stores as done, once every group's are. A request's ops travel as `RequestOps`. With one
group every call passes straight through, under the request's own id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import TailHit, TailNote
from vllm_adapter.kv_groups import KVGroup
from vllm_adapter.loads import SyncLoad
from vllm_adapter.ops import LoadStoreOp
from vllm_adapter.scheduler_adapter import LMCacheMPSchedulerAdapter
from vllm_adapter.worker_adapter import LMCacheMPWorkerAdapter

logger = logging.getLogger(__name__)

# A request's load or store: one op for a model with one KV cache group (as before groups
# existed), else one per group in group order (None: nothing for that group).
RequestOps = LoadStoreOp | tuple[LoadStoreOp | None, ...]
_A = TypeVar("_A", LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter)


def request_ops(ops: list[LoadStoreOp | None]) -> RequestOps:
    if len(ops) == 1 and ops[0] is not None:
        return ops[0]
    return tuple(ops)


def group_op(ops: RequestOps, group: KVGroup) -> LoadStoreOp | None:
    return ops if isinstance(ops, LoadStoreOp) else ops[group.index]


def all_ops(ops: RequestOps) -> list[LoadStoreOp]:
    return [ops] if isinstance(ops, LoadStoreOp) else [op for op in ops if op is not None]


def connect_groups(groups: Sequence[KVGroup], connect: Callable[[KVGroup], _A]) -> list[_A]:
    """One adapter per group, or none: a failure closes those already connected and is raised."""
    adapters: list[_A] = []
    try:
        for group in groups:
            adapters.append(connect(group))
    except BaseException:
        for adapter in adapters:
            adapter.shutdown()
        raise
    return adapters


class _Groups:
    def __init__(self, groups: Sequence[KVGroup]):
        self.groups = list(groups)

    def rid(self, group: KVGroup, request_id: str) -> str:
        return group.daemon_request_id(request_id, len(self.groups))

    def request_of(self, group: KVGroup, daemon_request_id: str) -> str:
        if len(self.groups) == 1:
            return daemon_request_id
        return daemon_request_id.removesuffix(f"#g{group.index}")


class SchedulerGroups(_Groups):
    """The scheduler adapters of every group."""

    def __init__(self, groups: Sequence[KVGroup], adapters: list[LMCacheMPSchedulerAdapter]):
        super().__init__(groups)
        self._adapters = adapters

    @property
    def mq_client(self) -> MessageQueueClient:
        return self._adapters[0].mq_client

    def num_blocks_per_chunk(self) -> int:
        return self._adapters[0].num_blocks_per_chunk()

    def _each(self) -> Iterable[tuple[KVGroup, LMCacheMPSchedulerAdapter]]:
        return zip(self.groups, self._adapters, strict=True)

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes],
                                    tails: bool = False) -> None:
        """`tails`: with one group only (`vllm_adapter.tails`)."""
        for group, adapter in self._each():
            adapter.maybe_submit_lookup_request(self.rid(group, request_id), block_hashes=block_hashes,
                                                tails=tails)

    def lookup_tails(self, request_id: str) -> list[TailHit]:
        ((group, adapter),) = self._each()
        return adapter.lookup_tails(self.rid(group, request_id))

    def note_tails(self, stored: list[TailNote], superseded: list[TailNote]) -> None:
        (adapter,) = self._adapters
        adapter.note_tails(stored, superseded)

    def check_lookup_result(self, request_id: str, wait_s: float = 0.0) -> int | None:
        """Tokens every group holds, or None while any group's lookup is pending (after waiting up
        to `wait_s` in all)."""
        deadline = time.monotonic() + wait_s
        hits = [adapter.check_lookup_result(self.rid(group, request_id),
                                            wait_s=max(0.0, deadline - time.monotonic()))
                for group, adapter in self._each()]
        return None if None in hits else min(hit for hit in hits if hit is not None)

    def cleanup_lookup_result(self, request_id: str) -> None:
        for group, adapter in self._each():
            adapter.cleanup_lookup_result(self.rid(group, request_id))

    def release_leases(self, request_id: str, block_hashes: list[bytes]) -> None:
        for group, adapter in self._each():
            adapter.release_leases(self.rid(group, request_id), block_hashes)

    def end_session(self, request_id: str) -> None:
        for group, adapter in self._each():
            adapter.end_session(self.rid(group, request_id))

    def shutdown(self) -> None:
        for adapter in self._adapters:
            adapter.shutdown()


class WorkerGroups(_Groups):
    """The worker adapters of every group: one registration each, with that group's layers."""

    def __init__(self, groups: Sequence[KVGroup], adapters: list[LMCacheMPWorkerAdapter]):
        super().__init__(groups)
        self._adapters = adapters
        # Requests some groups have reported (finished stores; done loads) -> those groups.
        self._sent_by: dict[str, set[int]] = {}
        self._received_by: dict[str, set[int]] = {}

    def _each(self) -> Iterable[tuple[KVGroup, LMCacheMPWorkerAdapter]]:
        return zip(self.groups, self._adapters, strict=True)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str) -> None:
        """Register each group's layers under its own name (a single group: every layer). A failure
        of one group is logged by its adapter (which retries it); the others register regardless."""
        for group, adapter in self._each():
            try:
                layers = kv_caches if len(self.groups) == 1 else {n: kv_caches[n] for n in group.layer_names}
                adapter.register_kv_caches(layers, layout)
            except (LMCacheMPError, OSError) as err:
                logger.debug("registering KV cache group %d with lmcache-mp failed: %s", group.index, err)

    def ensure_registered(self) -> bool:
        return all([adapter.ensure_registered() for adapter in self._adapters])

    def holds_stores(self) -> bool:
        return any(adapter.holds_stores() for adapter in self._adapters)

    def stores_done_through(self, request_id: str, latest_step: int) -> int:
        """The latest step through which every store of this request is done, in every group
        (`latest_step`: the last step that submitted one)."""
        pending = [step for group, adapter in self._each()
                   if (step := adapter.oldest_pending_store_step(self.rid(group, request_id))) is not None]
        return min(pending) - 1 if pending else latest_step

    def give_up_stores(self, why: str) -> None:
        for adapter in self._adapters:
            adapter.give_up_stores(why)

    def wait_for_stores(self, request_ids: Iterable[str], timeout_s: float) -> None:
        request_ids = list(request_ids)
        for group, adapter in self._each():
            adapter.wait_for_stores([self.rid(group, rid) for rid in request_ids], timeout_s)

    def _split(self, group: KVGroup, request_ids: list[str],
               ops: list[RequestOps]) -> tuple[list[str], list[LoadStoreOp]]:
        """This group's share of a batch: its ops and their daemon request ids."""
        pairs = [(self.rid(group, rid), group_op(op, group))
                 for rid, op in zip(request_ids, ops, strict=True)]
        return [rid for rid, op in pairs if op is not None], [op for _, op in pairs if op is not None]

    def batched_submit_store_requests(self, request_ids: list[str], ops: list[RequestOps],
                                      event: torch.cuda.Event | None, step: int) -> None:
        for group, adapter in self._each():
            rids, group_ops = self._split(group, request_ids, ops)
            if rids:
                adapter.batched_submit_store_requests(rids, group_ops, event, step)

    def batched_submit_retrieve_requests(self, request_ids: list[str], ops: list[RequestOps],
                                         event: torch.cuda.Event | None) -> None:
        """Loads: every group of each request has an op (a hit is every group's)."""
        for group, adapter in self._each():
            adapter.batched_submit_retrieve_requests(*self._split(group, request_ids, ops), event)

    def start_retrieve(self, request_ids: list[str], ops: list[RequestOps],
                       event: torch.cuda.Event | None) -> list[SyncLoad]:
        """A synchronous load, every group's sent at once; `finish_retrieve` waits for them."""
        return [adapter.start_retrieve(*self._split(group, request_ids, ops), event)
                for group, adapter in self._each()]

    def finish_retrieve(self, loads: list[SyncLoad], timeout_s: float) -> dict[str, list[int]]:
        """The requests that did not load in some group -> their block ids, in every group."""
        failed: dict[str, list[int]] = {}
        for (group, adapter), load in zip(self._each(), loads, strict=True):
            for rid, block_ids in adapter.finish_retrieve(load, timeout_s).items():
                failed.setdefault(self.request_of(group, rid), []).extend(block_ids)
        return failed

    def wait_for_retrieves(self, timeout_s: float) -> None:
        for adapter in self._adapters:
            adapter.wait_for_retrieves(timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished requests whose stores are done in every group, requests loaded in every group)."""
        sent: set[str] = set()
        received: set[str] = set()
        for group, adapter in self._each():
            group_sent, group_received = adapter.get_finished({self.rid(group, r) for r in finished_req_ids})
            sent |= self._complete(self._sent_by, group, group_sent)
            received |= self._complete(self._received_by, group, group_received)
        return sent, received

    def _complete(self, reported_by: dict[str, set[int]], group: KVGroup, daemon_ids: set[str]) -> set[str]:
        """Note that `group` reported these requests; return those every group has reported now."""
        complete = set()
        for daemon_id in daemon_ids:
            request_id = self.request_of(group, daemon_id)
            groups = reported_by.setdefault(request_id, set())
            groups.add(group.index)
            if len(groups) == len(self.groups):
                del reported_by[request_id]
                complete.add(request_id)
        return complete

    def take_failed_retrieves(self) -> dict[str, list[int]]:
        failed: dict[str, list[int]] = {}
        for group, adapter in self._each():
            for rid, block_ids in adapter.take_failed_retrieves().items():
                failed.setdefault(self.request_of(group, rid), []).extend(block_ids)
        return failed

    def shutdown(self) -> None:
        for adapter in self._adapters:
            adapter.shutdown()
