#!/usr/bin/env python
"""LMCache's own vLLM connector against this daemon's lmcache door and against LMCache's own server: a
fresh vLLM engine's time to first token on 2,048 cached tokens, above vLLM's own prefix hit.

    .venv/bin/python scripts/bench/bench_lmcache.py [--quick] [--rows ROW,ROW] [--out bench-out]

Workload: bench_e2e's (harness/ttft.py): a random-weight Llama where prefill dominates, 8 prompts
of 2,049 tokens, one at a time, bf16, 128-token blocks, 256-token chunks,
VLLM_CPU_NUM_OF_RESERVED_CPU=1 for every engine. Each engine is a fresh process that first prefills
one short warm-up prompt, untimed (harness/ttft.py: WARMUP_TOKENS); each row but the floor gets a
fresh server, where engine 1 stores and a fresh engine 2 (the warm one) loads:
  floor          no connector, the prompts twice: the full prefill, then vLLM's own prefix hit;
  ours           our connector (LMCacheMPDaemonConnector) against the daemon;
  door/MODE      vLLM's "LMCacheMPConnector" (lmcache's own connector) in `lmcache.mp.mp_transfer_mode`
                 MODE (lmcache_driven: the worker's caches in POSIX shared memory; engine_driven: the
                 worker copies chunks through a staging segment) against the daemon's
                 `--lmcache-listen` door, on loopback TCP as LMCache's server;
  lmcache-server/MODE  the same engines against `lmcache server` (lmcache 0.5.6, CPU L1 pool, loopback
                 TCP; for engine_driven with `--shm-name`, so its workers copy through shared memory,
                 not pickle).
Every row must hit: every warm prompt caches 2,048 tokens, all from the connector (vLLM's external
prefix-cache counter), and its outputs equal the floor's prefix hit. A row that cannot run says why.
Targets (the warm TTFT above the floor): per mode, LMCache's server at least 2x the door's, and the
door within 1.5x of our own connector's. --quick (a small model, 3 prompts of 513 tokens) judges
only the hits, the outputs and what is left behind. Prints a table, writes lmcache.json and
lmcache.png to --out, exits non-zero when a check or target is missed (a target whose rows were
not run is missed). --rows runs only those rows (and the floor). 11 engines, one after another:
about 16-17 minutes on 2 busy cores, --quick about 9 (the engines' start dominates).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from harness import figure, finish, ttft
from harness.engines import CHUNK, build_model, engine_args, llm_args

from lmcache_mp.testing.launcher import free_port, start_daemon

MODES = ("lmcache_driven", "engine_driven")
DTYPE = "bfloat16"
QUICK_MODEL_FLAGS = ["--hidden", "256", "--intermediate", "512", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "64", "--max-pos", "4096"]
QUICK_PROMPTS, QUICK_PROMPT_TOKENS = 3, 2 * CHUNK + 1
POOL_GB = "1"  # each server's CPU pool: 8 prompts of 2,048 tokens at 8 KiB a token are 128 MiB
LMCACHE = Path(sys.executable).with_name("lmcache")
LMCACHE_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1",
               "PYTHONWARNINGS": "ignore"}
SERVER_READY_S, SERVER_STOP_S = 180.0, 60.0
# What LMCache's connector logs in the engine once it has chosen how to move KV (its worker's).
TRANSFER_LOG = {"lmcache_driven": "Creating transfer context (device_type=cpu, mode=lmcache_driven)",
                "engine_driven": "Worker engine-driven context registered"}
# The shared memory of LMCache's connector (its workers' caches), of LMCache's server (its pool) and of
# the door (its staging segments): what this run can leave in /dev/shm.
SHM_PREFIXES = ("lmcache_kv_", "lmcache_l1_pool_", "lmcache_mp_staging_")

Server = Callable[[Path], AbstractContextManager[dict[str, Any]]]  # a row's server -> its connector config


@contextmanager
def ours(tmp: Path) -> Iterator[dict[str, Any]]:
    with daemon(tmp) as url:
        yield llm_args("", DTYPE, url)["kv_transfer_config"]


def lmcache_connector(url: str, mode: str) -> dict[str, Any]:
    """vLLM's settings for LMCache's own connector against `url` in transfer mode `mode`."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"lmcache.mp.server_urls": url, "lmcache.mp.mp_transfer_mode": mode}}


