"""Who may use the daemon's Unix sockets: its own user by default; with --socket-group, also
that group's members (a vLLM running as another user). Real daemon, real permissions; the
other user's side runs as `nobody` when the tests run as root. Its TCP ports: every local user
may connect to one, so tcp:// without CURVE is refused unless --allow-unauthenticated-tcp says
otherwise; and a restart takes them back at once, whatever connections of the last daemon
linger in TIME_WAIT."""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mp.testing.launcher import DaemonProcess, free_port
from tests.support.helpers import wait_for

ALLOW_TCP = "--allow-unauthenticated-tcp"
ALLOW_TCP_ENV = "LMCACHE_MP_ALLOW_UNAUTHENTICATED_TCP"
GROUP = "daemon"  # present on Debian, and `nobody` is not in it
CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
# The other user's client: a Python `nobody` may run (the venv's may live under /root).
SYSTEM_PYTHON = Path("/usr/bin/python3")
AS_ANOTHER_USER = os.geteuid() == 0 and SYSTEM_PYTHON.exists()


def modes(daemon: DaemonProcess) -> dict[str, tuple[int, int]]:
    paths = {"directory": daemon.socket_path.parent, "socket": daemon.socket_path,
             "attach socket": daemon.socket_path.with_name(daemon.socket_path.name + ".attach")}
    return {what: (stat.S_IMODE(p.stat().st_mode), p.stat().st_gid) for what, p in paths.items()}


def connects_as_nobody(path: Path, extra_groups: list[int]) -> bool:
    out = subprocess.run([str(SYSTEM_PYTHON), "-I", "-c", CONNECT, str(path)], user="nobody", group="nogroup",
                         extra_groups=extra_groups, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 or "Permission denied" in out.stderr, out.stderr
    return out.returncode == 0


@pytest.fixture
def run_dir(short_tmp: Path) -> Path:
    os.chmod(short_tmp, 0o711)  # others may pass through to the socket directory, no more
    return short_tmp / "run"


def test_by_default_only_the_daemons_user(daemons, run_dir: Path) -> None:
    daemon = daemons("--l1-size-gb", "0.05", url=f"ipc://{run_dir}/d.sock")
    got = modes(daemon)
    assert got["directory"][0] == 0o700 and got["socket"][0] == got["attach socket"][0] == 0o600, got
    if AS_ANOTHER_USER:
        assert not connects_as_nobody(daemon.socket_path, [grp.getgrnam(GROUP).gr_gid])


def test_socket_group_lets_its_members_in(daemons, run_dir: Path) -> None:
    gid = grp.getgrnam(GROUP).gr_gid
    daemon = daemons("--l1-size-gb", "0.05", "--socket-group", GROUP, url=f"ipc://{run_dir}/d.sock")
    got = modes(daemon)
    assert got == {"directory": (0o750, gid), "socket": (0o660, gid), "attach socket": (0o660, gid)}, got
    if not AS_ANOTHER_USER:
        pytest.skip("connecting as another user needs root and /usr/bin/python3")
    assert connects_as_nobody(daemon.socket_path, [gid])
    assert connects_as_nobody(daemon.socket_path.with_name("d.sock.attach"), [gid])
    assert not connects_as_nobody(daemon.socket_path, [])  # not a member: refused


def test_an_unknown_group_is_refused_at_start() -> None:
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--socket-group", "no-such-group"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "socket_group (--socket-group) is no-such-group: no such group on this machine" in out.stderr


def time_wait_on(port: int) -> bool:
    """Whether a TCP connection whose local port is `port` is in TIME_WAIT (what the side that
    closed first keeps for 60 s)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "06":  # 06: TIME_WAIT
            return True
    return False


def read_to_end(conn: socket.socket) -> bytes:
    """Everything until the peer closes (so that its end, the daemon's, closes first)."""
    conn.settimeout(30)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_restart_takes_back_its_metrics_port_after_a_scrape(daemons) -> None:
    port = free_port()
    first = daemons("--l1-size-gb", "0.05", "--metrics-port", str(port))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as scrape:
        scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert b"lmcache_mp_" in read_to_end(scrape)  # HTTP/1.0: the server closes first
    wait_for(lambda: time_wait_on(port), "the scrape's connection in TIME_WAIT on the metrics port")
    assert first.stop() == 0
    second = daemons("--l1-size-gb", "0.05", "--metrics-port", str(port))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as scrape:
        scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert b"lmcache_mp_" in read_to_end(scrape)
    assert second.stop() == 0


def test_a_restart_takes_back_its_tcp_port_while_a_port_in_use_is_still_refused(daemons,
                                                                                short_tmp: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    port = int(url.rsplit(":", 1)[1])
    first = daemons("--l1-size-gb", "0.05", ALLOW_TCP, url=url)
    # Not by the launcher: the first daemon would answer its HELLO.
    refused = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--listen", url, ALLOW_TCP],
                             capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, LMCACHE_MP_RUNTIME_DIR=str(short_tmp)))
    assert refused.returncode == 2, refused.stderr
    assert f"cannot start: cannot listen on {url}: Address already in use" in refused.stderr
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        assert first.stop() == 0  # closes the connection: its end first
        read_to_end(client)
    wait_for(lambda: time_wait_on(port), "the client's connection in TIME_WAIT on the daemon's port")
    assert daemons("--l1-size-gb", "0.05", ALLOW_TCP, url=url).stop() == 0


def test_tcp_without_curve_is_refused_unless_allowed(daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any local user (and any container sharing the network namespace) may connect to a loopback
    port: without CURVE keys, the daemon will not listen on one unless the operator says so."""
    monkeypatch.delenv(ALLOW_TCP_ENV, raising=False)
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="daemon exited with 2") as refused:
        daemons("--l1-size-gb", "0.05", url=url)
    log = str(refused.value)
    assert f"lmcache-mp serve: cannot start: refusing to listen on {url} without authentication" in log
    assert ALLOW_TCP in log and "--curve-secret-key" in log and "lmcache-mp keygen" in log, log
    assert "Traceback" not in log


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_unauthenticated_tcp_serves_when_allowed(daemons, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.delenv(ALLOW_TCP_ENV, raising=False)
    if how == "environment":
        monkeypatch.setenv(ALLOW_TCP_ENV, "1")  # the launcher's daemon inherits it
    url = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemons("--l1-size-gb", "0.05", *([ALLOW_TCP] if how == "flag" else []), url=url)
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "ping", "--url", url, "--count", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert daemon.stop() == 0


def test_serve_help_explains_the_unauthenticated_tcp_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the help
    assert ALLOW_TCP in text and ALLOW_TCP_ENV in text
    assert "any local user" in text and "CURVE" in text and "ipc://" in text
