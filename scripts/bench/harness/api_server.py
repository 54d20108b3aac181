"""vLLM's OpenAI-compatible API server for the benchmarks: start one as a child process on a free
loopback port, wait for its /health, read its Prometheus counters and its memory, stop it with
everything it spawned; a streaming /v1/completions client that measures TTFT itself; and what
its measurements are summed up with (busy time, the logs' findings)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lmcache_mp.testing.launcher import free_port
from lmcache_mp.testing.shm_leftovers import ShmWatch

# Counters read from /metrics (summed over their labels) and diffed over a run.
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:num_preemptions", "vllm:request_success",
            "vllm:prompt_tokens")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


@dataclass
class ApiServer:
    """One `python -m vllm.entrypoints.openai.api_server` child, in a process group of its own so
    that stopping it also stops the EngineCore and worker processes it spawned."""

    name: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    # /dev/shm as it was before the server started: what its engine leaves there if it is killed
    # (vLLM's queues' segments and semaphores) is removed once it is stopped.
    shm: ShmWatch
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def counters(self) -> dict[str, float]:
        """COUNTERS from /metrics, each summed over its label sets (Prometheus adds `_total`)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        totals = dict.fromkeys(COUNTERS, 0.0)
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match and match.group(1).removesuffix("_total") in totals:
                totals[match.group(1).removesuffix("_total")] += float(match.group(2))
        return totals

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it spawned (shared pages counted in each)."""
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def cpu_s(self) -> float:
        """CPU seconds used by the server and every process it spawned."""
        return tree_cpu_s(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL to whatever is left of its process group; reap the server."""
        with contextlib.suppress(ProcessLookupError):  # raised when nothing of the group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) used by process `pid` and every live process under it."""
    try:
        root = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0.0


def stop_servers(servers: list[ApiServer], timeout_s: float = 30) -> None:
    """SIGTERM to every server at once, to the server alone (it shuts its engine down; signalling the
    engine's processes too makes that shutdown fail noisily), then SIGKILL to what is left after
    `timeout_s` (a server waits for its open connections before it exits)."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(max(0.0, deadline - time.monotonic()))
        server.kill()
    for server in servers:  # once none runs: nothing of theirs is in use any more
        server.shm.remove_leftovers()


def start_server(name: str, model: str, args: list[str], env: dict[str, str], log: Path,
                 cpus: set[int] | None = None) -> ApiServer:
    """Start an API server for `model` on a free loopback port with the extra `args`, its output to
    `log`; confined with everything it spawns to `cpus` where given."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log", *args]
    shm = ShmWatch()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return ApiServer(name, port, log, proc, shm)


def wait_healthy(servers: list[ApiServer], deadline_s: float, poll_s: float = 2.0) -> None:
    """Wait until every server answers /health, printing a line as each does and one a minute while
    some still start; raise when one exits or `deadline_s` passes."""
    start = time.monotonic()
    waiting, last_note = list(servers), start
    while waiting:
        for server in list(waiting):
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while starting; "
                                   f"see {server.log}")
            if server.healthy():
                waiting.remove(server)
                print(f"  {server.name} ready on port {server.port} after {time.monotonic() - start:.0f} s",
                      flush=True)
        now = time.monotonic()
        if waiting and now - start > deadline_s:
            raise RuntimeError(f"not healthy in {deadline_s:.0f} s: {', '.join(s.name for s in waiting)}")
        if waiting and now - last_note >= 60:
            print(f"  still starting after {now - start:.0f} s: {', '.join(s.name for s in waiting)}",
                  flush=True)
            last_note = now
        if waiting:
            time.sleep(poll_s)


@dataclass
class Completion:
    """One streamed completion as the client saw it. Times are time.monotonic() seconds."""

    sent_at: float
    ttft_s: float = float("nan")  # to the first chunk that carries generated tokens
    done_at: float = float("nan")  # the stream's end
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details, where the server reports it
    error: str = ""


def stream_completion(url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> Completion:
    """POST a greedy, streamed /v1/completions of the token ids `prompt`; read the generated token
    ids from each chunk (`return_token_ids`) and the usage from the last one."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    result = Completion(time.monotonic())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            for raw in resp:
                _read_event(raw.decode().strip(), result)
    except (OSError, urllib.error.URLError, ValueError) as exc:  # HTTPError, timeouts, bad JSON
        result.error = f"{type(exc).__name__}: {exc}"
    result.done_at = time.monotonic()
    if not result.error and len(result.token_ids) != max_tokens:
        result.error = f"{len(result.token_ids)} tokens generated, {max_tokens} asked for"
    return result


def _read_event(line: str, result: Completion) -> None:
    """Fold one server-sent-events line into `result`."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[6:])
    if "error" in event:
        raise ValueError(f"server error: {event['error']}")
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids") or []
        if ids and not result.token_ids:
            result.ttft_s = time.monotonic() - result.sent_at
        result.token_ids.extend(ids)
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])


def busy_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the [start, end] intervals: the time some request was outstanding."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def log_sizes(logs: dict[str, Path]) -> dict[str, int]:
    return {name: path.stat().st_size for name, path in logs.items()}


def log_findings(logs: dict[str, Path], start: dict[str, int],
                 end: dict[str, int]) -> dict[str, dict[str, int]]:
    """Lines in each log between `start` and `end` (log_sizes before and after a run: startup and
    shutdown log warnings and errors of their own) worth a look, per kind."""
    words = {"error": ("ERROR", "Traceback"), "warning": ("WARNING",), "preempt": ("preempt", "Preempt")}
    found: dict[str, dict[str, int]] = {}
    for name, path in logs.items():
        with open(path, "rb") as f:
            f.seek(start[name])
            lines = f.read(end[name] - start[name]).decode(errors="replace").splitlines()
        found[name] = {kind: sum(any(w in line for w in ws) for line in lines) for kind, ws in words.items()}
    return found
