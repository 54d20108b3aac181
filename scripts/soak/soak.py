#!/usr/bin/env python
"""Chaos soak: client processes store, look up and retrieve KV through the real daemon while it is
killed, restarted and sent garbage; every byte a RETRIEVE reports loaded is checked.

    .venv/bin/python scripts/soak/soak.py [--duration-s 600] [--clients 4] [--warm-restart] [--out bench-out]

Each client process is a vLLM stand-in: a scheduler adapter and a worker adapter with real
shared-memory CPU caches ("CPU_ATTN"). It loops over a few hundred prompts built from a small set of
shared prefixes plus random suffixes (vLLM-like chained block hashes, the same in every process):
LOOKUP (leasing the hits), RETRIEVE of the hits into poisoned blocks, STORE of the rest,
END_SESSION, then a read-back (LOOKUP + RETRIEVE of the whole prompt). A chunk's content is a
function of its key, so any client can check any chunk, whoever stored it.

Meanwhile the parent's chaos loop, every --chaos-interval-s, SIGKILLs a client (a replacement
starts) and, every other time, restarts the daemon (SIGTERM or SIGKILL, then a new daemon on the
same socket, which adopts the pool file the last one left, with the same disk tier) or freezes it
(SIGSTOP past the clients' timeouts, then SIGCONT). With --warm-restart there is no disk tier:
chunks outlive a restart in the pool file alone, and after each restart every chunk the new daemon
adopted is read back and compared bit for bit, and every prompt whose STORE was acknowledged before
the signal must be there whole (`soak_warm.py`); no restart comes before a client has seen a STORE
acknowledged (one before would adopt nothing). The clients are in `soak_client.py`, the hostile
traffic below in `soak_attacks.py`. A thread sends, every half interval, a burst of malformed
traffic from a raw ZeroMQ socket (garbage frames, unknown types, bad payloads, bad block ids,
unknown instance ids, an oversized message, a registration whose attach channel never opens).
Hostile workers too, each on a schedule of its own: every interval a registered worker
floods CANCEL_TRANSFERS for its own instance past what the daemon keeps per instance (OVERLOADED),
and every other flood names the clients' instances too (FORBIDDEN); a shrinking worker process
registers a fresh cache every interval, tries to ftruncate its memfd (the seal must refuse it), then
serves a round like any client; every other interval, --idle-connections ZeroMQ connections and as
many raw connections to the attach socket say nothing for a while, during which a worker must still
register and STATUS be answered. The run's clock starts once every client has served a prompt.
Restarts stop for the last --last-daemon-frac of the run, all chaos
--settle-s before the end; then the clients stop, their leases are released, and the last daemon's
RSS, open descriptors and leases are compared with a fresh daemon's. With --min-restarts N, a run
that has not restarted the daemon N times when its restart window would close (a restart takes half
a minute on a busy machine) is extended, the restart window, the chaos end and the end moving later
together, up to --max-duration-s (`soak_schedule.py`); the clients read the moved end from a file.

Fails (exit 1) on: any wrong byte served, any request without a reply (a future that did not settle
within its timeout plus a grace period, or a malformed or flooding request the daemon never
answered), a restart after which no client stored and read back a prompt before the next one,
fewer than --min-restarts restarts by --max-duration-s, a daemon traceback, a client's instance
cancelled by another connection, a registered cache shrunk, a registration or STATUS not served
while idle connections were held, an adopted chunk wrong or an acknowledged one lost
(--warm-restart), or resources beyond the tolerances. Prints a report, writes
soak.json and, where matplotlib is installed, soak.png (a timeline) to --out; the exit status is the
checks' either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script or loaded by path by the tests: the soak's own modules sit beside it (the stand-in
# worker and the daemon's launcher come from the installed lmcache_mp.testing).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_attacks import (
    FLOOD_IDS_PER_REQUEST,
    IDLE_HOLD_S,
    CancelFlooder,
    GarbageSender,
    IdleConnections,
    try_status,
)
from soak_client import ClientConfig, client_main
from soak_report import FD_TOLERANCE, RSS_TOLERANCE_MIB, checks_of, print_report, write_report
from soak_schedule import END_TIME_FILE, Schedule
from soak_warm import AdoptionCheck, check_adoption

from lmcache_mp.protocol import RequestType, StatusReport
from lmcache_mp.testing.blocks import CHUNK
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, start_daemon
from lmcache_mp.testing.probes import freeze

# A restart owed (--min-restarts) keeps the window open this long past its turn: the loop looks
# again at least every second, and a client kill before that turn takes a moment.
OWED_MARGIN_S = 2.0
# An extension moves the end while it is at least --settle-s away (less the hold-open tick): the
# clients, reading it again within a second, must never find it already past.
MIN_SETTLE_WITH_EXTENSIONS_S = 2.0
CLIENT_START_DEADLINE_S = 90.0  # spawned Pythons importing torch, on a busy machine


# ---- the daemon and its resources -----------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: float | None
    fds: int | None
    leases: int | None
    ops: int  # operations completed by all clients so far (from their snapshots)


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def fd_count(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.url = f"ipc://{tmp / 'daemon.sock'}"
        # Warm restarts: the pool file alone keeps chunks across restarts (no tier below it).
        tiers: tuple[str, ...] = ()
        if not args.warm_restart:
            (tmp / "disk").mkdir()
            tiers = ("--l2", f"disk://{tmp / 'disk'}?size_gb=1")
        self.daemon_args = ("--chunk-size", str(CHUNK), "--l1-size-gb", str(args.l1_size_gb), *tiers,
                            "--lease-ttl-s", str(args.lease_ttl_s),
                            "--queue-deadline-s", str(min(2.0, args.timeout_s / 2)))
        # The daemon dies with the soak too (setpriv sets its parent-death signal).
        self.prefix = ("setpriv", "--pdeathsig", "KILL") if shutil.which("setpriv") else ()
        self.daemons: list[DaemonProcess] = []
        self.clients: dict[int, mp.process.BaseProcess] = {}
        self.ctx = mp.get_context("spawn")
        self.garbage = GarbageSender(self.url, self.rng)
        self.flooder = CancelFlooder(self.url, args.seed + 1, args.timeout_s + args.grace_s)
        self.idle = IdleConnections(self.url, args.idle_connections, args.timeout_s)
        self.shrinker: mp.process.BaseProcess | None = None
        self.samples: list[Sample] = []
        self.restarts: list[dict] = []
        self.adoption_checks: list[AdoptionCheck] = []
        self.client_kills: list[float] = []
        self.killed: set[int] = set()
        self.acked_seen = False  # with --warm-restart: a client has seen a STORE acknowledged
        self.restarting = threading.Lock()  # held by a restart or freeze, and by each attack (`every`)
        self.stopping = threading.Event()
        self.attack_errors: list[Exception] = []
        self.start = 0.0
        self.clients_start_s = 0.0  # from their launch until each had served a prompt
        self.schedule: Schedule  # planned when the load starts (run)

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    def start_daemon(self) -> None:
        self.daemons.append(start_daemon(self.tmp, *self.daemon_args, url=self.url,
                                         command_prefix=self.prefix))

    def client_config(self, index: int, stem: str, shrink_every_s: float = 0.0) -> ClientConfig:
        a = self.args
        return ClientConfig(index, self.url, a.seed * 1000 + index, a.seed, a.prompts, a.prefixes,
                            self.schedule.end_time, a.timeout_s, a.grace_s, a.freeze_s,
                            str(self.tmp / f"{stem}.json"), str(self.tmp / f"{stem}.pairs"),
                            str(self.tmp / f"{stem}.log"), shrink_every_s,
                            acked_path=str(self.tmp / f"{stem}.acked") if a.warm_restart else "",
                            end_time_path=str(self.schedule.path))

    def start_client(self, index: int, shrink_every_s: float = 0.0) -> mp.process.BaseProcess:
        """A client process; with `shrink_every_s`, the shrinking worker (not in `clients`)."""
        stem = f"client-{'shrinking' if shrink_every_s else index}"
        cfg = self.client_config(index, stem, shrink_every_s)
        proc = self.ctx.Process(target=client_main, args=(cfg,), name=f"soak-{stem}")
        proc.start()
        if not shrink_every_s:
            self.clients[index] = proc
        return proc

    def client_stats(self) -> list[dict]:
        """Every client's, the shrinking worker's included (a worker too, checked alike)."""
        out = []
        for path in sorted(self.tmp.glob("client-*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text()))
        return out

    def sample(self) -> None:
        pid = self.daemon.proc.pid
        report = try_status(self.url)
        ops = sum(sum(v for k, v in s["ops"].items() if k in RequestType.__members__)
                  for s in self.client_stats())
        self.samples.append(Sample(time.time() - self.start, rss_mib(pid), fd_count(pid),
                                   report.leases if report else None, ops))

    # ---- chaos ---------------------------------------------------------------------------------

    def kill_client(self) -> None:
        alive = sorted(i for i, p in self.clients.items() if p.is_alive())
        if not alive:  # they all crashed: the report says so
            return
        index = self.rng.choice(alive)
        self.killed.add(index)
        self.clients[index].kill()
        self.clients[index].join(10)
        self.client_kills.append(time.time() - self.start)
        self.start_client(max(self.clients) + 1)

    def restarts_done(self) -> int:
        """Daemon restarts completed, SIGTERM or SIGKILL (not freezes)."""
        return sum(r["signal"] != "SIGSTOP" for r in self.restarts)

    def restarts_owed(self) -> bool:
        return self.restarts_done() < self.args.min_restarts

    def something_to_adopt(self) -> bool:
        """With --warm-restart, whether a client has seen a STORE acknowledged: a restart before
        that (the clients take a while to start on a busy machine) would adopt nothing to check."""
        if not self.args.warm_restart or self.acked_seen:
            return True
        self.acked_seen = any(p.stat().st_size for p in self.tmp.glob("client-*.acked"))
        return self.acked_seen

    def restart_daemon(self) -> None:
        sig = self.rng.choice((signal.SIGTERM, signal.SIGKILL))
        # With --min-restarts, however long it takes, the last daemon gets its whole window after.
        held_open = self.schedule.held_open() if self.args.min_restarts else contextlib.nullcontext()
        with held_open, self.restarting:
            killed = time.time()
            exit_code = self.daemon.stop(sig, timeout=30, keep_pool=True)  # the next daemon adopts it
            stopped = time.time()
            self.start_daemon()
            ready = time.time()
            if self.args.warm_restart:  # the clients go on meanwhile; the attacks wait
                index = -2 - len(self.adoption_checks)  # a client index no client process has
                cfg = self.client_config(index, f"warm-check-{len(self.adoption_checks)}")
                self.adoption_checks.append(check_adoption(cfg, self.tmp, killed - self.start, sig.name,
                                                           killed))
        self.restarts.append({"t": killed - self.start, "signal": sig.name, "exit_code": exit_code,
                              "stop_s": stopped - killed, "down_s": ready - killed,
                              "killed": killed, "ready": ready})

    def freeze_daemon(self) -> None:
        """SIGSTOP the daemon past the clients' timeouts, then SIGCONT: it wakes up to requests
        whose clients gave up on them. Listed with the restarts (signal SIGSTOP)."""
        with self.restarting:
            frozen = time.time()
            freeze(self.daemon.proc)
            time.sleep(self.args.freeze_s)
            self.daemon.proc.send_signal(signal.SIGCONT)
            thawed = time.time()
        self.restarts.append({"t": frozen - self.start, "signal": "SIGSTOP", "exit_code": None,
                              "stop_s": 0.0, "down_s": thawed - frozen, "killed": frozen, "ready": thawed})

    def chaos_loop(self) -> None:
        """SIGKILL a client every other event; in between, restart the daemon or freeze it
        (restarts only before the last daemon's window, which moves later while --min-restarts
        are owed); malformed traffic and the hostile workers' attacks come from threads of their
        own meanwhile."""
        a = self.args
        next_chaos = time.time() + a.chaos_interval_s
        hold_s = min(IDLE_HOLD_S, a.chaos_interval_s / 2)
        attacks = [
            self.every("garbage", a.chaos_interval_s / 2,
                       lambda instances: self.garbage.burst(instances, a.timeout_s + a.grace_s)),
            self.every("cancel flood", a.chaos_interval_s, self.flooder.flood),
            self.every("idle connections", 2 * a.chaos_interval_s, lambda _: self.idle.hold(hold_s),
                       prepare=self.idle.prepare),
        ]
        tick = 0
        try:
            while time.time() < self.schedule.end_time:
                time.sleep(min(1.0, max(0.0, self.schedule.end_time - time.time())))
                self.sample()
                owed = self.restarts_owed()
                if owed:  # the window stays open until the next restart's turn (odd ticks)
                    next_restart = next_chaos + (0.0 if tick % 2 else a.chaos_interval_s)
                    self.schedule.keep_restarts_until(next_restart + OWED_MARGIN_S)
                if time.time() < next_chaos or time.time() > self.schedule.chaos_end:
                    continue
                can_restart = time.time() < self.schedule.restarts_end and self.something_to_adopt()
                can_freeze = a.freeze_s > 0 and time.time() + a.freeze_s < self.schedule.chaos_end
                if tick % 2 and can_freeze and not owed and (tick % 4 == 3 or not can_restart):
                    self.freeze_daemon()
                elif tick % 2 and can_restart:
                    self.restart_daemon()
                else:
                    self.kill_client()
                tick += 1
                next_chaos = time.time() + a.chaos_interval_s
        finally:
            self.stopping.set()
            for thread in attacks:
                thread.join()
        if self.attack_errors:
            raise self.attack_errors[0]

    def every(self, name: str, period_s: float, attack: Callable[[list[int]], None],
              prepare: Callable[[], None] = lambda: None) -> threading.Thread:
        """A thread that runs `attack(the registered instance ids)` every `period_s` until the
        chaos end (which may move later: the thread lives until the loop stops), never across a
        restart or a freeze (it holds the lock they take: the replies to requests in flight die
        with a daemon, and a frozen one answers nothing); `prepare()` first, without the lock."""
        def loop() -> None:
            try:
                while not self.stopping.wait(period_s):
                    if time.time() >= self.schedule.chaos_end:
                        continue
                    prepare()
                    with self.restarting:
                        report = try_status(self.url)
                        attack(report.registered_instances if report else [])
            except Exception as err:  # handed to the main thread, which fails the run with it
                self.attack_errors.append(err)

        thread = threading.Thread(target=loop, name=name)
        thread.start()
        return thread

    def timeouts_while_up(self, stats: list[dict]) -> int:
        """Client timeouts that no restart explains: the request was sent while the daemon was
        up, and it was not killed within the request's timeout (nor just restarted: a client's
        socket takes a moment to reconnect)."""
        windows = [(r["killed"] - self.args.timeout_s, r["ready"] + 1.0) for r in self.restarts]
        return sum(1 for s in stats for sent in s["timeouts_sent_at"]
                   if not any(lo <= sent <= hi for lo, hi in windows))

    # ---- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        self.start_daemon()
        time.sleep(1.0)  # let the fresh daemon settle before its baseline
        base_pid = self.daemon.proc.pid
        baseline = {"rss_mib": rss_mib(base_pid), "fds": fd_count(base_pid),
                    "leases": daemon_status(self.url).leases}
        # Until the load's clock starts, the clients' end is the latest it can be; then the file says.
        launched = time.time()
        self.schedule = Schedule.plan(launched + CLIENT_START_DEADLINE_S, a, self.tmp / END_TIME_FILE)
        for index in range(a.clients):
            self.start_client(index)
        self.shrinker = self.start_client(-1, shrink_every_s=a.chaos_interval_s)
        self.wait_clients_serving(launched + CLIENT_START_DEADLINE_S)
        self.start = time.time()
        self.clients_start_s = self.start - launched
        self.schedule = Schedule.plan(self.start, a, self.tmp / END_TIME_FILE)
        self.schedule.publish()
        self.chaos_loop()
        hung, crashed = self.stop_clients()
        report = self.wait_idle()
        pid = self.daemon.proc.pid
        end = {"rss_mib": rss_mib(pid), "fds": fd_count(pid), "leases": report.leases if report else None,
               "registered_instances": len(report.registered_instances) if report else None,
               "daemon_uptime_s": report.uptime_s if report else None}
        self.sample()
        final_exit = self.daemon.stop(signal.SIGTERM, timeout=30)
        return self.figures(baseline, end, (hung, crashed), final_exit)

    def wait_clients_serving(self, deadline: float) -> None:
        """Until every client has served its first prompt (its first snapshot), has died, or the
        deadline: the load's clock starts then, not while they import torch (40 s on a busy
        machine, and chaos meanwhile would only kill clients that never ran)."""
        def starting() -> bool:
            return any(p.is_alive() and not (self.tmp / f"client-{i}.json").exists()
                       for i, p in self.clients.items())

        while starting() and time.time() < deadline:
            time.sleep(0.1)

    def stop_clients(self) -> tuple[int, int]:
        """Clients stop on their own at the end time; any still running long after is hung.
        Returns (hung, crashed: exited non-zero without being killed by the chaos)."""
        deadline = self.schedule.end_time + 2 * (self.args.timeout_s + self.args.grace_s) + 30
        hung = 0
        survivors = [p for i, p in self.clients.items() if i not in self.killed]
        if self.shrinker is not None:  # a client too, never killed by the chaos
            survivors.append(self.shrinker)
        for proc in survivors:
            proc.join(max(0.0, deadline - time.time()))
            if proc.is_alive():
                hung += 1
                proc.kill()
                proc.join(10)
        crashed = sum(1 for p in survivors if p.exitcode != 0)
        return hung, crashed - hung  # a hung client was killed here: not counted twice

    def wait_idle(self) -> StatusReport | None:
        """Until no lease or registration is left: the killed clients' leases expire after the TTL."""
        deadline = time.time() + self.args.lease_ttl_s + 15
        report = try_status(self.url)
        while time.time() < deadline and (report is None or report.leases or report.registered_instances):
            time.sleep(0.5)
            report = try_status(self.url)
        return report

    def recoveries(self) -> list[dict]:
        """For each restart: the first store+read-back pair whose STORE was sent after the new
        daemon answered, if it came before the next restart."""
        pairs: list[tuple[float, float]] = []
        for path in self.tmp.glob("client-*.pairs"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    stored, done = map(float, line.split())
                    pairs.append((stored, done))
        out = []
        for i, r in enumerate(self.restarts):
            until = self.restarts[i + 1]["ready"] if i + 1 < len(self.restarts) else self.schedule.end_time
            done = [d for s, d in pairs if s >= r["ready"] and d <= until]
            row = {k: v for k, v in r.items() if k not in ("killed", "ready")}
            row["recovery_s"] = min(done) - r["ready"] if done else None
            out.append(row)
        return out

    def figures(self, baseline: dict, end: dict, hung_crashed: tuple[int, int], final_exit: int) -> dict:
        stats = self.client_stats()
        ops: Counter = Counter()
        errors: Counter = Counter()
        for s in stats:
            ops.update(s["ops"])
            errors.update(s["errors"])
        logs = [d.log() for d in self.daemons]
        wrong_keys = {k for s in stats for k in s["wrong_keys"]}
        timed_out = {k for s in stats for k in s["timed_out_store_keys"]}
        return {
            "config": {k: v for k, v in vars(self.args).items() if k not in ("out", "json")},
            "planned_duration_s": self.args.duration_s,
            "duration_s": self.schedule.duration_s,  # of the load: with --min-restarts, maybe extended
            "extension_s": self.schedule.extension_s,
            "clients_start_s": self.clients_start_s,  # before the load's clock started
            "min_restarts": {"required": self.args.min_restarts, "done": self.restarts_done(),
                             "max_duration_s": self.args.max_duration_s,
                             "bound_reached": self.schedule.bound_reached},
            "ops": dict(ops),
            "errors": dict(errors),
            "wrong_chunks": sum(s["wrong_chunks"] for s in stats),
            "wrong_bytes": sum(s["wrong_bytes"] for s in stats),
            "wrong_examples": [e for s in stats for e in s["wrong_examples"]],
            "wrong_keys": len(wrong_keys),
            "wrong_keys_stored_by_a_timed_out_store": len(wrong_keys & timed_out),
            "unreplied": sum(s["unreplied"] for s in stats),
            "timeouts_while_daemon_up": self.timeouts_while_up(stats),
            "other_reasons": [e for s in stats for e in s["other_reasons"]],
            "clients_started": len(self.clients),
            "clients_killed": len(self.client_kills),
            "clients_hung": hung_crashed[0],
            "clients_crashed": hung_crashed[1],
            "clients_exited_cleanly": sum(s["clean_exit"] for s in stats),
            "garbage": {"sent": self.garbage.sent, "unreplied": self.garbage.unreplied_kinds.total(),
                        "unreplied_kinds": dict(self.garbage.unreplied_kinds),
                        "oversized_sent": self.garbage.oversized,
                        "replies": dict(self.garbage.replies)},
            "attacks": {
                "cancel_flood": {"floods": self.flooder.floods, "ids_per_request": FLOOD_IDS_PER_REQUEST,
                                 "answers": dict(self.flooder.answers), "unanswered": self.flooder.unanswered,
                                 "failures": self.flooder.failures},
                "shrinking_worker": {"exit_code": self.shrinker.exitcode if self.shrinker else None,
                                     "outcomes": dict(sum((Counter(s["shrink"]) for s in stats), Counter()))},
                "idle_connections": {"rounds": self.idle.rounds, "per_round": self.idle.count,
                                     "opened": dict(self.idle.opened),
                                     "attach_closed_by_daemon": self.idle.closed_by_daemon,
                                     "served_meanwhile": dict(self.idle.served),
                                     "rounds_put_off": self.idle.probe_late,
                                     "registration_s_max": max(self.idle.registration_s, default=None),
                                     "failures": self.idle.failures},
            },
            "restarts": self.recoveries(),
            "warm_restart": ({"checks": [asdict(c) for c in self.adoption_checks]}
                             if self.args.warm_restart else None),
            "daemon_tracebacks": sum(log.count("Traceback") for log in logs),
            "final_daemon_exit_code": final_exit,
            "resources": {"start": baseline, "end": end,
                          "tolerance": {"rss_mib": RSS_TOLERANCE_MIB, "fds": FD_TOLERANCE, "leases": 0}},
            "timeline": [asdict(s) for s in self.samples],
            "client_kill_times_s": self.client_kills,
        }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0,
                        help="how long the clients run their load (the chaos stops --settle-s earlier)")
    parser.add_argument("--clients", type=int, default=4,
                        help="client processes at any time (scheduler + worker adapter pair each)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the prompts, the clients' choices and the chaos; same seed, same plan")
    parser.add_argument("--chaos-interval-s", type=float, default=10.0,
                        help="seconds between chaos events; each sends a burst of malformed requests, "
                        "then alternately SIGKILLs a client or restarts the daemon")
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="no chaos in the last seconds of the load, so the last restart can recover")
    parser.add_argument("--last-daemon-frac", type=float, default=0.5,
                        help="no daemon restart in this last fraction of the load: the last daemon serves "
                        "that long (client kills and malformed traffic go on) before its idle RSS and "
                        "descriptors are compared with a fresh daemon's")
    parser.add_argument("--min-restarts", type=int, default=0,
                        help="daemon restarts (SIGTERM or SIGKILL, freezes not counted) the run must make: "
                        "while fewer have completed when the restart window would close, the window, the "
                        "chaos end and the end move later together (a restart in progress holds them "
                        "open), so that the last daemon still gets its window and --settle-s after the "
                        "last restart; a run that reaches --max-duration-s first ends there and fails. "
                        "0: a fixed schedule")
    parser.add_argument("--max-duration-s", type=float, default=None,
                        help="the load never runs past this, however many restarts are owed; "
                        "default 3 x --duration-s")
    parser.add_argument("--freeze-s", type=float, default=None,
                        help="how long a freeze (SIGSTOP ... SIGCONT) of the daemon lasts; default "
                        "3 x --timeout-s + 1, so each client gives up on a few requests in a row and "
                        "reuses their blocks meanwhile; 0: no freezes")
    parser.add_argument("--prompts", type=int, default=300, help="distinct prompts the clients draw from")
    parser.add_argument("--prefixes", type=int, default=8,
                        help="shared 2-chunk prefixes the prompts start with")
    parser.add_argument("--l1-size-gb", type=float, default=None,
                        help="the daemon's CPU pool; default 0.01, small, so chunks are evicted and read "
                        "up from disk; with --warm-restart 0.1, large enough that nothing is evicted")
    parser.add_argument("--warm-restart", action="store_true",
                        help="no disk tier: chunks survive a restart in the daemon's pool file alone; after "
                        "each restart every chunk the new daemon adopted is compared bit for bit, and every "
                        "prompt whose STORE was acknowledged before the signal must be there whole")
    parser.add_argument("--lease-ttl-s", type=float, default=5.0,
                        help="the daemon's lease TTL: how long a killed client's leases outlive it")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="the adapters' request timeout: a request's future settles within it")
    parser.add_argument("--grace-s", type=float, default=5.0,
                        help="past timeout + grace, a future that has not settled counts as unreplied")
    parser.add_argument("--idle-connections", type=int, default=16,
                        help="idle ZeroMQ connections, and as many raw connections to the attach socket, "
                        "held every other chaos interval")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="where to write soak.json and soak.png (the chart: with matplotlib only)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures (JSON) here")
    args = parser.parse_args()
    if args.l1_size_gb is None:
        args.l1_size_gb = 0.1 if args.warm_restart else 0.01
    if args.freeze_s is None:
        args.freeze_s = 3 * args.timeout_s + 1
    if args.max_duration_s is None:
        args.max_duration_s = 3 * args.duration_s
    if args.max_duration_s < args.duration_s:
        parser.error("--max-duration-s is shorter than --duration-s")
    if args.min_restarts and args.settle_s < MIN_SETTLE_WITH_EXTENSIONS_S:
        parser.error(f"--min-restarts needs --settle-s of {MIN_SETTLE_WITH_EXTENSIONS_S} s at least: "
                     "the clients read a moved end once a second")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lmc-soak-", dir="/tmp"))
    soak = Soak(args, tmp)
    # SIGTERM ends the soak like Ctrl-C: through the finally below, which stops every child.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        figures = soak.run()
    finally:
        for proc in [*soak.clients.values(), *([soak.shrinker] if soak.shrinker else [])]:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for daemon in soak.daemons:
            if daemon.proc.poll() is None:
                daemon.stop(signal.SIGKILL)
    print_report(figures)
    checks = checks_of(figures)
    figures["checks"] = checks
    write_report(args, checks, figures)
    if all(checks.values()):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"daemon and client logs kept in {tmp}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