def door(mode: str) -> Server:
    """The daemon's lmcache door on a loopback TCP port, as LMCache's server listens (it has no other
    transport), so that the two differ in what serves the requests, not in how they travel."""
    @contextmanager
    def serve(tmp: Path) -> Iterator[dict[str, Any]]:
        url = f"tcp://127.0.0.1:{free_port()}"
        with daemon(tmp, "--lmcache-listen", url, "--allow-unauthenticated-tcp"):
            yield lmcache_connector(url, mode)
    return serve


def lmcache_server(mode: str) -> Server:
    """`lmcache server` as its docs run it on CPU, serving `mode` only: a 1 GiB L1 pool (both
    `--l1-size-gb` and `--eviction-policy` are required), its HTTP admin port and its request port on
    loopback, its metrics exporter off (a fixed port, 9090, that other runs may hold)."""
    @contextmanager
    def serve(tmp: Path) -> Iterator[dict[str, Any]]:
        port = free_port()
        command = [str(LMCACHE), "server", "--host", "127.0.0.1", "--port", str(port), "--http-host",
                   "127.0.0.1", "--http-port", str(free_port()), "--chunk-size", str(CHUNK),
                   "--l1-size-gb", POOL_GB, "--eviction-policy", "LRU", "--supported-transfer-mode", mode,
                   "--disable-observability"]
        pool = f"lmcache_l1_pool_bench_{os.getpid()}"  # its name as the server advertises it
        if mode == "engine_driven":  # else its workers pickle each chunk onto the request socket
            command += ["--shm-name", pool]
        log = tmp / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **LMCACHE_ENV}, start_new_session=True)
        try:
            wait_for_server(proc, log)
            yield lmcache_connector(f"tcp://127.0.0.1:{port}", mode)
        finally:
            stop_group(proc)
            if (Path("/dev/shm") / pool).exists():  # a server that had to be killed leaves its pool
                print(f"lmcache server left /dev/shm/{pool} (exit {proc.returncode}); removed", flush=True)
                (Path("/dev/shm") / pool).unlink()
    return serve


def wait_for_server(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_READY_S
    while "LMCache cache server is running" not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}: {errors(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"lmcache server not ready in {SERVER_READY_S:.0f} s: {errors(log)}")
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM (LMCache's server then closes its pool and sockets), SIGKILL to its group if it hangs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(SERVER_STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def daemon(tmp: Path, *door_args: str) -> Iterator[str]:
    started = start_daemon(tmp, "--chunk-size", str(CHUNK), "--l1-size-gb", POOL_GB, *door_args)
    try:
        yield started.url
    finally:
        started.stop(timeout=60)
        shutil.copy(started.log_path, tmp / "daemon.log")


ROWS: dict[str, Server] = {"ours": ours,
                           **{f"door/{m}": door(m) for m in MODES},
                           **{f"lmcache-server/{m}": lmcache_server(m) for m in MODES}}


def errors(log: Path, count: int = 3) -> str:
    """The first lines of `log` that name an error, tracebacks' frames left out: why a process
    failed, in its own words (what follows the first is mostly the teardown it caused)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if any(word in line for word in ("Error", "ERROR", "error:", "died"))
             and 'File "' not in line and not line.rstrip().endswith("^")]
    return " | ".join(lines[:count]) or "(no error line; see the log)"


def run_row(name: str, server: Server, llm: dict[str, Any], prompts: list[list[int]], tmp: Path,
            out: Path) -> dict[str, Any]:
    """Engine 1 stores through a fresh server, a fresh engine 2 loads: their rows, or why they could not."""
    stem = name.replace("/", "-")
    work = tmp / stem
    work.mkdir()
    logs = [out / f"lmcache-{stem}-store.log", out / f"lmcache-{stem}-warm.log"]
    row: dict[str, Any] = {"logs": [str(log) for log in logs]}
    running: Path | None = None  # the engine's log while one runs
    try:
        with server(work) as connector:
            engine = {**llm, "disable_hybrid_kv_cache_manager": True, "kv_transfer_config": connector}
            for stage, running, what in (("store", logs[0], "engine 1 stores"),
                                         ("warm", logs[1], "a fresh engine 2 loads")):
                print(f"{name}: {what}...", flush=True)
                (row[stage],) = ttft.timed_passes(__file__, engine, prompts, 1, running)
            running = None
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        row["error"] = f"{err}" + (f": {errors(running)}" if running else "")
        print(f"{name}: FAILED: {row['error']}", flush=True)
    finally:
        for log in ("server.log", "daemon.log"):
            if (work / log).exists():
                shutil.copy(work / log, out / f"lmcache-{stem}-{log}")
    if "warm" in row:
        row["transfer"] = transfer(name, logs[1].read_text(errors="replace"))
    return row


def transfer(name: str, log: str) -> str:
    """How the engine's connector moved KV, from its log: the mode, and for engine_driven SHM or pickle."""
    if name == "ours":
        return "ours"
    mode = name.split("/")[1]
    if TRANSFER_LOG[mode] not in log:
        return "not the configured mode"
    if mode == "engine_driven":
        return "engine_driven, SHM" if "mode=SHM" in log else "engine_driven, pickle"
    return mode


def shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIXES)}


