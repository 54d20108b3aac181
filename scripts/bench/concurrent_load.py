"""Load generation for bench_concurrent.py: the multi-turn workload, the lock-step driver (every turn
to both sides' server k at once) and the closed-loop driver (one side alone, at full load)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench_serving import ANSWER_TOKENS, MESSAGE_TOKENS, VOCAB_IDS
from harness import percentile
from harness.api_server import ApiServer, Completion, stream_completion

SIDES = ("connector", "baseline")
PAIRS = 2  # server pairs (connector k, baseline k)


@dataclass(frozen=True)
class Workload:
    contexts: list[list[int]]  # per session
    messages: list[list[list[int]]]  # per session, per turn
    arrivals: list[float]  # per session: seconds after the start
    thinks: list[list[float]]  # per session, per turn: seconds after the previous answers
    routes: list[list[int]]  # per session, per turn: the server pair
    warmup: list[int]  # one untimed request per server first, shared with no session
    answer_tokens: int = ANSWER_TOKENS  # every answer's length (greedy, ignore_eos)

    @property
    def sessions(self) -> int:
        return len(self.contexts)

    @property
    def turns(self) -> int:
        return len(self.messages[0]) if self.messages else 0

    def final_tokens(self, session: int) -> int:
        """The session's conversation after its last answer (answers have a fixed length)."""
        msgs = self.messages[session]
        return len(self.contexts[session]) + sum(map(len, msgs)) + len(msgs) * self.answer_tokens

    def working_set(self) -> int:
        """Tokens of every session's whole conversation: what a cache must hold to miss nothing."""
        return sum(self.final_tokens(s) for s in range(self.sessions))

    def longest(self) -> int:
        return max(self.final_tokens(s) for s in range(self.sessions))


def make_workload(sessions: int, turns: int, context: int, mean_gap_s: float, think_s: float,
                  seed: int = 0, answer_tokens: int = ANSWER_TOKENS) -> Workload:
    """Random-token contexts (`context` +-25%) and messages; Poisson arrivals and exponential think
    times (none where the mean is 0); each turn's server pair at random. All from `seed`."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB_IDS) for _ in range(n)]

    contexts = [tokens(rng.randint(context * 3 // 4, context * 5 // 4)) for _ in range(sessions)]
    messages = [[tokens(rng.randint(*MESSAGE_TOKENS)) for _ in range(turns)] for _ in range(sessions)]
    gaps = [rng.expovariate(1 / mean_gap_s) if mean_gap_s > 0 else 0.0 for _ in range(sessions)]
    arrivals = [sum(gaps[:i]) for i in range(sessions)]  # the first session starts at once
    thinks = [[rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(turns)]
              for _ in range(sessions)]
    routes = [[rng.randrange(PAIRS) for _ in range(turns)] for _ in range(sessions)]
    return Workload(contexts, messages, arrivals, thinks, routes, tokens(context), answer_tokens)


@dataclass
class Turn:
    """One turn of one session as every side that was sent it answered it."""

    session: int
    turn: int
    pair: int
    cross: bool  # a returning turn on a server pair that never served its session before
    sent_s: float  # after the load's start
    prompt_tokens: int
    done: dict[str, Completion]  # per side

    def describe(self) -> str:
        kind = "first" if not self.turn else "cross" if self.cross else "same"
        sides = "; ".join(f"{side} " + (f"ERROR {c.error}" if c.error else
                                        f"TTFT {c.ttft_s * 1e3:.0f} ms cached {c.cached_tokens}")
                          for side, c in self.done.items())
        return (f"session {self.session} turn {self.turn} ({kind}, {self.prompt_tokens} tokens) "
                f"-> pair {self.pair}: {sides}")

    def as_json(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn, "pair": self.pair, "cross_engine": self.cross,
                "sent_s": self.sent_s, "prompt_tokens": self.prompt_tokens,
                **{side: {"ttft_s": c.ttft_s, "wall_s": c.done_at - c.sent_at, "error": c.error,
                          "cached_tokens": c.cached_tokens, "token_ids": c.token_ids}
                   for side, c in self.done.items()}}


def join_all(threads: list[threading.Thread]) -> None:
    """Start the threads and wait for them all, in slices: Ctrl-C reaches the main thread."""
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(1.0)


class LoadGenerator:
    """Sends the workload in lock step: a thread per session, and every turn to all sides' server k
    at once; the session's next turn waits for every side's answer."""

    def __init__(self, work: Workload, servers: dict[str, list[ApiServer]], timeout_s: float,
                 stopping: threading.Event):
        self.work, self.servers, self.timeout_s, self.stopping = work, servers, timeout_s, stopping
        self.turns: list[Turn] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2 * len(servers) * max(1, work.sessions))
        self.t0 = time.monotonic()

    def lock_step(self, pair: int, prompt: list[int], first: str) -> dict[str, Completion]:
        """One request to each side's server `pair`, submitted together (`first` side first)."""
        order = sorted(self.servers, key=lambda side: side != first)
        futures = {side: self._pool.submit(stream_completion, self.servers[side][pair].url, prompt,
                                           self.work.answer_tokens, self.timeout_s) for side in order}
        return {side: f.result() for side, f in futures.items()}

    def warm_up(self) -> None:
        """One untimed request per server (first-use costs belong to no figure), pairs in lock step."""
        for pair in range(PAIRS):
            for side, done in self.lock_step(pair, self.work.warmup, SIDES[pair % 2]).items():
                if done.error:
                    raise RuntimeError(f"warm-up request to {side} {pair} failed: {done.error}")
                print(f"  warm-up {side} {pair}: TTFT {done.ttft_s * 1e3:.0f} ms, "
                      f"{(done.done_at - done.sent_at) * 1e3:.0f} ms in all", flush=True)

    def run(self) -> list[Turn]:
        self.t0 = time.monotonic()
        join_all([threading.Thread(target=self._session, args=(s,), daemon=True)
                  for s in range(self.work.sessions)])
        self._pool.shutdown()
        return sorted(self.turns, key=lambda t: t.sent_s)

    def _session(self, session: int) -> None:
        work = self.work
        if self.stopping.wait(max(0.0, self.t0 + work.arrivals[session] - time.monotonic())):
            return  # interrupted before it arrived
        history, served = list(work.contexts[session]), set[int]()
        for turn, pair in enumerate(work.routes[session]):
            if self.stopping.wait(work.thinks[session][turn] if turn else 0.0):
                return
            prompt = history + work.messages[session][turn]
            sent = time.monotonic() - self.t0
            done = self.lock_step(pair, prompt, SIDES[(session + turn) % 2])  # who goes first alternates
            record = Turn(session, turn, pair, bool(turn) and pair not in served, sent, len(prompt), done)
            with self._lock:
                self.turns.append(record)
            print(f"  {sent:7.1f} s  {record.describe()}", flush=True)
            # The reference answer continues the history; a turn nobody answered ends the session.
            answer = next((c.token_ids for side in reversed(SIDES) if (c := done.get(side)) and not c.error),
                          None)
            if answer is None:
                return
            history, served = prompt + answer, served | {pair}


