"""Start the daemon (`lmcache-mp serve`) as a child process and wait until it answers.

Used by the tests, the benchmarks and the examples; `lmcache-mp serve` itself does not need it.

The pool files of the daemons started here live in a directory of their own
(`launched_pool_directory`) unless their arguments or environment name one: a daemon's start
removes the stale pool files of its directory (pool_file_ttl_s), and one started here must never
take those of the daemons the user runs; the next run's daemons take what a killed run left. A
daemon's pool file is discarded when it stops (or when this process exits), and only if a daemon
started here made it: a file it found (a crashed daemon's, waiting for its restart) is never
removed."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.protocol import PHASE_SERVING, RequestType, StatusReport
from lmcache_mp.storage.pool.location import (
    PoolFileError,
    default_pool_directory,
    default_pool_file,
    discard_pool_file,
)


@dataclass
class DaemonProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    started_at: float  # time.monotonic() just before the process was started
    pool_path: Path | None = None  # its pool file (warm restart), None if it has none

    @property
    def socket_path(self) -> Path:
        return Path(self.url.removeprefix("ipc://"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def threads(self, wait_s: float = 5.0) -> str:
        """What each of the daemon's threads is doing, for a report of a daemon that stopped
        answering: the kernel's view (state, where it sleeps, CPU ticks; it needs no answer from
        the daemon), then the Python stacks its SIGUSR1 handler writes into its log (`cli.py`;
        they need no GIL, only that the process gets some CPU within `wait_s`)."""
        if self.proc.poll() is not None:
            return f"the daemon exited with {self.proc.returncode}"
        lines = [f"pid {self.proc.pid}; per thread: tid name state wchan utime stime (ticks) nice policy "
                 "cpu allowed-cpus on-cpu-s runqueue-wait-s"]
        for task in sorted(Path(f"/proc/{self.proc.pid}/task").iterdir()):
            with contextlib.suppress(OSError):
                lines.append(f"  {task.name} {_thread_line(task)}")
        lines += _busiest_threads() + _socket_queues(self.proc.pid)
        before = len(self.log())
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        while "Thread 0x" not in self.log()[before:] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the rest of the dump
        return "\n".join(lines) + "\n" + (self.log()[before:] or "(no stacks written)")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0, *, keep_pool: bool = False) -> int:
        """Signal the daemon and wait for it (a SIGTERM'd daemon finishes what it has queued: on a
        busy 2-core machine that took over 10 s); then discard its pool file (the memory it holds)
        if a daemon started here made it, unless `keep_pool`: the next daemon started as this one
        was then adopts it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        if not keep_pool:
            self.discard_pool()
        return code

    def discard_pool(self) -> None:
        """Discard its pool file if a daemon started here made it (never one it found)."""
        if self.pool_path in _made:
            with contextlib.suppress(PoolFileError):  # a daemon started on it since holds it
                discard_pool_file(self.pool_path)
                _made.discard(self.pool_path)


def _thread_line(task: Path) -> str:
    """One thread's kernel state (/proc/PID/task/TID): what a starved thread shows is a long
    run-queue wait (schedstat) beside few ticks on a CPU."""
    fields = (task / "stat").read_text().rpartition(")")[2].split()  # fields 3.. of stat(5)
    allowed = next((line.split(":")[1].strip() for line in (task / "status").read_text().splitlines()
                    if line.startswith("Cpus_allowed_list")), "?")
    on_cpu_ns, waited_ns = (task / "schedstat").read_text().split()[:2]
    return (f"{(task / 'comm').read_text().strip()} {fields[0]} {(task / 'wchan').read_text() or '-'} "
            f"{fields[11]} {fields[12]} {fields[16]} {fields[38]} {fields[36]} {allowed} "
            f"{int(on_cpu_ns) / 1e9:.2f} {int(waited_ns) / 1e9:.2f}")


