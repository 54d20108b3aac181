"""The self-tests' device: every CUDA-specific line of `selftest.py` lives in `CudaDevice`.

`CpuDevice` runs the same rounds on the CPU (synchronous writes, no streams, no events), so the
CPU test suite exercises everything else. Also the same-run copy baselines and pinning timings.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lmcache_mp.config import available_memory_bytes

# The pin test leaves this much of the host's available memory untouched.
PIN_HEADROOM_BYTES = 4 << 30


class CpuDevice:
    """Synchronous writes, no streams and no events: the reply of a request means it is done."""

    name = "cpu"
    torch_device = torch.device("cpu")
    ordering_checked = False  # nothing runs behind the worker's back to order against

    def description(self) -> str:
        return f"CPU, torch {torch.__version__}"

    def daemon_env(self) -> dict[str, str]:
        return {}

    def behind_long_kernel(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record_event(self) -> torch.cuda.Event | None:
        return None

    def pending(self, event: torch.cuda.Event | None) -> bool:
        return False

    def synchronize(self) -> None:
        pass

    def copy_baseline(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """GB/s of `copy_` between two tensors of `nbytes`, each way: what the shared-memory path
        does at best, one contiguous memcpy."""
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        return _copy_gbps(b, a, self, repeats), _copy_gbps(a, b, self, repeats)

    def pin_seconds(self, nbytes: int) -> float:
        raise RuntimeError("pinning host memory needs CUDA")

    def release_cached_memory(self) -> None:
        pass


class CudaDevice:
    name = "cuda"
    ordering_checked = True

    def __init__(self, delay_cycles: int):
        self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self._side = torch.cuda.Stream(self.torch_device)
        self._delay_cycles = delay_cycles

    def description(self) -> str:
        props = torch.cuda.get_device_properties(self.torch_device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"

    def daemon_env(self) -> dict[str, str]:
        """The daemon sees only this GPU, named by UUID: its ordinals differ from the worker's
        whenever the worker's device is not 0, and the handles' UUID remap is what finds it."""
        return {"CUDA_VISIBLE_DEVICES": f"GPU-{torch.cuda.get_device_properties(self.torch_device).uuid}"}

    @contextlib.contextmanager
    def behind_long_kernel(self) -> Iterator[None]:
        """Run the block's work on the side stream behind a kernel that spins `delay_cycles`
        (after what the current stream queued so far, e.g. the pages to write)."""
        self._side.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self._side):
            torch.cuda._sleep(self._delay_cycles)
            yield

    def record_event(self) -> torch.cuda.Event:
        """An interprocess event after everything queued on the side stream: what the daemon waits on."""
        event = torch.cuda.Event(interprocess=True)
        event.record(self._side)
        return event

    def pending(self, event: torch.cuda.Event | None) -> bool:
        """Whether the work before `event` is still running."""
        return event is not None and not event.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def copy_baseline(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """GB/s of `copy_` device -> pinned host (what a STORE moves) and back (a RETRIEVE)."""
        device = torch.ones(nbytes, dtype=torch.uint8, device=self.torch_device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return _copy_gbps(host, device, self, repeats), _copy_gbps(device, host, self, repeats)

    def pin_seconds(self, nbytes: int) -> float:
        """Seconds `cudaHostRegister` takes to pin a fresh anonymous mmap of `nbytes` (untouched:
        pinning faults every page in), as the daemon pins its pool in pieces."""
        cudart = torch.cuda.cudart()
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(area)
        address = ctypes.addressof(anchor)
        try:
            start = time.perf_counter()
            error = cudart.cudaHostRegister(address, nbytes, 0)
            elapsed = time.perf_counter() - start
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {error}")
            cudart.cudaHostUnregister(address)
            return elapsed
        finally:
            del anchor  # the mmap cannot close while a ctypes object holds its buffer
            area.close()


Device = CpuDevice | CudaDevice


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, device: Device, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    device.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        device.synchronize()
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


def pin_timings(device: Device, sizes_gib: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for gib in sizes_gib:
        nbytes = gib << 30
        if device.name != "cuda":
            rows.append({"gib": gib, "skipped": "needs CUDA"})
        elif nbytes + PIN_HEADROOM_BYTES > (available := available_memory_bytes() or 0):
            rows.append({"gib": gib, "skipped": f"the host has {available / 2**30:.0f} GiB "
                                                f"available, {gib + PIN_HEADROOM_BYTES // 2**30} needed"})
        else:
            seconds = device.pin_seconds(nbytes)
            rows.append({"gib": gib, "seconds": seconds, "gbps": nbytes / seconds / 1e9})
    return rows


def finish(out: Path | None, figures: dict[str, Any], failures: list[str], ok_text: str) -> int:
    """A self-test's end: its figures as JSON to `out` (where given), each failure printed, and
    its exit code (1 if anything failed)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2))
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"{len(failures)} failure(s)" if failures else f"OK: {ok_text}")
    return 1 if failures else 0


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every self-test takes: the device, a quick run, where its JSON goes, the long
    kernel's length."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny caches (a smoke run, seconds)")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    p.add_argument("--delay-cycles", type=int, default=1_000_000_000,
                   help="GPU cycles the long kernel spins before an ordered write")
    return p


def device_of(args: argparse.Namespace, p: argparse.ArgumentParser) -> Device:
    """The device `--device` names (an error exit if it is CUDA and torch sees none)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    return CudaDevice(args.delay_cycles) if args.device == "cuda" else CpuDevice()
