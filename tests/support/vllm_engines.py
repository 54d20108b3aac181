"""Real vLLM engines for the end-to-end tests, and the daemon they share.

Each engine is a fresh process (`tests/support/vllm_engine_run.py`) whose log (vLLM's and the RESULT
lines it prints per round) goes to a file: `VllmEngine` starts one and reads its rounds,
`run_engine` runs one to the end. `DaemonUnderTest` is a real daemon that a test may kill and
start again at the same address. The prompts are those of test_vllm_connector (tiny random
float32 models, vLLM blocks of 32 tokens, daemon chunks of 64), which test_tensor_parallel runs
too; the module-scoped fixtures `work_dir` and `daemon` are shared by importing them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.testing.launcher import start_daemon
from lmcache_mp.testing.shm_leftovers import ShmWatch
from lmcache_mp.testing.vllm_env import engine_env
from scripts.bench.harness.api_server import ApiServer, start_server
from tests.support.helpers import status
from tests.support.vllm_engine_run import kv_transfer_config

REPO = Path(__file__).resolve().parents[2]
BLOCK, CHUNK = 32, 64
MAX_TOKENS = 16
ENGINE_TIMEOUT_S = 240.0
ENV = dict(os.environ, **engine_env())

_rng = random.Random(4)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]  # ids 0-2 are the tokenizer's specials


_BASE = _tokens(4 * CHUNK)
# Each ends one token after a chunk boundary, or on one (the full-prompt hit).
PROMPTS = [
    _BASE[: 3 * CHUNK + 1],  # 3 chunks
    _BASE[: 2 * CHUNK] + _tokens(CHUNK + 1),  # shares 2 chunks with the first, then its own
    _BASE[:CHUNK] + _tokens(50),  # 1 chunk; decoding completes its 2nd chunk: stored too (save_decode_cache)
    _tokens(40),  # shorter than a chunk
    _BASE,  # exactly 4 chunks: a hit on the whole prompt
]
HITS = [3 * CHUNK, 3 * CHUNK, CHUNK, 0, 4 * CHUNK]
STORED_CHUNKS = 6  # distinct full chunks: base 0-3, the second prompt's 3rd, and the third's 2nd
# (completed while decoding: the default `save_decode_cache` stores those too)
PROMPT_CHUNKS = 5  # of them, those of the prompts (what running PROMPTS again can hit)
# One prompt of each prefix family: run together, none can hit what another stores.
HEADS = [PROMPTS[0], PROMPTS[3]]
HEAD_CHUNKS = 3
# vLLM blocks 0-2 of _BASE, then other tokens: 1 chunk from the daemon, 3 blocks cached locally.
PROBE = _BASE[: 3 * BLOCK] + _tokens(BLOCK + 1)


def engine_spec(model: Path, daemon: DaemonUnderTest | None, rounds: list[list[list[int]]],
                prefix_caching: bool = True, **extra: Any) -> dict[str, Any]:
    """Tails off (`lmcache.mp.tails`): these tests count the whole chunks stored and loaded;
    tests/vllm/test_vllm_tails.py turns them on."""
    return {"model": str(model), "dtype": "float32", "block_size": BLOCK, "num_blocks": 1024,
            "max_tokens": MAX_TOKENS, "prefix_caching": prefix_caching, "rounds": rounds,
            "connector": None if daemon is None else {"lmcache.mp.url": daemon.url,
                                                      "lmcache.mp.tails": False},
            **extra}


class VllmEngine:
    """One engine process; its log (vLLM's and the RESULT lines) goes to a file, and each round's
    result, whole, to a file in `results_dir` beside it (a log line can be read half written)."""

    def __init__(self, spec: dict[str, Any], log_path: Path, env: dict[str, str] = ENV,
                 timeout_s: float = ENGINE_TIMEOUT_S):
        self.log_path = log_path
        self.results_dir = log_path.with_suffix(".results")
        shutil.rmtree(self.results_dir, ignore_errors=True)
        self.results_dir.mkdir(parents=True)
        self.num_rounds = len(spec["rounds"])
        self.hold_dir = Path(spec["hold_dir"]) if spec.get("hold_dir") else None
        self._outputs: list[list[dict[str, Any]]] | None = None
        spec = {**spec, "results_dir": str(self.results_dir)}
        self.shm = ShmWatch()
        if _may_run_in_process(spec):
            env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # A process group of its own (killed whole), but the test's session, the daemon's too: Linux
        # shares CPUs between sessions first, and a daemon in another session than an engine whose
        # workers busy-wait on every core waited minutes for a CPU (docs/benchmarks.md section 13).
        with open(log_path, "wb") as log:
            command = [sys.executable, "-m", "tests.support.vllm_engine_run", json.dumps(spec)]
            self.proc = subprocess.Popen(command,
                                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         process_group=0)
        self.deadline = time.monotonic() + timeout_s

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def round(self, i: int) -> list[dict[str, Any]]:
        """The outputs of round i, waiting for them."""
        result_path = self.results_dir / f"round-{i}.json"
        self._wait_for(result_path, f"round {i}")
        return json.loads(result_path.read_text())["outputs"]

    def wait_held(self) -> None:
        """Returns once an engine from `held_engine` is up, waiting to start its first round."""
        assert self.hold_dir is not None
        self._wait_for(self.hold_dir / "held", "it was up")

    def _wait_for(self, path: Path, what: str) -> None:
        while True:
            exited = self.proc.poll() is not None  # before looking: a file written as it exits counts
            if path.exists():
                return
            if exited:
                pytest.fail(f"engine exited with {self.proc.returncode} before {what}:\n{self.log_tail()}")
            if time.monotonic() > self.deadline:
                self.kill()
                pytest.fail(f"engine timed out before {what}:\n{self.log_tail()}")
            time.sleep(0.1)

    def finish(self) -> None:
        try:
            rc = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"engine did not exit:\n{self.log_tail()}")
        assert rc == 0, self.log_tail()
        assert not tracebacks(self.log_path.read_text(errors="replace")), self.log_tail()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine's process group: EngineCore, workers
            self.proc.wait(10)
            self.shm.remove_leftovers()

    def outputs(self) -> list[list[dict[str, Any]]]:
        """Every round's outputs, once the engine has exited cleanly (killed if it fails); waited
        for by the first caller, kept for the next."""
        if self._outputs is None:
            try:
                rounds = [self.round(i) for i in range(self.num_rounds)]
                self.finish()
            finally:
                self.kill()
            self._outputs = rounds
        return self._outputs

    def go(self) -> None:
        """Lets an engine from `held_engine` start its first round."""
        assert self.hold_dir is not None
        (self.hold_dir / "go").touch()

    def start_after(self, first: VllmEngine) -> list[list[dict[str, Any]]]:
        """For an engine from `held_engine`: `first`'s outputs, once it has exited; then this one's
        first round goes."""
        outputs = first.outputs()
        self.go()
        return outputs


def _may_run_in_process(spec: dict[str, Any]) -> bool:
    """Whether the engine's EngineCore may run in its own process rather than a child of it: it
    then starts in ~15 s instead of ~45 s here, and with one rank the connector's two halves share a
    process either way. But an in-process EngineCore steps only inside `generate`: what goes out in
    the steps after a round (a finished request's tail store; the stores a reset waits for) would
    wait for the next round. Those engines, TP ones and those whose spec says `engine_core_process`
    (a test that waits for the engine to act between rounds) keep vLLM's default layout, as do the
    API-server tests."""
    connector = spec.get("connector")
    tails = connector is not None and connector.get("lmcache.mp.tails", True)
    return (spec.get("tensor_parallel_size", 1) == 1 and not spec.get("resets") and not tails
            and not spec.get("engine_core_process"))


def held_engine(spec: dict[str, Any], log_path: Path, hold_dir: Path, env: dict[str, str] = ENV,
                timeout_s: float = ENGINE_TIMEOUT_S) -> VllmEngine:
    """An engine whose first round waits for `go` in `hold_dir` (made here). Started while another
    engine runs or starts, it spends that time on its own start (most of an engine's time: imports
    in its three processes); the test lets it go (`go`, `start_after`) once the other has exited,
    or, when the other has the connector too, once both were up before either ran (`wait_held`): no
    lookup or store of one runs beside the other's rounds or start."""
    hold_dir.mkdir(exist_ok=True)
    return VllmEngine({**spec, "hold_dir": str(hold_dir)}, log_path, env,
                      timeout_s + ENGINE_TIMEOUT_S)  # the other engine's run comes first


# vLLM's own teardown race: when an EngineCore is slow to exit (a busy machine), the front end
# force-kills it and its exit hook then asks psutil about the pid it just killed. Not ours to fail on.
_VLLM_TEARDOWN_RACE = ("in kill_process_tree", "psutil.NoSuchProcess")


def tracebacks(log: str) -> list[str]:
    """The tracebacks in an engine's log, but vLLM's teardown race."""
    found = []
    for part in log.split("Traceback (most recent call last):")[1:]:
        end = re.search(r"^\S*\w+(Error|Exception|NoSuchProcess|Exit)\b.*$", part, re.MULTILINE)
        text = part[: end.end()] if end else part
        if not all(marker in text for marker in _VLLM_TEARDOWN_RACE):
            found.append(text)
    return found


def run_engine(spec: dict[str, Any], log_path: Path, env: dict[str, str] = ENV,
               timeout_s: float = ENGINE_TIMEOUT_S) -> list[list[dict[str, Any]]]:
    return VllmEngine(spec, log_path, env, timeout_s).outputs()


def start_api_server(model: Path, connector: dict[str, Any], log_path: Path, *args: str) -> ApiServer:
    """vLLM's OpenAI API server (served as "bench") on the tiny model, with the connector and its
    `connector` extra config: these tests' engine settings, and `args`. Still starting: the harness's
    `wait_healthy` waits for it (a test may start an engine meanwhile)."""
    return start_server("connector", str(model), [
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--block-size", str(BLOCK),
        "--num-gpu-blocks-override", "1024", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv_transfer_config(connector)), *args], ENV, log_path)


def make_tiny_llama(out: Path) -> Path:
    """The tiny random-weight Llama of these tests (fp32), written to `out`."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out),
                    "--dtype", "float32"], check=True, capture_output=True, timeout=120)
    return out


def cached(outputs: list[dict[str, Any]]) -> list[int]:
    return [o["num_cached_tokens"] for o in outputs]


def tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


class DaemonUnderTest:
    """The daemon the engines share, restartable at the same address."""

    ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--max-workers", "1")

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.proc = start_daemon(tmp, *self.ARGS)

    @property
    def url(self) -> str:
        return self.proc.url

    def objects(self) -> int:
        return status(self.url).objects

    def kill(self) -> None:
        """SIGKILL, and its pool file discarded: the next start is empty."""
        self.proc.stop(signal.SIGKILL)

    def restart(self) -> None:
        """SIGTERM, then the same daemon again, which adopts its pool file (warm restart)."""
        assert self.proc.stop(signal.SIGTERM, keep_pool=True) == 0
        self.start()

    def start(self) -> None:
        self.proc = start_daemon(self.tmp, *self.ARGS)


# The fixtures are named `work_dir` and `daemon` (a test module imports these functions, and its
# tests name the fixtures as parameters); the module's `daemon` replaces conftest's for its tests.


@pytest.fixture(scope="module", name="work_dir")
def work_dir_fixture() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-vllm-", dir="/tmp"))  # short: Unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(work_dir: Path) -> Iterator[DaemonUnderTest]:
    d = DaemonUnderTest(work_dir)
    yield d
    d.proc.stop()
    assert "Traceback" not in d.proc.log(), d.proc.log()