def _socket_queues(pid: int) -> list[str]:
    """The daemon's sockets and every socket with bytes queued (`ss`): whether a request that
    got no answer sits in a client's send queue, in the daemon's receive queue, or nowhere."""
    try:
        out = subprocess.run(["ss", "-xtnpa"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f"(no socket table: {err})"]
    mine = f"pid={pid},"

    def queued(row: str) -> bool:  # a listener's Send-Q is its backlog, its Recv-Q the unaccepted
        fields = row.split()
        return len(fields) > 3 and (fields[2] != "0" or (fields[3] != "0" and fields[1] != "LISTEN"))

    rows = [row for row in out.splitlines()[1:] if mine in row or queued(row)]
    return ["sockets: the daemon's, and any with bytes queued (ss -xtnpa: Recv-Q Send-Q)",
            *(f"  {row}" for row in rows)]


def _busiest_threads(count: int = 12) -> list[str]:
    """The machine's threads by CPU share, with their scheduling class and nice (`ps`): who holds
    the CPUs a starved daemon waits for."""
    try:
        out = subprocess.run(["ps", "-eLo", "pid,tid,cls,ni,rtprio,psr,pcpu,stat,comm", "--sort=-pcpu"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f"(no thread table: {err})"]
    return ["the busiest threads on this machine (ps -eLo ... --sort=-pcpu):",
            *(f"  {row}" for row in out.splitlines()[: count + 1])]


_POOL_FILE_ENV = "LMCACHE_MP_POOL_FILE"
_started: list[DaemonProcess] = []
_made: set[Path] = set()  # the pool files that daemons started here made


def discard_pools() -> None:
    """Discard the pool files of the stopped daemons started here, those they made (a daemon killed
    without `stop` leaves its pool file behind, holding memory, by design). Done at exit too."""
    for daemon in _started:
        if daemon.proc.poll() is not None:
            daemon.discard_pool()
    if _started and all(daemon.proc.poll() is not None for daemon in _started):
        with contextlib.suppress(OSError):  # kept while it holds a pool file (anyone's)
            launched_pool_directory().rmdir()


atexit.register(discard_pools)


def launched_pool_directory() -> Path:
    """Where the pool files of the daemons started here go (see the module docstring)."""
    default = default_pool_directory()
    return default.with_name(f"{default.name}-launched")


def _pool_path(url: str, tmp_dir: Path, args: Sequence[str], env: Mapping[str, str]) -> Path | None:
    """The pool file of `lmcache-mp serve --listen url ARGS` run with runtime directory `tmp_dir`
    and environment `env` (without either naming one: its file in `launched_pool_directory`)."""
    value = env.get(_POOL_FILE_ENV)
    for i, arg in enumerate(args):
        if arg == "--pool-file":
            value = args[i + 1]
        elif arg.startswith("--pool-file="):
            value = arg.partition("=")[2]
    if value is None:
        return default_pool_file([url], tmp_dir, launched_pool_directory())
    if not value:
        return None
    return default_pool_file([url], tmp_dir) if value == "auto" else Path(value)


def start_daemon(tmp_dir: Path, *args: str, url: str | None = None, ready_timeout: float = 30.0,
                 command_prefix: Sequence[str] = (), serving: bool = True, pool_ready: bool = True,
                 curve: ClientCurve | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> DaemonProcess:
    """Start `lmcache-mp serve --listen URL ARGS...` (under `command_prefix`, e.g. a namespace
    wrapper, when given) and wait until it answers HELLO; with `serving`, until its engine is built
    (before that, everything but HELLO, PING, GET_CHUNK_SIZE and STATUS gets STARTING); with
    `pool_ready`, until its pool's memory is all prepared too (it serves before that, but a STORE
    may find NO_SPACE). `curve`: the keys to ask with, for a daemon that requires CURVE. `env`: variables
    set for the daemon on top of this process's (e.g. its own CUDA_VISIBLE_DEVICES). `cwd`: its
    working directory (this process's by default)."""
    url = url or f"ipc://{tmp_dir / 'daemon.sock'}"
    log_path = tmp_dir / f"daemon-{time.monotonic_ns()}.log"
    env = dict(os.environ, **(env or {}), LMCACHE_MP_RUNTIME_DIR=str(tmp_dir))
    pool_path = _pool_path(url, tmp_dir, args, env)
    if pool_path is not None:
        env.setdefault(_POOL_FILE_ENV, str(pool_path))  # a --pool-file in `args` wins over it
        if not os.path.lexists(pool_path) or "--fresh-pool" in args:
            _made.add(pool_path)
    started_at = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command_prefix, sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen", url, *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
        )
    daemon = DaemonProcess(url, proc, log_path, started_at, pool_path)
    _started.append(daemon)

    def ready(report: StatusReport) -> bool:
        return (report.phase == PHASE_SERVING or not serving) and (report.pool_ready or not pool_ready)

    deadline = time.monotonic() + ready_timeout
    client = MessageQueueClient(url, curve=curve)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{daemon.log()}")
            try:
                client.handshake("tests", timeout_s=0.5)
                if not (serving or pool_ready) or ready(client.submit(RequestType.STATUS, []).result(5)):
                    return daemon
            except LMCacheMPError:
                pass
            if time.monotonic() > deadline:
                daemon.stop(signal.SIGKILL)
                raise RuntimeError(f"daemon not ready in {ready_timeout} s:\n{daemon.log()}")
            time.sleep(0.01)
    finally:
        client.close()


def daemon_status(url: str, timeout_s: float = 10.0) -> StatusReport:
    """One STATUS request to the daemon at `url`."""
    client = MessageQueueClient(url)
    try:
        return client.submit(RequestType.STATUS, []).result(timeout_s)
    finally:
        client.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a daemon's or a server's endpoint;
    one taken meanwhile fails that start, with a clear error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
