#!/usr/bin/env python
"""Self-test of the lmcache door's data path on a GPU (or on CPU): LMCache's connector's requests,
framed as its wire carries them, against the real daemon; every byte compared.

    .venv/bin/python scripts/gpu/selftest_door.py [--device cuda|cpu] [--quick] [--out FILE]

The daemon is started with `--lmcache-listen` on a Unix socket. Caches are allocated as vLLM 0.32
allocates them (`lmcache_mp/testing/vllm_caches.py`) and registered as lmcache 0.5.6's worker sends
them: each layer's view reordered by stride where that makes it contiguous (LMCache's worker does
so before wrapping), `kv_layout` NHD for vLLM's LBNHC and HND for LBHNC, and per layer on CUDA a
`cuda` descriptor (torch's `_share_cuda_` tuple of the buffer, the device's UUID), on CPU a `cpu_shm`
descriptor of a /dev/shm segment the buffer lives in. Requests go out on a DEALER as LMCache's client
frames them: `[uid, op, one msgpack frame per argument]` (`lmcache_mp/lmcache_door/wire.py`). Nothing
of lmcache is needed: a lent GPU machine has no registry.

Per case: register; STORE a request's chunks from scattered blocks, written behind a long kernel on
CUDA with an interprocess event recorded after (only a daemon that waits on the event stores the
bytes written); lookup and wait_prefetch_status (every chunk found); fill the destination blocks
behind a long kernel and RETRIEVE into them with an event; compare every byte; unregister. Prints
a line per case and exits 1 if any check failed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))

from selftest_device import Device, device_of, finish, parser  # noqa: E402

from lmcache_mp.lmcache_door import wire  # noqa: E402
from lmcache_mp.testing.launcher import start_daemon  # noqa: E402
from lmcache_mp.testing.vllm_caches import allocate_like_vllm  # noqa: E402

MODEL = "selftest/door"
BLOCK = 16
TIMEOUT_S = 120.0
KV_LAYOUT = {"LBNHC": "NHD", "LBHNC": "HND"}  # vLLM's KVCacheLayout -> what LMCache's worker sends
_OP_IDS = {name: op_id for op_id, name in wire.LEGACY_OPERATIONS.items()}


@dataclass(frozen=True)
class Case:
    name: str
    physical: str  # vLLM's KVCacheLayout
    layers: int
    heads: int
    head_size: int
    mla: bool = False


def cases(quick: bool) -> list[Case]:
    layers, heads, head, latent = (4, 2, 64, 96) if quick else (32, 8, 128, 576)
    return [Case("FLASH_ATTN/LBNHC", "LBNHC", layers, heads, head),
            Case("FLASH_ATTN/LBHNC", "LBHNC", layers, heads, head),
            Case("MLA/LBNHC", "LBNHC", layers, 1, latent, mla=True)]


class DoorClient:
    """LMCache's request framing on a DEALER of its own: one request at a time, each answered."""

    def __init__(self, url: str):
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        self._uid = 0

    def call(self, op: str, *args: Any) -> Any:
        self._uid += 1
        op_frame = msgspec.msgpack.encode(_OP_IDS.get(op, op))
        self._sock.send_multipart([msgspec.msgpack.encode(self._uid), op_frame,
                                   *[msgspec.msgpack.encode(a) for a in args]])
        if not self._sock.poll(int(TIMEOUT_S * 1000)):
            raise TimeoutError(f"no reply to {op} within {TIMEOUT_S:.0f} s")
        frames = self._sock.recv_multipart()
        if frames[1] != op_frame:  # the door's refusal of an operation that answers None
            raise RuntimeError(msgspec.msgpack.decode(frames[1]))
        return msgspec.msgpack.decode(frames[2]) if len(frames) > 2 else None

    def close(self) -> None:
        self._sock.close()
        self._context.term()


def _sent_view(view: torch.Tensor) -> torch.Tensor:
    """The layer as LMCache's worker sends it: dimensions ordered by stride, outermost first, where
    that makes the view contiguous (a dimension of one goes innermost among equal strides)."""
    order = sorted(range(view.dim()), key=lambda d: (-view.stride(d), view.size(d) == 1))
    permuted = view.permute(order)
    return permuted if permuted.is_contiguous() else view


