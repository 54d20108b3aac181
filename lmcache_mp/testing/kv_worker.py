"""A stand-in vLLM worker process for the data-path tests and the soak: real caches, the real
adapter.

    python -m lmcache_mp.testing.kv_worker SPEC_JSON

SPEC: url, layout, shape, dtype, num_layers, world_size, rank, action ("store" | "retrieve"
| "hold" | "store_and_hold" | "serve"), block_ids, block_hashes (hex) or token_ids+start+end,
request_id, seed, out. `store` fills the caches from `seed` and stores; `retrieve` fills them
with zeros, looks up (leasing the hits), retrieves and saves the pages of `block_ids` to `out`;
`hold` registers, prints "READY <instance id>" and sleeps until killed; `store_and_hold` stores
as `store` does, then holds (a rank that stays registered with its chunks stored); `serve`
registers caches filled from `seed` (zeros without one), prints "READY <instance id>", then
runs one command per line of stdin (a JSON object: "op" "store" or "retrieve", request_id,
block_ids, block_hashes or token_ids+start+end, and for a retrieve `out`) and answers each with
one JSON line on stdout: {"failed": [...]} (a retrieve that did not load; its pages saved to
`out` either way). It unregisters and exits at the end of stdin: one rank of a long-lived engine.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from lmcache_mp.transfer.dtypes import str_to_dtype
from vllm_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter, LoadStoreOp


def make_caches(shape: list[int], dtype: torch.dtype, num_layers: int,
                seed: int | None) -> dict[str, torch.Tensor]:
    """Like vLLM on CPU: every layer is a view of one allocation."""
    buffer = torch.zeros(num_layers, *shape, dtype=dtype)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(dtype))
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(num_layers)}


def block_dim(layout: str, shape: list[int]) -> int:
    return 1 if len(shape) == 5 and shape[0] == 2 and layout in ("FLASH_ATTN", "") else 0


def pages(caches: dict[str, torch.Tensor], layout: str, shape: list[int], ids: list[int]) -> torch.Tensor:
    d = block_dim(layout, shape)
    return torch.stack([t.movedim(d, 0)[ids].clone() for t in caches.values()])


def op_of(spec: dict) -> LoadStoreOp:
    if spec.get("token_ids") is not None:
        return LoadStoreOp(spec["block_ids"], token_ids=spec["token_ids"], start=spec.get("start", 0),
                           end=spec.get("end", len(spec["token_ids"])))
    return LoadStoreOp(spec["block_ids"], block_hashes=[bytes.fromhex(h) for h in spec["block_hashes"]])


def wait_done(worker: LMCacheMPWorkerAdapter, request_id: str, retrieve: bool, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stores, retrieves = worker.get_finished({request_id})
        if request_id in (retrieves if retrieve else stores):
            return
        time.sleep(0.005)
    raise TimeoutError(f"{request_id} did not finish")


def serve(worker: LMCacheMPWorkerAdapter, caches: dict[str, torch.Tensor], spec: dict) -> None:
    print("READY", worker.instance_id, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        request_id, op = command["request_id"], op_of(command)
        retrieve = command["op"] == "retrieve"
        if retrieve:
            worker.submit_retrieve_request(request_id, op, None)
        else:
            worker.submit_store_request(request_id, op, None)
        wait_done(worker, request_id, retrieve)
        failed = sorted(worker.take_failed_retrieves())
        if retrieve:
            torch.save(pages(caches, spec["layout"], spec["shape"], command["block_ids"]), command["out"])
        print(json.dumps({"failed": failed}), flush=True)


def main() -> int:
    spec = json.loads(sys.argv[1])
    dtype = str_to_dtype(spec["dtype"])
    stores = spec["action"] in ("store", "store_and_hold")
    seeded = stores or spec["action"] == "serve"
    caches = make_caches(spec["shape"], dtype, spec["num_layers"], spec.get("seed") if seeded else None)
    args = (spec["url"], None, spec.get("model", "test-model"), spec.get("world_size", 1),
            spec.get("rank", 0), spec["block_size"])
    worker = LMCacheMPWorkerAdapter(*args)
    worker.register_kv_caches(caches, spec["layout"] or None)
    if spec["action"] == "serve":
        serve(worker, caches, spec)
        worker.shutdown()
        return 0
    request_id = spec.get("request_id", "req")
    op = op_of(spec)
    if stores:
        worker.submit_store_request(request_id, op, None)
        wait_done(worker, request_id, retrieve=False)
    if spec["action"] in ("hold", "store_and_hold"):
        print("READY", worker.instance_id, flush=True)
        time.sleep(3600)
    elif not stores:
        scheduler = LMCacheMPSchedulerAdapter(*args)
        if op.token_ids is not None:
            scheduler.maybe_submit_lookup_request(request_id, token_ids=op.token_ids)
        else:
            scheduler.maybe_submit_lookup_request(request_id, block_hashes=op.block_hashes)
        while (hit := scheduler.check_lookup_result(request_id)) is None:
            time.sleep(0.001)
        worker.submit_retrieve_request(request_id, op, None)
        wait_done(worker, request_id, retrieve=True)
        failed = worker.take_failed_retrieves()
        torch.save({"hit": hit, "failed": sorted(failed),
                    "pages": pages(caches, spec["layout"], spec["shape"], spec["block_ids"])}, spec["out"])
        scheduler.shutdown()
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
