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
the signal must be there whole (`soak_warm.py`). The clients are in `soak_client.py`, the hostile
traffic below in `soak_attacks.py`. A thread sends, every half interval, a burst of malformed
traffic from a raw ZeroMQ socket (garbage frames, unknown types, bad payloads, bad block ids,
unknown instance ids, an oversized message, a registration whose attach channel never opens).
Hostile workers too, each on a schedule of its own: every interval a registered worker
floods CANCEL_TRANSFERS for its own instance past what the daemon keeps per instance (OVERLOADED),
and every other flood names the clients' instances too (FORBIDDEN); a shrinking worker process
registers a fresh cache every interval, tries to ftruncate its memfd (the seal must refuse it), then
serves a round like any client; every other interval, --idle-connections ZeroMQ connections and as
many raw connections to the attach socket say nothing for a while, during which a worker must still
register and STATUS be answered. Restarts stop for the last --last-daemon-frac of the run, all chaos
--settle-s before the end; then the clients stop, their leases are released, and the last daemon's
RSS, open descriptors and leases are compared with a fresh daemon's.

Fails (exit 1) on: any wrong byte served, any request without a reply (a future that did not settle
within its timeout plus a grace period, or a malformed or flooding request the daemon never
answered), a restart after which no client stored and read back a prompt before the next one, a
daemon traceback, a client's instance cancelled by another connection, a registered cache shrunk, a
registration or STATUS not served while idle connections were held, an adopted chunk wrong or an
acknowledged one lost (--warm-restart), or resources beyond the tolerances. Prints a report, writes
soak.json and, where matplotlib is installed, soak.png (a timeline) to --out; the exit status is the
checks' either way.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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
from soak_client import SHRINK_NOT_TRIED, SHRINK_REFUSED, ClientConfig, client_main
from soak_warm import AdoptionCheck, check_adoption

from lmcache_mp.protocol import RequestType, StatusReport
from lmcache_mp.testing.blocks import CHUNK
from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, start_daemon
from lmcache_mp.testing.probes import freeze