def _metadata(view: torch.Tensor, device_uuid: str) -> wire.TensorMetadata:
    dtype = str(view.dtype).removeprefix("torch.")
    return wire.TensorMetadata(dtype, tuple(view.shape), tuple(view.stride()), view.storage_offset(),
                               device_uuid)


class Caches:
    """A case's caches in vLLM's allocation, and their descriptors as LMCache's worker makes them."""

    def __init__(self, case: Case, device: Device, num_blocks: int, tmp: Path):
        _, layers = allocate_like_vllm(case.layers, num_blocks, case.heads, BLOCK, case.head_size,
                                       torch.bfloat16, case.physical, mla=case.mla,
                                       device=device.torch_device)
        self.segment: Path | None = None
        if device.name == "cpu":  # the same views, over a segment in /dev/shm as LMCache's CPU worker makes
            layers = self._in_segment(layers, tmp)
        self.layers = list(layers.values())
        self.descriptors = [msgspec.msgpack.Ext(wire.DESCRIPTOR_EXT_CODE, msgspec.msgpack.encode(d))
                            for d in self._descriptors(device)]

    def _in_segment(self, layers: dict[str, torch.Tensor], tmp: Path) -> dict[str, torch.Tensor]:
        first = next(iter(layers.values()))
        nbytes = first.untyped_storage().nbytes()
        self.segment = Path("/dev/shm") / f"lmc_selftest_door_{os.getpid()}_{tmp.name}"
        self.segment.write_bytes(b"")
        os.truncate(self.segment, nbytes)
        base = torch.from_file(str(self.segment), shared=True, size=nbytes // first.element_size(),
                               dtype=first.dtype)
        return {name: base.as_strided(v.shape, v.stride(), v.storage_offset()) for name, v in layers.items()}

    def _descriptors(self, device: Device) -> list[wire.CudaDescriptor | wire.CpuShmDescriptor]:
        out: list[wire.CudaDescriptor | wire.CpuShmDescriptor] = []
        for layer in self.layers:
            sent = _sent_view(layer)
            storage = sent.untyped_storage()
            if self.segment is not None:
                out.append(wire.CpuShmDescriptor(version=1, metadata=_metadata(sent, "cpu"),
                                                 shm_name="/" + self.segment.name, nbytes=storage.nbytes()))
            else:
                uuid = str(torch.cuda.get_device_properties(sent.device).uuid)
                out.append(wire.CudaDescriptor(version=1, metadata=_metadata(sent, uuid),
                                               handle=tuple(storage._share_cuda_())))  # type: ignore[arg-type]
        return out

    def pages(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, device=self.layers[0].device)
        return torch.stack([layer.index_select(0, index) for layer in self.layers])

    def write(self, ids: list[int], pages: torch.Tensor) -> None:
        index = torch.tensor(ids, device=self.layers[0].device)
        for layer, page in zip(self.layers, pages, strict=True):
            layer.index_copy_(0, index, page)

    def close(self) -> None:
        self.layers = []
        if self.segment is not None:
            self.segment.unlink(missing_ok=True)


def _key(tokens: list[int], end: int, worker: int | None) -> wire.Key:
    return wire.Key(MODEL, 1, worker, 0, end, "selftest-door", token_ids=tokens[:end], num_kv_readers=1)


@dataclass
class Ordered:
    """The work of a block run behind a long kernel (CUDA), and the event recorded after it."""

    event: torch.cuda.Event | None = None

    @property
    def handle(self) -> bytes:
        return self.event.ipc_handle() if self.event is not None else b""


@contextmanager
def _ordered(device: Device) -> Iterator[Ordered]:
    ordered = Ordered()
    with device.behind_long_kernel():
        yield ordered
        ordered.event = device.record_event()


