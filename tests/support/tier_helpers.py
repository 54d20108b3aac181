"""What the tier tests share: chunks of random bytes and their keys, a tier's round trip and its
namespaces, daemons beside each other on one store (restart survival, a fleet of two), and a
worker's retrieve of a daemon's chunks."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmcache_mp.chunks import ChunkKey, TierStats
from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.storage.tiers.remote import NetworkTier
from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import count_lookup, fmt, run_worker, status, store

WAIT_S = 60.0  # a restarted server may take a while on a loaded machine; tiers' probes back off


def chunks(n: int, nbytes: int = 64 << 10, seed: int = 0) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    keys = [ChunkKey(bytes([seed, i]) * 16, fmt()) for i in range(n)]
    return keys, [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]


def empties(n: int, nbytes: int = 64 << 10) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def round_trip(tier: NetworkTier, n: int = 20) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    """Put `n` chunks, then check that the tier holds exactly them, byte for byte, and that neither an
    absent hash nor the same hash under another format is found; the keys and the bytes."""
    keys, data = chunks(n)
    absent = ChunkKey(b"\xff" * 32, fmt())
    assert tier.batched_put(list(zip(keys, data, strict=True))) == n
    assert tier.batched_contains([*keys, absent]) == [True] * n + [False]
    got = tier.batched_get([*keys, absent], empties(n + 1))
    assert all(torch.equal(g, d) for g, d in zip(got, data, strict=False)) and got[-1] is None
    assert tier.batched_contains([ChunkKey(keys[0].chunk_hash, fmt(model="other"))]) == [False]
    return keys, data


def drop_and_clear(tier: NetworkTier, neighbour: NetworkTier, keys: list[ChunkKey],
                   data: list[torch.Tensor]) -> None:
    """With `keys` (model "m") stored by `tier`: RESET_MODEL takes that model's chunks, not those of
    a model whose name extends it; CLEAR_TIERS takes the namespace's, not `neighbour`'s."""
    other = [ChunkKey(k.chunk_hash, fmt(model="m/x")) for k in keys[:3]]
    assert tier.batched_put(list(zip(other, data[:3], strict=True))) == 3
    assert neighbour.batched_put(list(zip(keys[:2], data[:2], strict=True))) == 2
    assert tier.drop_models({"m"}) == len(keys)
    assert tier.batched_contains([*keys[:2], *other]) == [False, False, True, True, True]
    assert tier.clear() == 3
    assert neighbour.batched_contains(keys[:2]) == [True, True]


# ---- daemons sharing one store ----------------------------------------------------------------------


def wait_shared(url: str, chunks_written: int) -> TierStats:
    def written() -> bool:
        (t,) = status(url).tiers
        return t.write_queue_chunks == 0 and t.writes_total == chunks_written
    wait_until(written)
    return status(url).tiers[0]


def tier_daemon_args(tier_url: str) -> tuple[str, ...]:
    return ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--l2", tier_url)


def beside(daemon: DaemonProcess, name: str) -> str:
    """A socket URL next to `daemon`'s, for a second daemon in the same directory."""
    return daemon.url.replace("daemon.sock", f"{name}.sock")


def retrieve_into(daemon: DaemonProcess, hashes: list[bytes], out: Path) -> dict:
    run_worker({"url": daemon.url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
                "num_layers": LAYERS, "block_size": BLOCK, "action": "retrieve", "model": "m",
                "block_ids": list(range(20, 20 + len(hashes))), "request_id": "reader", "out": str(out),
                "block_hashes": [h.hex() for h in hashes]})
    return torch.load(out)


def stored_pages() -> torch.Tensor:
    """The bytes `worker_for`'s worker stores for blocks 0..7."""
    caches = make_caches(SHAPE, torch.bfloat16, LAYERS, seed=1)
    return pages(caches, "CPU_ATTN", SHAPE, list(range(8))).view(torch.uint8)


