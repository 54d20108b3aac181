"""What the benchmarks that run vLLM engines share: the random-weight model, the engines' settings,
the command line of a script that is its own engines' child, and running one engine in such a
child process that prints its results as `RESULT <json>` lines (all at once, or one request at a
time)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import REPO, parser
from lmcache_mp.testing.vllm_env import engine_env

CHUNK, BLOCK = 256, 128
ENGINE_TIMEOUT_S = 1800  # an engine start or one request on a loaded 2-core machine takes minutes at worst
ENGINE_ENV = engine_env()  # `lmcache_mp.testing.vllm_env`: what every engine runs with


def build_model(out: Path, dtype: str, flags: list[str]) -> None:
    """Write a random-weight Llama (`make_tiny_model.py` with `flags`) in `dtype` to `out`."""
    built = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out), *flags,
                            "--dtype", dtype], capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"make_tiny_model.py failed ({built.returncode}):\n{built.stderr[-2000:]}")


def llm_args(model: str, dtype: str, url: str | None, load_mode: str = "auto") -> dict[str, Any]:
    """`vllm.LLM` keyword arguments: one request at a time, prefix caching on, and the connector
    against the daemon at `url` (none when `url` is None)."""
    args: dict[str, Any] = {"model": model, "dtype": dtype, "max_model_len": 4096, "enforce_eager": True,
                            "seed": 0, "max_num_seqs": 1, "block_size": BLOCK, "enable_prefix_caching": True,
                            "disable_log_stats": False}
    if url:
        args["disable_hybrid_kv_cache_manager"] = True
        args["kv_transfer_config"] = {
            "kv_connector": "LMCacheMPDaemonConnector", "kv_connector_module_path": "vllm_adapter.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"lmcache.mp.url": url, "lmcache.mp.load_mode": load_mode}}
    return args


def run_child(script: str, spec: dict[str, Any], log: Path, env: dict[str, str] | None = None,
              timeout_s: float = 900) -> list[dict[str, Any]]:
    """Run `script --engine SPEC` with ENGINE_ENV (plus `env`), its stderr to `log`, then the rest of
    its stdout (vLLM logs there); return the payloads of its `RESULT <json>` lines, in order."""
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, script, "--engine", json.dumps(spec)],
                             env={**os.environ, **ENGINE_ENV, **(env or {})}, text=True,
                             stdout=subprocess.PIPE, stderr=f, timeout=timeout_s)
    lines = out.stdout.splitlines()
    with open(log, "a") as f:
        f.write("\n--- stdout ---\n")
        f.writelines(f"{line}\n" for line in lines if not line.startswith("RESULT "))
    if out.returncode:
        raise RuntimeError(f"engine failed ({out.returncode}); see {log}")
    return [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]


def engine_args(doc: str, quick: str | None, options: dict[str, int | str],
                run_engine: Callable[[dict[str, Any]], None]) -> argparse.Namespace | None:
    """The command line of a benchmark that runs engines as children of its own script: the
    harness's (`doc`, --out, --quick where `quick` says what it runs), `options` (integers or
    strings, typed by their defaults, which --help shows), and the internal --engine SPEC. As such
    a child, run `run_engine(SPEC)` and return None; else make --out and return the options."""
    command = parser(doc, quick)
    for name, default in options.items():
        command.add_argument(f"--{name}", type=type(default), default=default,
                             help=f"(default: {default})")
    command.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine
    args = command.parse_args()
    if args.engine:
        run_engine(json.loads(args.engine))
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def external_hits() -> int:
    """This process's vLLM engine's running total of tokens the connector supplied (its own
    prefix hits not counted)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return sum(int(m.value) for m in get_metrics_snapshot() if m.name == "vllm:external_prefix_cache_hits")


class EngineProcess:
    """One engine child, `script --engine SPEC`, driven a request at a time: it prints a RESULT
    line once ready, then one per line it reads on stdin. A thread collects its RESULT lines and
    writes the rest of its output (vLLM logs to stdout and stderr) to `log`."""

    def __init__(self, script: str, spec: dict[str, Any], log: Path, timeout_s: float):
        self.log, self._timeout_s = log, timeout_s
        self._proc = subprocess.Popen([sys.executable, script, "--engine", json.dumps(spec)],
                                      env={**os.environ, **ENGINE_ENV}, text=True, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._results: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        with open(self.log, "w", buffering=1) as log:  # line by line: readable while it runs
            for line in self._proc.stdout:
                if line.startswith("RESULT "):
                    self._results.put(json.loads(line[7:]))
                else:
                    log.write(line)
        self._results.put(None)  # exited

    def result(self) -> dict[str, Any]:
        try:
            result = self._results.get(timeout=self._timeout_s)
        except queue.Empty:
            result = None
        if result is None:
            raise RuntimeError(f"engine exited or gave no result in {self._timeout_s:.0f} s; see {self.log}")
        return result

    def turn(self, line: str = "go") -> dict[str, Any]:
        """Send the child one line (what its next request is, where it needs telling); its result."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        return self.result()

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the child's loop ends; vLLM shuts down
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)  # the log is complete once the child's output has ended

