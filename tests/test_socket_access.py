"""Who may use the daemon's Unix sockets: its own user by default; with --socket-group, also
that group's members (a vLLM running as another user). Real daemon, real permissions; the
other user's side runs as `nobody` when the tests run as root."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mp.launcher import DaemonProcess

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
