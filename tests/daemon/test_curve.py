"""Authenticated remote access (ZeroMQ CURVE): real daemons, real keys, real sockets.
An allowed client is served; a client with an unknown key, or with none, gets no connection;
TCP needs CURVE or an explicit flag (--allow-unauthenticated-tcp on loopback, --insecure-remote
beyond it; tests/daemon/test_socket_access.py has the loopback refusal)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mp.curve import ClientCurve
from lmcache_mp.errors import RequestTimeoutError
from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.protocol import RequestType
from lmcache_mp.testing.blocks import BLOCK, block_hashes
from lmcache_mp.testing.launcher import DaemonProcess, free_port
from vllm_adapter import LMCacheMPSchedulerAdapter
from vllm_adapter.connector_common import ConnectorSettings

CLI = [sys.executable, "-m", "lmcache_mp.cli"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def keygen(directory: Path, name: str) -> None:
    out = cli("keygen", str(directory), "--name", name)
    assert out.returncode == 0, out.stderr


@pytest.fixture
def keys(short_tmp: Path) -> Path:
    """server.key(_secret); allowed/ with alice.key; alice and mallory key pairs in clients/."""
    keygen(short_tmp / "server", "server")
    keygen(short_tmp / "clients", "alice")
    keygen(short_tmp / "clients", "mallory")
    (short_tmp / "allowed").mkdir()
    (short_tmp / "allowed" / "alice.key").write_bytes((short_tmp / "clients" / "alice.key").read_bytes())
    return short_tmp


def client_curve(keys: Path, name: str) -> ClientCurve:
    return ClientCurve(keys / "server" / "server.key", keys / "clients" / f"{name}.key_secret")


@pytest.fixture
def curve_daemon(daemons, keys: Path, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    """On loopback TCP, with neither --allow-unauthenticated-tcp nor its environment variable:
    CURVE is what lets it listen there."""
    monkeypatch.delenv("LMCACHE_MP_ALLOW_UNAUTHENTICATED_TCP", raising=False)
    return daemons("--curve-secret-key", str(keys / "server" / "server.key_secret"),
                   "--curve-allowed-keys", str(keys / "allowed"), "--l1-size-gb", "0.05",
                   url=f"tcp://127.0.0.1:{free_port()}", curve=client_curve(keys, "alice"))


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(keys: Path) -> None:
    secret = keys / "clients" / "alice.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert b"secret-key" in secret.read_bytes()
    assert b"secret-key" not in (keys / "clients" / "alice.key").read_bytes()
    again = cli("keygen", str(keys / "clients"), "--name", "alice")
    assert again.returncode == 1 and "exists" in again.stderr


def test_an_allowed_key_is_served(curve_daemon: DaemonProcess, keys: Path) -> None:
    scheduler = LMCacheMPSchedulerAdapter(curve_daemon.url, None, "m", 1, 0, BLOCK, timeout_s=10,
                                          curve=client_curve(keys, "alice"))
    try:
        scheduler.maybe_submit_lookup_request("r", block_hashes=block_hashes(list(range(64))))
        assert scheduler.lookup_futures["r"].result(10) == 0  # answered: nothing stored yet
    finally:
        scheduler.shutdown()
    out = cli("status", "--url", curve_daemon.url, "--server-key", str(keys / "server" / "server.key"),
              "--client-key", str(keys / "clients" / "alice.key_secret"))
    assert out.returncode == 0 and "hit rate" in out.stdout, out.stderr


@pytest.mark.parametrize("who", ["unknown key", "no key"])
def test_other_clients_get_no_connection(curve_daemon: DaemonProcess, keys: Path, who: str) -> None:
    curve = client_curve(keys, "mallory") if who == "unknown key" else None
    intruder = MessageQueueClient(curve_daemon.url, curve=curve)
    try:
        with pytest.raises(RequestTimeoutError) as info:
            intruder.handshake("intruder", timeout_s=1.5)
        if curve is not None:
            assert "with CURVE, check" in str(info.value)
        with pytest.raises(RequestTimeoutError):
            intruder.submit(RequestType.STATUS, [], timeout_s=0.5).result(1)
    finally:
        intruder.close()
    friend = MessageQueueClient(curve_daemon.url, curve=client_curve(keys, "alice"))
    try:  # the daemon serves on, and the allowed client still gets in
        assert friend.handshake("friend", timeout_s=10).server_version
    finally:
        friend.close()
    assert curve_daemon.stop() == 0
    assert "Traceback" not in curve_daemon.log()


def test_beyond_loopback_needs_curve_or_insecure_remote(keys: Path) -> None:
    far = "tcp://192.0.2.1:5555"  # TEST-NET-1: never this machine's, so binding it always fails
    plain = cli("serve", "--listen", far)
    assert plain.returncode == 2 and "refusing to listen on" in plain.stderr
    assert "--insecure-remote" in plain.stderr
    for extra in (["--insecure-remote"],
                  ["--curve-secret-key", str(keys / "server" / "server.key_secret"),
                   "--curve-allowed-keys", str(keys / "allowed")]):
        out = cli("serve", "--listen", far, *extra)
        # past the loopback rule: it is the bind that fails now
        assert out.returncode == 2 and "cannot listen on" in out.stderr, out.stderr
    half = cli("serve", "--curve-secret-key", str(keys / "server" / "server.key_secret"))
    assert half.returncode == 2 and "CURVE needs both" in half.stderr
    public_only = cli("serve", "--curve-secret-key", str(keys / "server" / "server.key"),
                      "--curve-allowed-keys", str(keys / "allowed"))
    assert public_only.returncode == 2 and "holds no secret key" in public_only.stderr


def test_connector_settings_take_the_key_files(keys: Path) -> None:
    extra = {"lmcache.mp.server_public_key": str(keys / "server" / "server.key"),
             "lmcache.mp.client_key": str(keys / "clients" / "alice.key_secret")}
    assert ConnectorSettings.from_extra_config(extra).curve == client_curve(keys, "alice")
    with pytest.raises(ValueError, match="go together"):
        ConnectorSettings.from_extra_config({"lmcache.mp.client_key": extra["lmcache.mp.client_key"]})
    with pytest.raises(ValueError, match="cannot read the CURVE key file"):
        ConnectorSettings.from_extra_config({**extra, "lmcache.mp.client_key": str(keys / "missing")})


def test_kv_events_on_tcp_need_an_allowed_key(daemons, keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-events-listen on TCP is CURVE-protected like --listen: an allowed subscriber gets the
    stream's replay; one with an unknown key gets no connection."""
    from tests.support.kv_event_subscriber import Subscriber

    monkeypatch.delenv("LMCACHE_MP_ALLOW_UNAUTHENTICATED_TCP", raising=False)
    pub = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemons("--curve-secret-key", str(keys / "server" / "server.key_secret"),
                     "--curve-allowed-keys", str(keys / "allowed"), "--l1-size-gb", "0.05",
                     "--kv-events-listen", pub, "--kv-events-replay", f"tcp://127.0.0.1:{free_port()}",
                     url=f"tcp://127.0.0.1:{free_port()}", curve=client_curve(keys, "alice"))
    out = cli("status", "--json", "--url", daemon.url, "--server-key", str(keys / "server" / "server.key"),
              "--client-key", str(keys / "clients" / "alice.key_secret"))
    assert out.returncode == 0, out.stderr
    endpoints = json.loads(out.stdout)["kv_events_endpoints"]
    allowed = Subscriber(*endpoints, curve=client_curve(keys, "alice"))
    refused = Subscriber(*endpoints, curve=client_curve(keys, "mallory"))
    try:
        assert allowed.replay(0) >= 1  # the stream's first batch: AllBlocksCleared
        with pytest.raises(TimeoutError):
            refused.replay(0, timeout_s=1.0)
    finally:
        allowed.close()
        refused.close()
