"""The soak's schedule (`scripts/soak/soak.py`): when daemon restarts stop, when the chaos stops and
when the load ends. With --min-restarts, a run that has not restarted the daemon that often when its
restart window would close is extended: the three move later together, up to the bound
(--max-duration-s), so that the last daemon still serves its window and the settle time after the
last restart. The clients re-read the end from a file the soak rewrites (`SharedEndTime`): the
load's clock starts once they serve, and the end may move later."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

END_TIME_FILE = "end_time"
# How often a restart in progress pushes the window on: the end stays at least the last daemon's
# window minus this ahead of the clock, and the clients re-read it every second (soak_client.py).
HOLD_OPEN_TICK_S = 0.5


@dataclass
class Schedule:
    start: float  # time.time() at which the load started
    restarts_end: float  # no daemon restart starts after this
    chaos_end: float  # no chaos event (restart, kill, attack) after this
    end_time: float  # the clients stop their load
    planned_end: float
    bound: float  # the end never moves past this
    path: Path  # where the clients read the end time, once the load's clock has started
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def plan(cls, start: float, args: argparse.Namespace, path: Path) -> Schedule:
        end = start + args.duration_s
        return cls(start, end - max(args.settle_s, args.last_daemon_frac * args.duration_s),
                   end - args.settle_s, end, end, start + args.max_duration_s, path)

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start

    @property
    def extension_s(self) -> float:
        return self.end_time - self.planned_end

    @property
    def bound_reached(self) -> bool:
        return self.end_time >= self.bound

    def keep_restarts_until(self, t: float) -> None:
        """Move the restart window's close to `t` at least, the chaos end and the end with it, as
        far as the bound allows; the new end goes to the clients' file."""
        with self.lock:
            shift = min(t - self.restarts_end, self.bound - self.end_time)
            if shift <= 0:
                return
            self.restarts_end += shift
            self.chaos_end += shift
            self.end_time += shift
            self.publish()

    def publish(self) -> None:
        """Write the end time where the clients read it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(f"{self.end_time:.6f}")
        os.replace(tmp, self.path)  # a client reads the old end or the new one, never half

    @contextlib.contextmanager
    def held_open(self) -> Iterator[None]:
        """While a restart runs (stopping a daemon, starting the next and checking what it adopted
        can take half a minute on a busy machine), the window stays open up to now: the clients'
        end keeps the last daemon's window ahead, and the last daemon gets all of it after."""
        done = threading.Event()

        def hold() -> None:
            while not done.wait(HOLD_OPEN_TICK_S):
                self.keep_restarts_until(time.time())

        thread = threading.Thread(target=hold, name="restart window held open")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.keep_restarts_until(time.time())
