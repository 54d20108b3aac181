"""The soak's warm-restart checks (`scripts/soak/soak.py --warm-restart`).

In this mode the daemon keeps its chunks in its pool file alone (no tier below it), so a chunk
that outlives a restart is one the next daemon adopted. After each restart, SIGKILL or SIGTERM,
a checker in the soak's own process waits until the new daemon has checked what it adopted,
then looks up every prompt the clients draw from, retrieves whatever hits and compares it bit
for bit with what its key says it holds. Every prompt whose STORE a client saw acknowledged
before the signal must hit whole: the pool is sized so that nothing is evicted, so a chunk
missing there was lost by the restart.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_attacks import try_status
from soak_client import BLOCKS_PER_CHUNK, ClientConfig, SoakClient

from lmcache_mp.protocol import StatusReport

# How long a new daemon may take to check the chunks it adopted (its readers see them after);
# a few thousand small chunks take well under a second, on a busy machine a few.
ADOPTION_CHECK_DEADLINE_S = 60.0
MAX_EXAMPLES = 10


@dataclass
class AdoptionCheck:
    """What one restart's check found."""

    t: float  # seconds since the load started, of the signal
    signal: str
    adopted_chunks: int = 0  # as the new daemon's STATUS counts them
    adopted_unsealed: int = 0  # of those, not checksummed yet when the last daemon died
    dropped_chunks: int = 0  # adopted, then failed their check
    acked_prompts: int = 0  # prompts whose STORE was acknowledged before the signal
    prompts_hit: int = 0
    chunks_verified: int = 0
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    lost_chunks: int = 0  # chunks of acknowledged prompts that the new daemon did not have
    failed: list[str] = field(default_factory=list)  # lookups and retrieves that did not complete
    examples: list[str] = field(default_factory=list)
    check_s: float = 0.0


def acked_prompts(tmp: Path, before: float) -> set[int]:
    """The prompts whose STORE some client saw acknowledged before `before` (time.time())."""
    prompts = set()
    for path in tmp.glob("client-*.acked"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a client killed mid-line leaves half of one
                when, prompt = line.split()
                if float(when) < before:
                    prompts.add(int(prompt))
    return prompts


def adoption_checked(url: str, deadline_s: float) -> StatusReport | None:
    """STATUS once the daemon has checked every chunk it adopted; None if it never did in time."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        report = try_status(url)
        if report is not None and report.pool_ready and not report.pool_unverified:
            return report
        time.sleep(0.05)
    return None


def check_adoption(cfg: ClientConfig, tmp: Path, t: float, signal_name: str, killed: float) -> AdoptionCheck:
    """Read back every prompt from the daemon at `cfg.url`, started after a `signal_name` at
    `killed` (time.time()); `cfg`: the checker's own client configuration."""
    started = time.monotonic()
    check = AdoptionCheck(t, signal_name)
    report = adoption_checked(cfg.url, ADOPTION_CHECK_DEADLINE_S)
    if report is None:
        check.failed.append(f"the daemon did not finish checking its adopted chunks in "
                            f"{ADOPTION_CHECK_DEADLINE_S:.0f} s")
        return check
    check.adopted_chunks, check.adopted_unsealed = report.pool_adopted_chunks, report.pool_adopted_unsealed
    check.dropped_chunks = report.pool_dropped_total
    acked = acked_prompts(tmp, killed)
    check.acked_prompts = len(acked)
    client = SoakClient(cfg)
    try:
        for prompt, hashes in enumerate(client.prompts):
            _read_back(client, check, prompt, hashes, prompt in acked)
    finally:
        client.scheduler.shutdown()
        client.worker.shutdown()
    check.chunks_verified = client.stats.ops["chunks verified"]
    check.wrong_chunks, check.wrong_bytes = client.stats.wrong_chunks, client.stats.wrong_bytes
    check.examples += client.stats.wrong_examples[: MAX_EXAMPLES - len(check.examples)]
    check.failed += [f"{kind} x{n}" for kind, n in client.stats.errors.items()]
    check.check_s = time.monotonic() - started
    return check


def _read_back(client: SoakClient, check: AdoptionCheck, prompt: int, hashes: list[bytes],
               acked: bool) -> None:
    """LOOKUP the prompt, RETRIEVE and verify what hit (the client counts wrong bytes), and count
    the chunks an acknowledged prompt lacks."""
    rid = f"warm-check-{prompt}"
    hit = client.lookup(rid, hashes)
    if hit is None:
        check.failed.append(f"LOOKUP of prompt {prompt} never settled")
        return
    try:
        if hit:
            check.prompts_hit += 1
            client.retrieve(rid, hashes[: hit * BLOCKS_PER_CHUNK])
    finally:
        client.end_session(rid)
    missing = len(hashes) // BLOCKS_PER_CHUNK - hit
    if acked and missing:
        check.lost_chunks += missing
        if len(check.examples) < MAX_EXAMPLES:
            check.examples.append(f"prompt {prompt}: acknowledged before the {check.signal}, "
                                  f"{missing} of {len(hashes) // BLOCKS_PER_CHUNK} chunks gone")
