#!/usr/bin/env python
"""S3 clients for the S3 tier, compared: boto3 (botocore) and obstore (Rust's object_store),
the same objects on the same SeaweedFS server in the same run.

    .venv/bin/python scripts/bench/s3_clients.py [--out bench-out] [--quick]

Which client the tier should use is a question of throughput and CPU: this measures both. obstore
is no dependency of the project: install it into the venv
for this measurement (`.venv/bin/pip install obstore`); without it the script says so and exits 2.

Objects of 512 KiB, 2 MiB and 8 MiB of random bytes, in batches of 16 sent at once (the tier's
max_in_flight): PUTs of the batch (single requests: boto3's put_object, obstore's put with
use_multipart=False; the bytes prepared outside the timing, each client writing its own 16 names,
overwritten every round), then GETs of it, each object's bytes copied into a preallocated, touched
torch tensor (a pool slot: the tier copies every read into one). The clients:

  boto3           the tier's own botocore client, as its URL configures it (one attempt, no
                  optional checksums), its calls on 16 threads (the tier's own way);
  boto3 defaults  botocore's defaults (the tests' `S3Server.client`, as part c's raw baseline):
                  a CRC32 of every PUT's body, checked again on every GET that returns one;
  obstore         one S3Store, its blocking calls on the same 16 threads: what the tier would do
                  with obstore in boto3's place;
  obstore async   the same store, its coroutines gathered on one asyncio loop (obstore's own
                  runtime does the I/O, no Python thread per request).

Per size, the clients take turns within each round (PUTs, then GETs; who goes first rotating),
after one untimed warm-up round, after which every client's GETs are checked byte for byte.
Figures: GB/s of payload, the median of the rounds; and this process's CPU seconds per GB moved
(the client's CPU, all its threads: on a 2-core machine the server runs on the same cores, so a
client's CPU is the server's loss). Rounds: at least 9 (--quick 3), and enough that each client
moves 512 MiB (--quick 32 MiB) each way. Prints a table, writes s3_clients.json and s3_clients.png
to --out. About 3 minutes on 2 cores (SeaweedFS takes ~0.05-0.1 GB/s of PUTs there).
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import figure, finish, parse, parser
from harness.tier_timing import (
    DIRECTIONS,
    TIMEOUT_S,
    KiB,
    MiB,
    check_exact,
    label,
    make_chunks,
    make_outs,
    rounds_for,
)
from harness.tier_timing import alternate as alternate_rounds
from remote_stores import S3_IN_FLIGHT, environment

from lmcache_mp.storage.chunk_format import as_buffer
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.s3 import S3Tier
from lmcache_mp.testing.servers import S3_ACCESS_KEY, S3_SECRET_KEY, S3Server, s3_server

SIZES = [512 * KiB, 2 * MiB, 8 * MiB]
BATCH = S3_IN_FLIGHT  # 16
CLIENTS = ("boto3", "boto3 defaults", "obstore", "obstore async")
NAMES = {"SET": "PUT", "GET": "GET"}

Put = Callable[[list[str], list[bytes]], None]
Get = Callable[[list[str], list[torch.Tensor]], None]


def copy_into(out: torch.Tensor, data: Any) -> None:
    """A GET's bytes (bytes, or obstore's Bytes: any buffer) into its slot."""
    view = np.frombuffer(data, dtype=np.uint8)
    assert view.size == out.numel(), f"a GET returned {view.size} bytes, expected {out.numel()}"
    out.numpy()[:] = view


# ---- the clients, each a (put, get) of a whole batch ---------------------------------------------

def boto3_calls(client: Any, bucket: str, pool: ThreadPoolExecutor) -> tuple[Put, Get]:
    def put(names: list[str], values: list[bytes]) -> None:
        list(pool.map(lambda nv: client.put_object(Bucket=bucket, Key=nv[0], Body=nv[1]),
                      zip(names, values, strict=True)))

    def get(names: list[str], outs: list[torch.Tensor]) -> None:
        def one(name: str, out: torch.Tensor) -> None:
            body = client.get_object(Bucket=bucket, Key=name)["Body"]
            try:
                copy_into(out, body.read())
            finally:
                body.close()

        list(pool.map(one, names, outs))

    return put, get


def obstore_calls(store: Any, pool: ThreadPoolExecutor) -> tuple[Put, Get]:
    import obstore

    def put(names: list[str], values: list[bytes]) -> None:
        list(pool.map(lambda nv: obstore.put(store, nv[0], nv[1], use_multipart=False),
                      zip(names, values, strict=True)))

    def get(names: list[str], outs: list[torch.Tensor]) -> None:
        list(pool.map(lambda name, out: copy_into(out, obstore.get(store, name).bytes()), names, outs))

    return put, get


def obstore_async_calls(store: Any, loop: asyncio.AbstractEventLoop) -> tuple[Put, Get]:
    import obstore

    async def put_all(names: list[str], values: list[bytes]) -> None:
        # obstore's coroutines are made on the running loop: inside one.
        await asyncio.gather(*(obstore.put_async(store, n, v, use_multipart=False)
                               for n, v in zip(names, values, strict=True)))

    async def get_one(name: str, out: torch.Tensor) -> None:
        result = await obstore.get_async(store, name)
        copy_into(out, await result.bytes_async())

    async def get_all(names: list[str], outs: list[torch.Tensor]) -> None:
        await asyncio.gather(*(get_one(n, o) for n, o in zip(names, outs, strict=True)))

    def put(names: list[str], values: list[bytes]) -> None:
        loop.run_until_complete(put_all(names, values))

    def get(names: list[str], outs: list[torch.Tensor]) -> None:
        loop.run_until_complete(get_all(names, outs))

    return put, get


@contextmanager
def clients(server: S3Server) -> Iterator[dict[str, tuple[Put, Get]]]:
    """Every client of CLIENTS on `server`, closed at the end."""
    from obstore.store import S3Store

    with ExitStack() as stack, environment(server.env()):
        tier = open_tier(server.url("s3-clients", timeout_s=str(TIMEOUT_S)))
        stack.callback(tier.close)
        assert isinstance(tier, S3Tier), f"open_tier gave {type(tier).__name__}"
        defaults = server.client(timeout_s=TIMEOUT_S, connections=BATCH + 2)
        stack.callback(defaults.close)
        pool = stack.enter_context(ThreadPoolExecutor(BATCH, thread_name_prefix="s3-clients"))
        store = S3Store(server.bucket, endpoint=server.endpoint, region="us-east-1",
                        access_key_id=S3_ACCESS_KEY, secret_access_key=S3_SECRET_KEY,
                        virtual_hosted_style_request=False,
                        client_options={"allow_http": True, "timeout": f"{TIMEOUT_S}s"})
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        yield {"boto3": boto3_calls(tier._client, server.bucket, pool),  # the tier's own client
               "boto3 defaults": boto3_calls(defaults, server.bucket, pool),
               "obstore": obstore_calls(store, pool),
               "obstore async": obstore_async_calls(store, loop)}


# ---- measurement -----------------------------------------------------------------------------------

def one_size(calls: dict[str, tuple[Put, Get]], size: int, rounds: int) -> dict:
    chunks, outs = make_chunks(size, BATCH, seed=size), make_outs(size, BATCH)
    values = [bytes(as_buffer(c)) for c in chunks]
    names = {c: [f"s3-clients/{c.replace(' ', '-')}/{size}/{i}" for i in range(BATCH)] for c in CLIENTS}
    cpu: dict[str, dict[str, list[float]]] = {c: {d: [] for d in DIRECTIONS} for c in CLIENTS}

    def timed(client: str, direction: str, call: Callable[[], None]) -> Callable[[], float]:
        def op() -> float:
            cpu_start, start = time.process_time(), time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            cpu[client][direction].append(time.process_time() - cpu_start)
            return seconds
        return op

    ops = {c: {"SET": timed(c, "SET", lambda c=c: calls[c][0](names[c], values)),
               "GET": timed(c, "GET", lambda c=c: calls[c][1](names[c], outs))} for c in CLIENTS}

    def verify() -> None:
        for client in CLIENTS:
            for out in outs:
                out.zero_()
            calls[client][1](names[client], outs)
            check_exact(outs, chunks, client)

    samples = alternate_rounds(ops, rounds, size * BATCH, verify, sides=CLIENTS)
    gb = size * BATCH / 1e9
    result: dict = {"batch": BATCH, "rounds": rounds}
    for direction in DIRECTIONS:
        base = statistics.median(samples[direction]["boto3"])
        result[direction] = {c: {"gbps": statistics.median(samples[direction][c]),
                                 "vs_boto3": statistics.median(samples[direction][c]) / base,
                                 "cpu_s_per_gb": statistics.median(cpu[c][direction][1:]) / gb,
                                 "samples_gbps": samples[direction][c]} for c in CLIENTS}
    return result


def bench(quick: bool) -> dict:
    least, min_bytes = (3, 32 * MiB) if quick else (9, 512 * MiB)
    sizes: dict[int, dict] = {}
    # Overwritten objects keep their space until SeaweedFS compacts: as many volumes as the disk holds.
    with s3_server("s3-clients", "-volume.max=0") as server, clients(server) as calls:
        for size in SIZES:
            rounds = rounds_for(size, BATCH, least, min_bytes)
            print(f"  {BATCH} x {label(size)}, {rounds} rounds...", flush=True)
            sizes[size] = one_size(calls, size, rounds)
    return {"server": "SeaweedFS S3 gateway", "sizes": sizes}


# ---- report ----------------------------------------------------------------------------------------

def report(result: dict) -> None:
    print(f"\nGB/s of payload (median of the rounds), batches of {BATCH} at once; in brackets, this "
          "process's CPU seconds per GB moved")
    print(f"{'object':>8}  {'dir':<4}" + "".join(f"{c:>22}" for c in CLIENTS))
    for size, row in result["sizes"].items():
        for direction in DIRECTIONS:
            cells = "".join(f"{r['gbps']:>10.3f} ({r['cpu_s_per_gb']:4.1f} s/GB)"
                            for r in (row[direction][c] for c in CLIENTS))
            print(f"{label(size):>8}  {NAMES[direction]:<4}{cells}")
    for client in CLIENTS[1:]:
        ratios = {f"{NAMES[d]} {label(s)}": row[d][client]["vs_boto3"]
                  for s, row in result["sizes"].items() for d in DIRECTIONS}
        print(f"{client} / boto3 (the tier's): " + ", ".join(f"{k} {v:.0%}" for k, v in ratios.items())
              + f" (median {statistics.median(ratios.values()):.0%})")


def plot(result: dict, path: Path) -> None:
    colors = {"boto3": "#1f77b4", "boto3 defaults": "#999", "obstore": "#ff7f0e",
              "obstore async": "#2ca02c"}
    with figure(path, 1, len(DIRECTIONS), figsize=(10, 3.6), squeeze=False,
                title="S3 clients on SeaweedFS, batches of 16 at once") as axes:
        for ax, direction in zip(axes[0], DIRECTIONS, strict=True):
            sizes = list(result["sizes"])
            width = 0.8 / len(CLIENTS)
            for i, client in enumerate(CLIENTS):
                xs = [x - 0.4 + width * (i + 0.5) for x in range(len(sizes))]
                ax.bar(xs, [result["sizes"][s][direction][client]["gbps"] for s in sizes], width,
                       color=colors[client], label=client)
            ax.set_xticks(range(len(sizes)), [label(s) for s in sizes], fontsize=8)
            ax.set_ylabel("GB/s")
            ax.set_title(NAMES[direction], fontsize=9)
            ax.legend(fontsize=7)


def main() -> int:
    args = parse(parser(__doc__, "a smoke run: 3 rounds of 16 objects per size"))
    if importlib.util.find_spec("obstore") is None:
        print("obstore is not installed: .venv/bin/pip install obstore (for this measurement only)",
              file=sys.stderr)
        return 2
    import boto3
    import obstore

    started = time.monotonic()
    result = bench(args.quick)
    result.update({"obstore": obstore.__version__, "boto3": boto3.__version__,
                   "seconds": time.monotonic() - started})
    report(result)
    finish(args.out, "s3_clients", {}, result, lambda path: plot(result, path),
           note=f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