def left_behind(before: set[str]) -> list[str]:
    """What appeared in /dev/shm since `before` and is still there with its owner gone: the pid in its
    name (a worker's, a daemon's, this run's for LMCache's server's pool). A live owner's segment is
    in use, maybe by another run beside this one."""
    def gone(name: str) -> bool:
        prefix = next(prefix for prefix in SHM_PREFIXES if name.startswith(prefix))
        owner = re.search(r"\d+", name.removeprefix(prefix))
        if owner is None or int(owner.group()) == os.getpid():
            return True
        try:
            os.kill(int(owner.group()), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return sorted(name for name in shm_names() - before if gone(name))


def main() -> int:
    args = engine_args(__doc__, "a small model, 3 prompts of 513 tokens; targets not judged",
                       {"rows": ",".join(ROWS)}, ttft.run_passes)
    if args is None:  # it ran as an engine's child
        return 0
    selected = args.rows.split(",")
    if unknown := set(selected) - set(ROWS):
        raise SystemExit(f"--rows: no row {sorted(unknown)}; the rows are {', '.join(ROWS)}")
    shm_before = shm_names()
    tmp = Path(tempfile.mkdtemp(prefix="lmc-lmcache-", dir="/tmp"))
    try:
        count, length, flags = ((QUICK_PROMPTS, QUICK_PROMPT_TOKENS, QUICK_MODEL_FLAGS) if args.quick
                                else (ttft.PROMPTS, ttft.PROMPT_TOKENS, ttft.MODEL_FLAGS))
        print("building the random-weight model...", flush=True)
        build_model(tmp / "model", DTYPE, flags)
        prompts = ttft.random_prompts(count, length)
        llm = llm_args(str(tmp / "model"), DTYPE, None)
        print("floor: no connector, then vLLM's own prefix hits...", flush=True)
        full, hit = ttft.timed_passes(__file__, llm, prompts, 2, args.out / "lmcache-floor.log")
        rows = {name: run_row(name, server, llm, prompts, tmp, args.out) for name, server in ROWS.items()
                if name in selected}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    left = left_behind(shm_before)
    return report(args, {"full prefill": full, "prefix hit": hit}, rows, (length - 1) // CHUNK * CHUNK, left)


def above_floor(rows: dict[str, dict[str, Any]], floor_ms: float) -> dict[str, float]:
    return {name: ttft.median_ms(row["warm"]) - floor_ms for name, row in rows.items() if "warm" in row}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is at the floor or
    below it (no ratio says anything about a row the floor's own noise covers)."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def correctness(floor: dict[str, list[dict]], rows: dict[str, dict[str, Any]], expected: int,
                left: list[str]) -> dict[str, bool]:
    checks = {f"floor: vLLM's prefix hit caches {expected} tokens of every prompt":
              all(r["num_cached_tokens"] == expected for r in floor["prefix hit"])}
    for name, row in rows.items():
        if "warm" not in row:
            checks[f"{name}: ran ({row['error']})"] = False
            continue
        warm = row["warm"]
        checks.update({
            f"{name}: engine 2 caches {expected} tokens of every prompt, all from the connector":
                all(r["num_cached_tokens"] == r["external_tokens"] == expected for r in warm),
            f"{name}: outputs equal to the floor's": [r["token_ids"] for r in warm] ==
                [r["token_ids"] for r in floor["prefix hit"]],
            f"{name}: transfer as configured ({row['transfer']})":
                row["transfer"] in ("ours", "lmcache_driven", "engine_driven, SHM"),
        })
    checks[f"nothing this run made is left in /dev/shm ({', '.join(left) or 'none'})"] = not left
    return checks


def targets(above: dict[str, float]) -> tuple[dict[str, bool], dict[str, float | None]]:
    checks: dict[str, bool] = {}
    ratios: dict[str, float | None] = {}
    for mode in MODES:
        door_ms, server_ms = above.get(f"door/{mode}"), above.get(f"lmcache-server/{mode}")
        server_ratio = ratio(server_ms, door_ms)
        if server_ratio is None and door_ms is not None and door_ms <= 0 and server_ms is not None:
            server_met = server_ms > 0  # the door at the floor, the server above it
        else:
            server_met = server_ratio is not None and server_ratio >= 2
        ratios[f"lmcache-server/door, {mode}"] = server_ratio
        checks[f"{mode}: LMCache's server at least 2x the door, above the floor ({fmt(server_ratio)})"] = \
            server_met
        door_ratio = ratio(door_ms, above.get("ours"))
        ratios[f"door/ours, {mode}"] = door_ratio
        checks[f"{mode}: the door within 1.5x of our own connector above the floor ({fmt(door_ratio)})"] = \
            door_ms is not None and "ours" in above and door_ms <= 1.5 * max(above["ours"], 0.0)
    return checks, ratios


def fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}x"


def report(args: Any, floor: dict[str, list[dict]], rows: dict[str, dict[str, Any]], expected: int,
           left: list[str]) -> int:
    floor_ms = ttft.median_ms(floor["prefix hit"])
    above = above_floor(rows, floor_ms)
    print(f"\n{'row':<30}{'transfer':>20}{'store ms':>10}{'warm ms':>10}{'above floor':>13}"
          f"{'hit tokens':>12}")
    for name, r in floor.items():
        hits = ",".join(map(str, sorted({x["num_cached_tokens"] for x in r})))
        print(f"{'floor, ' + name:<30}{'':>20}{'':>10}{ttft.median_ms(r):>10.1f}{'':>13}{hits:>12}")
    for name, row in rows.items():
        if "warm" not in row:
            print(f"{name:<30} did not run: {row['error']}")
            continue
        hits = ",".join(map(str, sorted({x["external_tokens"] for x in row["warm"]})))
        print(f"{name:<30}{row['transfer']:>20}{ttft.median_ms(row['store']):>10.1f}"
              f"{ttft.median_ms(row['warm']):>10.1f}{above[name]:>+13.1f}{hits:>12}")
    checks = correctness(floor, rows, expected, left)
    speed, ratios = targets(above)
    for name, value in ratios.items():
        print(f"ratio {name}: {fmt(value)}")
    judged = checks if args.quick else {**checks, **speed}
    ttft_ms = {f"floor, {n}": [x["ttft_s"] * 1e3 for x in r] for n, r in floor.items()}
    ttft_ms.update({n: [x["ttft_s"] * 1e3 for x in row["warm"]] for n, row in rows.items() if "warm" in row})
    finish(args.out, "lmcache", judged,
           {"quick": args.quick, "expected_hit_tokens": expected, "floor_ms": floor_ms,
            "above_floor_ms": above, "ratios": ratios, "checks": checks, "targets": speed,
            "shm_left": left, "ttft_ms": ttft_ms, "floor": floor, "rows": rows},
           lambda path: plot(above, path), note="" if not args.quick else " (--quick: targets not judged)")
    missed = [name for name, ok in judged.items() if not ok]
    if missed:
        print("\nmissed:\n  " + "\n  ".join(missed))
    return 1 if missed else 0


def plot(above: dict[str, float], path: Path) -> None:
    with figure(path, figsize=(7, 3.5)) as ax:
        names = list(above)
        colors = ["C2" if n == "ours" else "C0" if n.startswith("door") else "C3" for n in names]
        ax.barh(names, [above[n] for n in names], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("warm TTFT above vLLM's own prefix hit (ms, median)")
        ax.tick_params(axis="y", labelsize=8)


if __name__ == "__main__":
    raise SystemExit(main())
