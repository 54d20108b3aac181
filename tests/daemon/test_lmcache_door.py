"""The lmcache door end to end: the real daemon, started with `--lmcache-listen`, and LMCache's OWN
client sending the requests its vLLM connector sends, KV caches in shared-memory segments made by
LMCache's own CPU wrapper (`tests/support/lmcache_peer.py`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from lmcache_mp.testing.launcher import DaemonProcess, daemon_status, free_port
from lmcache_mp.testing.probes import scrape
from tests.support.helpers import LMCACHE_MISSING, status, wait_for_status

pytest.importorskip("lmcache", reason=LMCACHE_MISSING)  # tests/unit/test_lmcache_peer.py fails

from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.platform.base.ipc_wire import CudaIPCData, TensorMetadata
from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper
from lmcache.v1.platform.devices.cuda.ipc_wrapper import CudaIPCWrapper

from tests.support.lmcache_peer import (
    BLOCK,
    BLOCKS,
    CHUNK,
    DOOR_ARGS,
    HEADS,
    MODEL,
    TIMEOUT_S,
    TOKENS,
    WIDTH,
    Caches,
    caches_fixture,  # noqa: F401 (a fixture)
    door_fixture,  # noqa: F401 (a fixture)
    key,
    lmcache_client_fixture,  # noqa: F401 (a fixture)
    lookup,
    raw_request,
    request_client,
)


def test_the_connector_s_first_requests_are_answered(lmcache_client: Any) -> None:
    assert lmcache_client.get_chunk_size().result(TIMEOUT_S) == CHUNK
    assert lmcache_client.ping(None).result(TIMEOUT_S) is True
    assert lmcache_client.ping(123).result(TIMEOUT_S) is True
    assert lmcache_client.get_experimental().result(TIMEOUT_S) == ["kv_event_stream"]
    assert lmcache_client.noop().result(TIMEOUT_S) == "OK"
    assert lmcache_client.query_prefetch_status("never-looked-up").result(TIMEOUT_S) == 0
    assert lmcache_client.end_session("never-looked-up").result(TIMEOUT_S) is None


def test_a_store_through_a_shared_memory_segment_is_a_hit_with_its_bytes(
        door: tuple[DaemonProcess, str], lmcache_client: Any, caches: Caches) -> None:
    caches.register(lmcache_client, 41)
    assert lookup(lmcache_client, "cold", 64) == 0
    lmcache_client.end_session("cold").result(TIMEOUT_S)
    for layer in caches.layers:  # the KV of the prompt's first 64 tokens: blocks 0-3
        layer[:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH))

    stored = lmcache_client.store(key("first", 0, 0, 64), 41, [[0, 1, 2, 3]], b"stub_ipc_handle")
    assert stored.result(TIMEOUT_S) == (b"", True)
    lmcache_client.end_session("first").result(TIMEOUT_S)

    assert lookup(lmcache_client, "again", 64) == 2  # chunks of 32 tokens
    loaded = lmcache_client.retrieve(key("again", 0, 0, 64), 41, [[8, 9, 10, 11]], b"stub_ipc_handle", 0)
    assert loaded.result(TIMEOUT_S) == (b"", True)
    assert all(torch.equal(layer[8:12], layer[0:4]) for layer in caches.layers)
    lmcache_client.end_session("again").result(TIMEOUT_S)

    # skip_first_n_tokens: the blocks vLLM holds already are left alone.
    assert lookup(lmcache_client, "skip", 64) == 2
    for layer in caches.layers:
        layer[12:16].fill_(7)
    loaded = lmcache_client.retrieve(key("skip", 0, 0, 64), 41, [[12, 13, 14, 15]], b"stub_ipc_handle", 16)
    assert loaded.result(TIMEOUT_S) == (b"", True)
    assert all(torch.equal(layer[13:16], layer[1:4]) and bool((layer[12] == 7).all())
               for layer in caches.layers)
    lmcache_client.end_session("skip").result(TIMEOUT_S)

    # Other tokens, a miss; a prompt that shares the first chunk only, one chunk.
    other = IPCCacheServerKey.from_token_ids(MODEL, 1, None, list(range(64)), 0, 64, "other")
    assert lmcache_client.lookup(other, 1).result(TIMEOUT_S) is None
    assert lmcache_client.wait_prefetch_status("other", 10.0).result(TIMEOUT_S) == 0
    half = IPCCacheServerKey.from_token_ids(MODEL, 1, None, TOKENS[:32] + [1] * 32, 0, 64, "half")
    assert lmcache_client.lookup(half, 1).result(TIMEOUT_S) is None
    assert lmcache_client.wait_prefetch_status("half", 10.0).result(TIMEOUT_S) == 1
    for request_id in ("other", "half"):
        lmcache_client.end_session(request_id).result(TIMEOUT_S)
    report = wait_for_status(door[0].url, lambda r: r.leases == 0, "every lease released")
    assert report.registered_instances == [41]


def test_a_salted_store_is_a_hit_for_its_salt_only(
        door: tuple[DaemonProcess, str], lmcache_client: Any, caches: Caches) -> None:
    """vLLM's `cache_salt` (per-user isolation) travels in LMCache's keys: the same tokens under
    another salt, or none, are other chunks."""
    caches.register(lmcache_client, 44)
    for layer in caches.layers:
        layer[:4].copy_(torch.randn(4, HEADS, BLOCK, WIDTH))
    stored = lmcache_client.store(key("a", 0, 0, 64, salt="tenant-a"), 44, [[0, 1, 2, 3]], b"stub_ipc_handle")
    assert stored.result(TIMEOUT_S) == (b"", True)
    lmcache_client.end_session("a").result(TIMEOUT_S)

    assert lookup(lmcache_client, "plain", 64) == 0
    assert lookup(lmcache_client, "b", 64, salt="tenant-b") == 0
    assert lookup(lmcache_client, "a-again", 64, salt="tenant-a") == 2
    loaded = lmcache_client.retrieve(key("a-again", 0, 0, 64, salt="tenant-a"), 44, [[8, 9, 10, 11]],
                                     b"stub_ipc_handle", 0)
    assert loaded.result(TIMEOUT_S) == (b"", True)
    assert all(torch.equal(layer[8:12], layer[0:4]) for layer in caches.layers)
    for request_id in ("plain", "b", "a-again"):
        lmcache_client.end_session(request_id).result(TIMEOUT_S)
    wait_for_status(door[0].url, lambda r: r.leases == 0 and r.objects == 2, "two chunks, no lease")


def test_every_request_is_answered_and_the_daemon_serves_on(door: tuple[DaemonProcess, str],
                                                            lmcache_client: Any) -> None:
    daemon, url = door
    uid = msgspec.msgpack.encode(9)
    store_op = msgspec.msgpack.encode(6)
    sent = {
        "an unknown operation id": [uid, msgspec.msgpack.encode(11)],
        "an operation of a later version": [uid, msgspec.msgpack.encode("negotiate_chunk_size"),
                                            msgspec.msgpack.encode(16)],
        "a known operation not served": [uid, msgspec.msgpack.encode("store_q"), *[b"\xc0"] * 3],
        "a malformed store": [uid, store_op, b"\xff\xfe", b"\x01", b"\x90", b"\xc4\x00"],
        "a store of an unregistered instance": [uid, store_op, msgspec.msgpack.encode(key("r", 0, 0, 64)),
                                                b"\x07", msgspec.msgpack.encode([[0, 1, 2, 3]]), b"\xc4\x00"],
        "a request id that is no int": [b"\xc3", msgspec.msgpack.encode(22), b"\xc0"],
    }
    replies = {what: raw_request(url, frames) for what, frames in sent.items()}
    for what, reply in replies.items():
        assert reply[0] == sent[what][0], what
    # A store's failure is its own failure value; the others' op frame names the refusal.
    assert msgspec.msgpack.decode(replies["a malformed store"][2]) == [b"", False]
    assert msgspec.msgpack.decode(replies["a store of an unregistered instance"][2]) == [b"", False]
    assert "lmcache-mp refused" in msgspec.msgpack.decode(replies["an unknown operation id"][1])
    assert lmcache_client.ping(None).result(TIMEOUT_S) is True
    assert daemon.proc.poll() is None
    log = daemon.log()
    assert "ERROR" in log and "lmcache 0.5.6" in log
    assert log.count("operation id 11 is not in lmcache 0.5.6's table") == 1  # each kind logged once
    raw_request(url, sent["an unknown operation id"])
    assert daemon.log().count("operation id 11 is not in lmcache 0.5.6's table") == 1


def _refused_registration(client: Any, wrappers: list[CpuShmTensorWrapper], instance_id: int) -> str:
    future = client.register_kv_cache(instance_id, wrappers, MODEL, 1, EngineType.VLLM, {},
                                      [EngineGroupInfo(0, tuple(range(len(wrappers))), BLOCK)])
    with pytest.raises(ValueError, match="lmcache-mp refused register_kv_cache") as refused:
        future.result(TIMEOUT_S)
    return str(refused.value)


def test_segments_that_are_not_the_client_s_own_are_refused(door: tuple[DaemonProcess, str],
                                                            lmcache_client: Any, caches: Caches) -> None:
    daemon = door[0]
    layer = torch.zeros(BLOCKS, HEADS, BLOCK, WIDTH, dtype=torch.bfloat16)
    nbytes = layer.nbytes
    made: list[Path] = []

    def segment(suffix: str, make: Callable[[Path], None]) -> str:
        path = Path(f"/dev/shm/lmcache_kv_test_{os.getpid()}_{suffix}")
        make(path)
        made.append(path)
        return "/" + path.name

    def sized(path: Path, size: int = nbytes) -> None:
        path.write_bytes(b"\0" * size)

    def other_user(path: Path) -> None:
        sized(path)
        os.chown(path, 65534, 65534)

    assert daemon.pool_path is not None
    names = {
        "outside /dev/shm": ("/../tmp/x", "not one file name"),
        "a symbolic link": (segment("link", lambda p: p.symlink_to(caches.path)), "Too many levels"),
        "a second name of the pool file": (segment("pool", lambda p: os.link(daemon.pool_path, p)), "names"),
        "smaller than it says": (segment("small", lambda p: sized(p, 100)), "holds 100 bytes"),
        "a directory": (segment("dir", lambda p: p.mkdir()), "Is a directory"),
    }
    if os.geteuid() == 0:  # only root can give a file away
        names["another user's"] = (segment("other", other_user), "belongs to uid 65534")
    try:
        for i, (what, (name, reason)) in enumerate(names.items()):
            wrapper = CpuShmTensorWrapper(layer, name, segment_nbytes=nbytes)
            message = _refused_registration(lmcache_client, [wrapper], 100 + i)
            assert reason in message, (what, message)
    finally:
        for path in made:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
    assert daemon_status(daemon.url).registered_instances == []
    assert lmcache_client.ping(None).result(TIMEOUT_S) is True


def test_cuda_caches_on_a_daemon_without_their_gpu_are_refused_saying_why(lmcache_client: Any) -> None:
    # LMCache's CUDA descriptor of a device this daemon cannot see (here: none at all). Opening it is
    # the GPU self-test's (scripts/gpu/selftest_door.py); here, the refusal is an answer that says why.
    metadata = TensorMetadata(dtype="bfloat16", shape=(BLOCKS, BLOCK, HEADS, WIDTH),
                              stride=(BLOCK * HEADS * WIDTH, HEADS * WIDTH, WIDTH, 1), storage_offset=0,
                              device_uuid="GPU-00000000-1111-2222-3333-444444444444")
    handle = (0, b"h" * 64, BLOCKS * BLOCK * HEADS * WIDTH * 2, 0, b"/torch_ref", 1, b"e" * 64, True)
    wrapper = CudaIPCWrapper.from_wire(CudaIPCData(version=1, metadata=metadata, handle=handle))
    future = lmcache_client.register_kv_cache(31, [wrapper], MODEL, 1, EngineType.VLLM, {"kv_layout": "NHD"},
                                              [EngineGroupInfo(0, (0,), BLOCK)])
    with pytest.raises(ValueError, match=r"lmcache-mp refused register_kv_cache.*CUDA") as refused:
        future.result(TIMEOUT_S)
    assert "GPU-00000000-1111-2222-3333-444444444444" in str(refused.value)
    assert lmcache_client.ping(None).result(TIMEOUT_S) is True


def test_a_segment_cut_short_fails_its_copies_and_the_daemon_serves_on(
        door: tuple[DaemonProcess, str], lmcache_client: Any, caches: Caches) -> None:
    daemon, _ = door
    caches.register(lmcache_client, 43)
    store = lmcache_client.store(key("before", 0, 0, 64), 43, [[0, 1, 2, 3]], b"stub_ipc_handle")
    assert store.result(TIMEOUT_S) == (b"", True)
    lmcache_client.end_session("before").result(TIMEOUT_S)
    # This process maps the segment too: from here on it must not touch the caches' memory.
    os.truncate(caches.path, 0)

    other = IPCCacheServerKey.from_token_ids(MODEL, 1, 0, list(range(64)), 0, 64, "after")
    stored = lmcache_client.store(other, 43, [[4, 5, 6, 7]], b"stub_ipc_handle")
    assert stored.result(TIMEOUT_S) == (b"", False)
    assert lookup(lmcache_client, "load", 64) == 2
    loaded = lmcache_client.retrieve(key("load", 0, 0, 64), 43, [[8, 9, 10, 11]], b"stub_ipc_handle", 0)
    assert loaded.result(TIMEOUT_S) == (b"", False)
    lmcache_client.end_session("load").result(TIMEOUT_S)

    assert lmcache_client.ping(43).result(TIMEOUT_S) is True
    assert daemon.proc.poll() is None
    report = daemon_status(daemon.url)
    assert report.objects == 2  # the first store's chunks; nothing of the failed one
    # The copies failed on a short read or write: the daemon never mapped the segment (no SIGBUS).
    assert f"/dev/shm/{caches.path.name}" not in Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def test_a_registration_goes_with_its_segment(door: tuple[DaemonProcess, str], lmcache_client: Any) -> None:
    daemon, _ = door
    caches = Caches()
    caches.register(lmcache_client, 44)
    caches.register(lmcache_client, 44)  # again, from its own connection: it says it is alive
    assert daemon_status(daemon.url).registered_instances == [44]
    caches.close()  # what LMCache's worker does as it exits
    wait_for_status(daemon.url, lambda r: r.registered_instances == [], "the registration dropped",
                    daemon=daemon)


def test_tcp_needs_the_explicit_flag(daemons: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
    command = [sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen",
               f"ipc://{short_tmp / 'refused.sock'}", "--pool-file", "", "--lmcache-listen", url,
               "--l1-size-gb", "0.05"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean)
    assert refused.returncode != 0
    assert "--allow-unauthenticated-tcp" in refused.stderr + refused.stdout

    daemon = daemons("--lmcache-listen", url, "--allow-unauthenticated-tcp", "--l1-size-gb", "0.05")
    client = request_client(url)
    try:
        assert client.ping(None).result(TIMEOUT_S) is True
    finally:
        client.close()
    assert daemon.stop(signal.SIGTERM) == 0


def test_status_and_metrics_tell_the_two_doors_apart(daemons: Callable[..., DaemonProcess], short_tmp: Path,
                                                     worker_for: Callable[..., Any]) -> None:
    port = free_port()
    url = f"ipc://{short_tmp / 'lmcache.sock'}"
    daemon = daemons("--lmcache-listen", url, *DOOR_ARGS, "--metrics-port", str(port))
    client = request_client(url)
    caches = Caches()
    try:
        worker_for(daemon.url)  # our own connector's worker, through the native door
        caches.register(client, 45)
        before = status(daemon.url)
        for _ in range(3):
            assert client.ping(45).result(TIMEOUT_S) is True
        unknown = client.store(key("r", 0, 0, 64), 99, [[0, 1, 2, 3]], b"stub_ipc_handle")
        assert unknown.result(TIMEOUT_S) == (b"", False)  # no instance 99: answered as failed
        after = status(daemon.url)
        metrics = scrape(port)
        shown = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "status", "--url", daemon.url],
                               capture_output=True, text=True, timeout=60).stdout
    finally:
        client.close()
        caches.close()
    native, door = after.doors
    assert (native.name, native.endpoints) == ("native", [daemon.url])
    assert (door.name, door.endpoints) == ("lmcache", [url])
    # One registration through each; the door answered its register, 3 pings and the failed store.
    assert (native.registered_instances, door.registered_instances) == (1, 1)
    assert {i.door for i in after.instances} == {"native", "lmcache"}
    assert (door.requests_total, door.failed_total) == (5, 1)
    assert door.requests_total - before.doors[1].requests_total == 4
    # The native door counted only its own: the STATUS between the two reports, none of the door's.
    assert native.requests_total - before.doors[0].requests_total == 1 and native.failed_total == 0
    assert metrics['lmcache_mp_door_requests_total{door="lmcache",result="ok"}'] == 4
    assert metrics['lmcache_mp_door_requests_total{door="lmcache",result="failed"}'] == 1
    assert metrics['lmcache_mp_door_requests_total{door="native",result="ok"}'] >= native.requests_total
    assert metrics['lmcache_mp_door_registered_instances{door="lmcache"}'] == 1
    assert metrics['lmcache_mp_door_registered_instances{door="native"}'] == 1
    assert metrics['lmcache_mp_lmcache_door_requests_total{op="ping",result="ok"}'] == 3
    assert metrics['lmcache_mp_lmcache_door_requests_total{op="store",result="failed"}'] == 1
    assert metrics['lmcache_mp_lmcache_door_requests_total{op="retrieve",result="ok"}'] == 0  # from the start
    assert f"doors     native on {daemon.url}: " in shown and f"| lmcache on {url}: 5 requests (1 failed), " \
        "1 registered" in shown, shown
    assert re.search(r"^  45 +org/tiny +0/1 +LMCACHE_CPU_SHM .* lmcache$", shown, re.M), shown


def test_after_a_warm_restart_a_fresh_registration_hits_with_the_exact_bytes(
        daemons: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    url = f"ipc://{short_tmp / 'lmcache.sock'}"
    daemon = daemons("--lmcache-listen", url, *DOOR_ARGS)
    client, first = request_client(url), Caches()
    try:
        first.register(client, 46)
        first.fill(slice(0, 4), seed=5)
        stored = [layer[0:4].clone() for layer in first.layers]
        assert client.store(key("s", 0, 0, 64), 46, [[0, 1, 2, 3]], b"stub_ipc_handle").result(TIMEOUT_S) \
            == (b"", True)
        client.end_session("s").result(TIMEOUT_S)
    finally:
        client.close()
        first.close()
    assert daemon.stop(keep_pool=True) == 0
    assert daemon.pool_path is not None and daemon.pool_path.exists()

    again = daemons("--lmcache-listen", url, *DOOR_ARGS)
    report = wait_for_status(again.url, lambda r: r.pool_unverified == 0, "adopted chunks verified")
    assert (report.pool_adopted_chunks, report.pool_verified_total, report.pool_dropped_total) == (2, 2, 0)
    client, second = request_client(url), Caches()  # a fresh worker: its own segment, a new id
    try:
        second.register(client, 47)
        assert lookup(client, "again", 64) == 2
        loaded = client.retrieve(key("again", 0, 0, 64), 47, [[4, 5, 6, 7]], b"stub_ipc_handle", 0)
        assert loaded.result(TIMEOUT_S) == (b"", True)
        for layer, original in zip(second.layers, stored, strict=True):
            assert torch.equal(layer[4:8], original)
        client.end_session("again").result(TIMEOUT_S)
    finally:
        client.close()
        second.close()
    assert again.stop() == 0