# Resource tolerances, idle fresh daemon vs idle daemon after the load: the daemon's RSS settles
# within a few MiB (allocator caches, imported code paths); a descriptor or two may be an
# epoll/eventfd that libzmq creates lazily on the first connection.
RSS_TOLERANCE_MIB = 48.0
FD_TOLERANCE = 4


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
        self.restarting = threading.Lock()  # held by a restart or freeze, and by each attack (`every`)
        self.stopping = threading.Event()
        self.attack_errors: list[Exception] = []
        self.start = 0.0
        self.end_time = 0.0

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    def start_daemon(self) -> None:
        self.daemons.append(start_daemon(self.tmp, *self.daemon_args, url=self.url,
                                         command_prefix=self.prefix))

    def client_config(self, index: int, stem: str, shrink_every_s: float = 0.0) -> ClientConfig:
        a = self.args
        return ClientConfig(index, self.url, a.seed * 1000 + index, a.seed, a.prompts, a.prefixes,
                            self.end_time, a.timeout_s, a.grace_s, a.freeze_s,
                            str(self.tmp / f"{stem}.json"), str(self.tmp / f"{stem}.pairs"),
                            str(self.tmp / f"{stem}.log"), shrink_every_s,
                            acked_path=str(self.tmp / f"{stem}.acked") if a.warm_restart else "")

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

    def restart_daemon(self) -> None:
        sig = self.rng.choice((signal.SIGTERM, signal.SIGKILL))
        with self.restarting:
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
        (restarts only before the last daemon's window); malformed traffic and the hostile
        workers' attacks come from threads of their own meanwhile."""
        a = self.args
        next_chaos = time.time() + a.chaos_interval_s
        chaos_end = self.end_time - a.settle_s
        restarts_end = self.end_time - max(a.settle_s, a.last_daemon_frac * a.duration_s)
        hold_s = min(IDLE_HOLD_S, a.chaos_interval_s / 2)
        attacks = [
            self.every("garbage", a.chaos_interval_s / 2, chaos_end,
                       lambda instances: self.garbage.burst(instances, a.timeout_s + a.grace_s)),
            self.every("cancel flood", a.chaos_interval_s, chaos_end, self.flooder.flood),
            self.every("idle connections", 2 * a.chaos_interval_s, chaos_end,
                       lambda _: self.idle.hold(hold_s)),
        ]
        tick = 0
        try:
            while time.time() < self.end_time:
                time.sleep(min(1.0, max(0.0, self.end_time - time.time())))
                self.sample()
                if time.time() < next_chaos or time.time() > chaos_end:
                    continue
                can_restart = time.time() < restarts_end
                can_freeze = a.freeze_s > 0 and time.time() + a.freeze_s < chaos_end
                if tick % 2 and can_freeze and (tick % 4 == 3 or not can_restart):
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

    def every(self, name: str, period_s: float, until: float,
              attack: Callable[[list[int]], None]) -> threading.Thread:
        """A thread that runs `attack(the registered instance ids)` every `period_s` until `until`,
        never across a restart or a freeze (it holds the lock they take: the replies to requests
        in flight die with a daemon, and a frozen one answers nothing)."""
        def loop() -> None:
            try:
                while not self.stopping.wait(period_s) and time.time() < until:
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
        self.start = time.time()
        self.end_time = self.start + a.duration_s
        for index in range(a.clients):
            self.start_client(index)
        self.shrinker = self.start_client(-1, shrink_every_s=a.chaos_interval_s)
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

    def stop_clients(self) -> tuple[int, int]:
        """Clients stop on their own at the end time; any still running long after is hung.
        Returns (hung, crashed: exited non-zero without being killed by the chaos)."""
        deadline = self.end_time + 2 * (self.args.timeout_s + self.args.grace_s) + 30
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
            until = self.restarts[i + 1]["ready"] if i + 1 < len(self.restarts) else self.end_time
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
            "duration_s": self.args.duration_s,
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


def warm_checks_of(f: dict) -> dict[str, bool]:
    """With --warm-restart: every restart's adopted chunks checked, none wrong, none lost."""
    if f["warm_restart"] is None:
        return {}
    checks = f["warm_restart"]["checks"]
    restarts = [r for r in f["restarts"] if r["signal"] != "SIGSTOP"]
    verified = sum(c["chunks_verified"] for c in checks)
    wrong = sum(c["wrong_bytes"] for c in checks)
    lost = sum(c["lost_chunks"] for c in checks)
    failed = [line for c in checks for line in c["failed"]]
    return {
        f"every restart's adopted chunks read back ({len(checks)} checks of {len(restarts)} restarts, "
        f"{verified} chunks verified, {len(failed)} reads not completed)":
            len(checks) == len(restarts) and verified > 0 and not failed,
        f"0 wrong bytes in adopted chunks ({wrong})": wrong == 0,
        f"0 acknowledged chunks lost by a restart ({lost})": lost == 0,
    }


def checks_of(f: dict) -> dict[str, bool]:
    start, end = f["resources"]["start"], f["resources"]["end"]
    recovered = [r["recovery_s"] for r in f["restarts"]]
    rss_growth = (end["rss_mib"] or 1e9) - (start["rss_mib"] or 0)
    fd_growth = (end["fds"] or 10**9) - (start["fds"] or 0)
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    forbidden = sum(n for k, n in flood["answers"].items() if k.startswith("a client's"))
    shrinks = shrink["outcomes"]
    return {
        f"work was done ({f['ops'].get('STORE ok', 0)} stores, {f['ops'].get('RETRIEVE ok', 0)} retrieves, "
        f"{f['ops'].get('chunks verified', 0)} chunks verified)":
            f["ops"].get("STORE ok", 0) > 0 and f["ops"].get("chunks verified", 0) > 0,
        f"0 wrong bytes served ({f['wrong_bytes']} in {f['wrong_chunks']} chunks)": f["wrong_bytes"] == 0,
        f"0 requests without a reply ({f['unreplied']} client, {f['garbage']['unreplied']} malformed, "
        f"{flood['unanswered']} CANCEL_TRANSFERS of the flood)":
            f["unreplied"] == 0 and f["garbage"]["unreplied"] == 0 and flood["unanswered"] == 0,
        f"CANCEL_TRANSFERS floods answered as bounded ({flood['floods']} floods; {forbidden} for a client's "
        f"instance; {len(flood['failures'])} answers other than a count, OVERLOADED or FORBIDDEN)":
            not flood["failures"],
        f"every ftruncate of a registered cache refused ({shrinks.get(SHRINK_REFUSED, 0)} of "
        f"{sum(n for k, n in shrinks.items() if k != SHRINK_NOT_TRIED)}; exit {shrink['exit_code']})":
            set(shrinks) <= {SHRINK_REFUSED, SHRINK_NOT_TRIED} and shrink["exit_code"] == 0,
        f"served while idle connections were held ({idle['served_meanwhile']} in {idle['rounds']} rounds)":
            not idle["failures"] and idle["served_meanwhile"].get("STATUS failed", 0) == 0,
        f"no timeout while the daemon was up ({f['timeouts_while_daemon_up']})":
            f["timeouts_while_daemon_up"] == 0,
        f"no client hung or crashed ({f['clients_hung']} hung, {f['clients_crashed']} crashed)":
            f["clients_hung"] == 0 and f["clients_crashed"] == 0,
        f"recovered after every restart ({sum(r is not None for r in recovered)} of {len(recovered)})":
            all(r is not None for r in recovered),
        f"no daemon traceback ({f['daemon_tracebacks']})": f["daemon_tracebacks"] == 0,
        f"daemon RSS flat ({start['rss_mib']:.0f} -> {end['rss_mib'] or 0:.0f} MiB, "
        f"tolerance +{RSS_TOLERANCE_MIB:.0f})": rss_growth <= RSS_TOLERANCE_MIB,
        f"daemon fds flat ({start['fds']} -> {end['fds']}, tolerance +{FD_TOLERANCE})":
            fd_growth <= FD_TOLERANCE,
        f"no lease left ({start['leases']} -> {end['leases']})": end["leases"] == 0,
        f"no registration left ({end['registered_instances']})": end["registered_instances"] == 0,
        f"final daemon stopped cleanly by SIGTERM (exit {f['final_daemon_exit_code']})":
            f["final_daemon_exit_code"] == 0,
        **warm_checks_of(f),
    }


def print_report(f: dict) -> None:
    print(f"\nsoak of {f['duration_s']:.0f} s, {f['clients_started']} client processes started, "
          f"{f['clients_killed']} SIGKILLed")
    print(f"\n{'operation':<28}{'count':>10}")
    for name, count in sorted(f["ops"].items()):
        print(f"{name:<28}{count:>10}")
    if f["errors"]:
        print(f"\n{'failed (typed) operation':<40}{'count':>8}")
        for name, count in sorted(f["errors"].items()):
            print(f"{name:<40}{count:>8}")
    g = f["garbage"]
    print(f"\nmalformed requests: {g['sent']} sent, {g['unreplied']} unanswered, replies {g['replies']}; "
          f"{g['oversized_sent']} oversized (no reply expected)")
    if g["unreplied_kinds"]:
        print(f"   unanswered: {g['unreplied_kinds']}")
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    print(f"cancel floods: {flood['floods']} ({flood['ids_per_request']} request ids a CANCEL_TRANSFERS), "
          f"answers {flood['answers']}")
    print(f"shrinking worker: {shrink['outcomes']}")
    reg_s = idle["registration_s_max"]
    print(f"idle connections: {idle['rounds']} rounds of {idle['per_round']} ZeroMQ + {idle['per_round']} "
          f"attach (opened {idle['opened']}, {idle['attach_closed_by_daemon']} attach closed by the daemon "
          f"first); served meanwhile {idle['served_meanwhile']}"
          + (f", registration within {reg_s:.2f} s" if reg_s is not None else ""))
    for line in flood["failures"] + idle["failures"]:
        print("  ", line)
    # down: from the signal until the new daemon answered HELLO (stop: until the old one exited);
    # recovery: from then until a client's first STORE + read-back of a prompt.
    print(f"\n{'restart at s':>12}{'signal':>9}{'exit':>6}{'stop s':>8}{'down s':>8}{'recovery s':>12}")
    for r in f["restarts"]:
        rec = "NEVER" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        print(f"{r['t']:>12.1f}{r['signal']:>9}{r['exit_code']!s:>6}{r['stop_s']:>8.2f}{r['down_s']:>8.2f}"
              f"{rec:>12}")
    if f["warm_restart"] is not None:
        print_adoption_checks(f["warm_restart"]["checks"])
    start, end = f["resources"]["start"], f["resources"]["end"]
    print(f"\ndaemon at start (fresh) / at end (idle, uptime {end['daemon_uptime_s'] or 0:.0f} s): "
          f"RSS {start['rss_mib']:.1f} / {end['rss_mib'] or 0:.1f} MiB, fds {start['fds']} / {end['fds']}, "
          f"leases {start['leases']} / {end['leases']}")
    if f["wrong_chunks"]:
        print(f"\nwrong chunks served: {f['wrong_chunks']}, under {f['wrong_keys']} distinct keys, "
              f"{f['wrong_keys_stored_by_a_timed_out_store']} of which a STORE that timed out had sent "
              "(the daemon may have run it later, reading blocks the client had reused)")
    for line in f["wrong_examples"] + f["other_reasons"]:
        print("  ", line)


def print_adoption_checks(checks: list[dict]) -> None:
    """Each warm restart: what the new daemon adopted, and what reading it all back found."""
    print(f"\n{'restart at s':>12}{'signal':>9}{'adopted':>9}{'unsealed':>9}{'dropped':>8}{'acked':>7}"
          f"{'verified':>9}{'wrong B':>8}{'lost':>6}{'check s':>8}")
    for c in checks:
        print(f"{c['t']:>12.1f}{c['signal']:>9}{c['adopted_chunks']:>9}{c['adopted_unsealed']:>9}"
              f"{c['dropped_chunks']:>8}{c['acked_prompts']:>7}{c['chunks_verified']:>9}{c['wrong_bytes']:>8}"
              f"{c['lost_chunks']:>6}{c['check_s']:>8.2f}")
        for line in c["failed"] + c["examples"]:
            print("  ", line)


RESTART_STYLES = {"SIGKILL": ("red", "-"), "SIGTERM": ("red", "--"), "SIGSTOP": ("purple", "-")}


def plot(f: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = f["timeline"]
    t = [s["t"] for s in tl]
    rate = [0.0] + [(b["ops"] - a["ops"]) / max(1e-9, b["t"] - a["t"]) for a, b in itertools.pairwise(tl)]
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    series = (("operations/s (all clients)", rate), ("daemon RSS (MiB)", [s["rss_mib"] for s in tl]),
              ("daemon open fds", [s["fds"] for s in tl]), ("leases", [s["leases"] for s in tl]))
    for ax, (label, ys) in zip(axes, series, strict=True):
        ax.plot(t, [float("nan") if y is None else y for y in ys], linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        for r in f["restarts"]:
            color, style = RESTART_STYLES[r["signal"]]
            ax.axvline(r["t"], color=color, linewidth=0.8, linestyle=style)
        for k in f["client_kill_times_s"]:
            ax.axvline(k, color="gray", linewidth=0.6, linestyle=":")
    axes[-1].set_xlabel("seconds (daemon: red SIGKILL, dashed red SIGTERM, purple freeze; "
                        "gray: client SIGKILL)",
                        fontsize=8)
    axes[0].set_title("lmcache-mp chaos soak")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(args: argparse.Namespace, checks: dict[str, bool], figures: dict) -> None:
    """The verdicts; the figures as JSON, always; the chart only where matplotlib is installed
    (a machine without it still gets the figures, and the exit status of the checks)."""
    print()
    for name, ok in checks.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    written = [args.out / "soak.json", *([args.json] if args.json else [])]
    for path in written:
        path.write_text(json.dumps(figures, indent=2))
    try:
        import matplotlib  # noqa: F401  (only the chart needs it)
    except ImportError as err:
        print(f"\nchart skipped: matplotlib cannot be imported ({err})")
    else:
        plot(figures, args.out / "soak.png")
        written.append(args.out / "soak.png")
    print(f"\nwrote {', '.join(map(str, written))}")


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