@dataclass
class Phase:
    """One side's closed-loop run of one workload: its turns and how long it took."""

    side: str
    rep: int
    seed: int
    turns: list[Turn]
    wall_s: float  # the first request sent to the last answer
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # per server, over the phase
    daemon: dict[str, int] = field(default_factory=dict)  # its settled STATUS after the phase

    def figures(self) -> dict[str, float]:
        """Work done over the phase's wall time: a closed loop keeps the side busy throughout."""
        done = [(t.prompt_tokens, c) for t in self.turns for c in t.done.values() if not c.error]
        wall = self.wall_s or float("nan")
        return {"n": len(done), "errors": len(self.turns) - len(done), "wall_s": self.wall_s,
                "requests_per_s": len(done) / wall, "prompt_tokens_per_s": sum(p for p, _ in done) / wall,
                "ttft_p50_ms": percentile([c.ttft_s * 1e3 for _, c in done], 50),
                "request_p50_ms": percentile([(c.done_at - c.sent_at) * 1e3 for _, c in done], 50),
                "preemptions": sum(c.get("vllm:num_preemptions", 0.0) for c in self.counters.values()),
                "external_hits": sum(c.get("vllm:external_prefix_cache_hits", 0.0)
                                     for c in self.counters.values())}

    def as_json(self) -> dict[str, Any]:
        return {"side": self.side, "rep": self.rep, "seed": self.seed, "figures": self.figures(),
                "counters": self.counters, "daemon": self.daemon, "turns": [t.as_json() for t in self.turns]}


def closed_loop(work: Workload, side: str, servers: list[ApiServer], timeout_s: float,
                stopping: threading.Event) -> list[Turn]:
    """Every session at once, each turn sent as soon as the previous answer arrives (the workload's
    arrivals and think times ignored): the side's servers never wait for a client. Turns go to
    server `pair` of `servers` by the workload's routes; each session continues with its own answers."""
    turns: list[Turn] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def session(s: int) -> None:
        history, served = list(work.contexts[s]), set[int]()
        for turn, pair in enumerate(work.routes[s]):
            if stopping.is_set():
                return
            prompt = history + work.messages[s][turn]
            sent = time.monotonic() - t0
            done = stream_completion(servers[pair].url, prompt, work.answer_tokens, timeout_s)
            with lock:
                turns.append(Turn(s, turn, pair, bool(turn) and pair not in served, sent, len(prompt),
                                  {side: done}))
            if done.error:  # the history cannot go on without the answer
                print(f"  {side} session {s} turn {turn}: ERROR {done.error}", flush=True)
                return
            history, served = prompt + done.token_ids, served | {pair}

    join_all([threading.Thread(target=session, args=(s,), daemon=True) for s in range(work.sessions)])
    return sorted(turns, key=lambda t: t.sent_s)


def phase_wall_s(turns: list[Turn]) -> float:
    """From the first request sent to the last answer (or error)."""
    spans = [(c.sent_at, c.done_at) for t in turns for c in t.done.values()]
    return max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0


def mismatches(connector: list[Turn], baseline: list[Turn]) -> list[dict[str, Any]]:
    """Turns of two phases of the same workload, one per side, whose answer tokens differ (both
    answered): greedy decoding must give the same tokens with the connector as without."""
    base = {(t.session, t.turn): t.done["baseline"] for t in baseline}
    found = []
    for t in connector:
        con, other = t.done["connector"], base.get((t.session, t.turn))
        if other and not con.error and not other.error and con.token_ids != other.token_ids:
            found.append({"session": t.session, "turn": t.turn, "pair": t.pair, "cross_engine": t.cross,
                          "connector": con.token_ids, "baseline": other.token_ids})
    return found