def run_case(client: DoorClient, case: Case, device: Device, chunk_size: int, chunks: int, tmp: Path,
             instance_id: int) -> dict[str, Any]:
    blocks_per_chunk = chunk_size // BLOCK
    count = chunks * blocks_per_chunk
    src = list(range(1, 2 * count, 2))  # scattered: every other block
    dst = list(range(2 * count + 1, 2 * count + 1 + count))[::-1]  # elsewhere, reversed
    caches = Caches(case, device, 3 * count + 2, tmp)
    failures: list[str] = []
    pending: dict[str, bool] = {}  # whether the worker's writes were still running when it asked
    try:
        hints = wire.LayoutHints(kv_layout=KV_LAYOUT[case.physical])
        client.call("register_kv_cache", instance_id, caches.descriptors, MODEL, 1, "vllm", hints,
                    [wire.EngineGroupInfo(0, (), BLOCK)])
        tokens = [(instance_id * 7919 + i) % 50_000 for i in range(chunks * chunk_size)]
        pages = torch.empty_like(caches.pages(src))
        pages.view(torch.uint8).random_(0, 256)
        with _ordered(device) as written:
            caches.write(src, pages)
        pending["store"] = device.pending(written.event)  # the daemon must wait for the event
        stored = client.call("store", _key(tokens, len(tokens), 0), instance_id, [src], written.handle)
        if stored != [b"", True]:
            failures.append(f"store answered {stored}")
        client.call("lookup", _key(tokens, len(tokens), None), 1)
        found = _prefetch_count(client)
        if found != chunks:
            failures.append(f"lookup found {found} of {chunks} chunks")
        with _ordered(device) as cleared:
            for layer in caches.layers:
                layer.view(torch.uint8)[torch.tensor(dst, device=layer.device)] = 0xA5
        pending["retrieve"] = device.pending(cleared.event)
        loaded = client.call("retrieve", _key(tokens, len(tokens), 0), instance_id, [dst], cleared.handle, 0)
        if loaded != [b"", True]:
            failures.append(f"retrieve answered {loaded}")
        device.synchronize()
        exact = torch.equal(caches.pages(dst).view(torch.uint8), pages.view(torch.uint8))
        if not exact:
            failures.append("the retrieved bytes differ from those stored")
        client.call("free_lookup_locks", _key(tokens, len(tokens), None), 1)
        client.call("end_session", "selftest-door")
        client.call("unregister_kv_cache", instance_id)
    finally:
        caches.close()
    return {"case": case.name, "chunks": chunks, "bytes": pages.nbytes, "bit_exact": not failures,
            "store_pending": pending.get("store"), "retrieve_pending": pending.get("retrieve"),
            "failures": failures}


def _prefetch_count(client: DoorClient) -> int | None:
    """The lookup's count once the daemon has it (None while a lower tier is read)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = client.call("wait_prefetch_status", "selftest-door", 1.0)
        if found is not None:
            return int(found)
    return None


def run_cases(url: str, device: Device, chunk_size: int, chunks: int, quick: bool, tmp: Path
              ) -> tuple[list[dict[str, Any]], str]:
    """Every case against a daemon of its own: the results, and the daemon's log."""
    daemon = start_daemon(tmp, "--lmcache-listen", url, "--chunk-size", str(chunk_size), "--pool-file", "",
                          "--l1-size-gb", "1" if quick else "8", ready_timeout=300, env=device.daemon_env())
    client = DoorClient(url)
    results = []
    try:
        for i, case in enumerate(cases(quick)):
            results.append(run_case(client, case, device, chunk_size, chunks, tmp, 100 + i))
            print(f"  {case.name}: {'; '.join(results[-1]['failures']) or 'ok, bit-exact'}", flush=True)
    finally:
        client.close()
        daemon.stop(timeout=30)
    return results, daemon.log()


def main() -> int:
    p = parser(__doc__)
    args = p.parse_args()
    device = device_of(args, p)
    chunk_size, chunks = (64, 2) if args.quick else (256, 8)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-door-", dir="/tmp"))  # short: Unix socket paths are limited
    url = f"ipc://{tmp / 'lmcache.sock'}"
    try:
        results, log = run_cases(url, device, chunk_size, chunks, args.quick, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    failures = [f"{r['case']}: {f}" for r in results for f in r["failures"]]
    if "Traceback" in log:
        failures.append(f"the daemon logged a traceback:\n{log[-4000:]}")
    figures = {"device": device.description(), "cases": results, "ok": not failures}
    return finish(args.out, figures, failures, "every retrieved byte equals the byte stored")


if __name__ == "__main__":
    raise SystemExit(main())