def check_restart_survival(daemons: Callable, worker_for: Callable, url: str, env: dict[str, str],
                           out: Path) -> None:
    """Chunks one daemon stored through the tier at `url` are read, byte for byte, by the next
    daemon started with an empty pool."""
    hashes = block_hashes(list(range(4 * CHUNK)))
    first = daemons(*tier_daemon_args(url), env=env)
    writer = worker_for(first.url)
    assert store(writer.mq_client, writer.instance_id, hashes[1::2], "s") == [ChunkOutcome.STORED] * 4
    wait_shared(first.url, 4)
    assert first.stop() == 0
    second = daemons(*tier_daemon_args(url), "--fresh-pool", env=env)
    assert status(second.url).objects == 0
    got = retrieve_into(second, hashes, out)
    assert got["hit"] == 4 * CHUNK and got["failed"] == []
    assert torch.equal(got["pages"].view(torch.uint8), stored_pages())
    (t,) = status(second.url).tiers
    assert (t.promotions_total, t.hits_total, t.up, t.corrupt_total) == (4, 4, 1, 0)
    assert second.stop() == 0 and "Traceback" not in second.log()


def check_two_daemons_share(daemons: Callable, worker_for: Callable, url: str, env: dict[str, str]) -> None:
    """Two daemons on one store: each finds what only the other stored."""
    node_a = daemons(*tier_daemon_args(url), env=env)
    node_b = daemons(*tier_daemon_args(url), url=beside(node_a, "node-b"), env=env)
    from_a = block_hashes(list(range(4 * CHUNK)))[1::2]
    from_b = block_hashes(list(range(5000, 5000 + 4 * CHUNK)))[1::2]
    writer_a, writer_b = worker_for(node_a.url), worker_for(node_b.url)
    assert store(writer_a.mq_client, writer_a.instance_id, from_a, "a") == [ChunkOutcome.STORED] * 4
    assert store(writer_b.mq_client, writer_b.instance_id, from_b, "b") == [ChunkOutcome.STORED] * 4
    wait_shared(node_a.url, 4)
    wait_shared(node_b.url, 4)
    assert count_lookup(writer_b.mq_client, from_a) == 4  # what only the other node stored
    assert count_lookup(writer_a.mq_client, from_b) == 4
    for node in (node_a, node_b):
        (t,) = status(node.url).tiers
        assert (t.promotions_total, t.hits_total, t.errors_total) == (4, 4, 0)


def check_down_at_start(daemons: Callable[..., DaemonProcess], worker_for: Callable[[str], Any], url: str,
                        said_in: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """A daemon whose tier at `url` cannot be used at start: STATUS and /metrics show the tier down
    under its URL, the daemon serves from its pool, its writes are skipped, and its log says why in
    exactly one ERROR line holding `said_in`: that line and the whole log (the daemon is stopped)."""
    port = free_port()
    daemon = daemons(*tier_daemon_args(url), "--metrics-port", str(port), env=env)
    (t,) = status(daemon.url).tiers
    assert t.up == 0 and t.name == url
    assert scrape(port)[f'lmcache_mp_tier_up{{tier="{url}"}}'] == 0
    worker = worker_for(daemon.url)
    hashes = block_hashes(list(range(4 * CHUNK)))[1::2]
    assert store(worker.mq_client, worker.instance_id, hashes, "s") == [ChunkOutcome.STORED] * 4
    assert count_lookup(worker.mq_client, hashes) == 4  # served from the pool
    wait_until(lambda: status(daemon.url).tiers[0].unavailable_total >= 1)  # its writes skipped
    assert daemon.stop() == 0
    log = daemon.log()
    said = [line for line in log.splitlines() if said_in in line]
    assert len(said) == 1 and "ERROR" in said[0], log
    assert "Traceback" not in log
    return said[0], log


def check_refused_at_start(tmp: Path, cases: list[tuple[str, tuple[str, ...], str]]) -> list[str]:
    """`lmcache-mp serve --l2 URL` (run as `python FLAGS serve ...`) for each (URL, FLAGS, message):
    exit 2 with the message and no traceback. Their standard errors."""
    errors = []
    for url, python_flags, message in cases:
        command = [sys.executable, *python_flags, "serve", "--listen", f"ipc://{tmp / 'x.sock'}",
                   "--l1-size-gb", "0.01", "--l2", url]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        errors.append(out.stderr)
    return errors
