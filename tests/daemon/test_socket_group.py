"""--socket-group for a CPU worker of another user. The daemon and the worker run as two users
made for the test (useradd; removed after it), the worker's a member of the socket group: it
registers its CPU KV cache over the attach socket (the daemon checking that its peer is in the
group, the worker that the daemon owns a socket directory of its group), stores, and retrieves
in another process. Real daemon, real users; skipped where the tests cannot make users (not
root, no useradd)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmcache_mp.testing.blocks import BLOCK, CHUNK, LAYERS, SHAPE, block_hashes
from lmcache_mp.testing.kv_worker import make_caches, pages
from lmcache_mp.testing.launcher import DaemonProcess

REPO = Path(__file__).resolve().parents[2]
# The venv's interpreter may live where other users cannot go (/root/.pyenv): they run the
# system's Python, of the same version, with the venv's packages and this repository.
SYSTEM_PYTHON = Path("/usr/bin/python3")
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])
# `python -c AS_USER SITE_PACKAGES REPO [interpreter] -m MODULE ARGS...`: runs MODULE as
# `python -m` would. The launcher's command line names its interpreter first; it is skipped.
AS_USER = """
import runpy, site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(0, sys.argv[2])
args = sys.argv[3:]
if args[0] != "-m":
    args = args[1:]
sys.argv = [args[1], *args[2:]]
runpy.run_module(args[1], run_name="__main__", alter_sys=True)
"""
# Another user's hand-over on the attach socket (argv[1]): what the daemon answered (it may
# close the connection before the hand-over is even sent).
HAND_OVER = """
import os, socket, struct, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.settimeout(30)
try:
    socket.send_fds(sock, [os.urandom(16) + struct.pack("<I", 1)], [os.memfd_create("kv")])
    print("acknowledged" if sock.recv(1) == b"\\x01" else "closed")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
"""
SEED = 7


@dataclass(frozen=True)
class SocketUsers:
    group: str  # the --socket-group
    daemon_user: str  # the daemon's user; `group` is its primary group
    worker_user: str  # vLLM's: another user, in `group` as a supplementary group


def _why_not() -> str | None:
    """Why this machine cannot run these tests as other users, if it cannot."""
    if os.geteuid() != 0:
        return "making users and acting as them needs root"
    tools = ("useradd", "userdel", "groupadd", "groupdel", "setpriv")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    if not SYSTEM_PYTHON.exists():
        return f"needs {SYSTEM_PYTHON}"
    version = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    if version != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is Python {version}, not this venv's {sys.version_info[:2]}"
    unreadable = [p for p in (REPO, SITE_PACKAGES) if not _readable_by_others(p)]
    if unreadable:
        return f"other users cannot read {unreadable[0]}"
    return None


def _readable_by_others(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in (path, *path.parents))


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=60)


@pytest.fixture
def socket_users() -> Iterator[SocketUsers]:
    """Two users and a group made for one test, removed after it."""
    why_not = _why_not()
    if why_not:
        pytest.skip(why_not)
    suffix = secrets.token_hex(3)
    users = SocketUsers(f"lmc-g-{suffix}", f"lmc-d-{suffix}", f"lmc-w-{suffix}")
    nologin = ("--system", "--no-create-home", "--shell", "/usr/sbin/nologin")
    undo: list[tuple[str, str]] = []
    try:
        _run("groupadd", "--system", users.group)
        undo.append(("groupdel", users.group))
        _run("useradd", *nologin, "--gid", users.group, users.daemon_user)
        undo.append(("userdel", users.daemon_user))
        _run("useradd", *nologin, "--user-group", "--groups", users.group, users.worker_user)
        undo += [("groupdel", users.worker_user), ("userdel", users.worker_user)]
        yield users
    finally:
        for command in reversed(undo):  # userdel may have removed the user's own group already
            subprocess.run(command, capture_output=True, timeout=60)


@pytest.fixture
def run_dir(short_tmp: Path) -> Path:
    os.chmod(short_tmp, 0o711)  # others may pass through to the socket directory, no more
    return short_tmp / "run"


def start_as_daemon_user(users: SocketUsers, daemons, run: Path) -> DaemonProcess:
    """A --socket-group daemon of the daemon's user, its sockets in `run`: made for that user in a
    directory only root may write in, as systemd's RuntimeDirectory= makes /run/lmcache-mp."""
    run.mkdir(mode=0o700)
    os.chown(run, pwd.getpwnam(users.daemon_user).pw_uid, -1)
    as_daemon_user = ["setpriv", f"--reuid={users.daemon_user}", f"--regid={users.group}", "--init-groups",
                      str(SYSTEM_PYTHON), "-c", AS_USER, str(SITE_PACKAGES), str(REPO)]
    return daemons("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--socket-group", users.group,
                   url=f"ipc://{run}/d.sock", command_prefix=as_daemon_user)


def run_as_worker(users: SocketUsers, spec: dict, home: Path) -> None:
    """The stand-in worker (lmcache_mp/testing/kv_worker.py) as the worker's user, with its groups
    (the socket group among them)."""
    worker = pwd.getpwnam(users.worker_user)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([str(SYSTEM_PYTHON), "-c", AS_USER, str(SITE_PACKAGES), str(REPO), "-m",
                          "lmcache_mp.testing.kv_worker", json.dumps(spec)],
                         user=worker.pw_uid, group=worker.pw_gid,
                         extra_groups=[grp.getgrnam(users.group).gr_gid], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_member_of_the_socket_group_registers_stores_and_retrieves(socket_users: SocketUsers, daemons,
                                                                     run_dir: Path) -> None:
    """With --socket-group, the members could connect, but the attach socket refused every uid
    but the daemon's (and the worker every daemon but one of its own user or root), so no CPU
    worker of another user could register. Now each takes the other."""
    daemon = start_as_daemon_user(socket_users, daemons, run_dir)
    assert pwd.getpwuid(daemon.socket_path.parent.stat().st_uid).pw_name == socket_users.daemon_user
    home = run_dir.parent / "worker-home"  # where the retrieving worker saves what it got
    home.mkdir()
    os.chown(home, pwd.getpwnam(socket_users.worker_user).pw_uid, -1)
    hashes = [h.hex() for h in block_hashes(list(range(2 * CHUNK)))]  # two chunks, four blocks
    spec = {"url": daemon.url, "layout": "CPU_ATTN", "shape": SHAPE, "dtype": "bfloat16",
            "num_layers": LAYERS, "block_size": BLOCK, "model": "m", "block_hashes": hashes}
    run_as_worker(socket_users, {**spec, "action": "store", "seed": SEED, "block_ids": [1, 2, 3, 4]}, home)
    out = home / "pages.pt"
    run_as_worker(socket_users, {**spec, "action": "retrieve", "block_ids": [9, 8, 7, 6], "out": str(out)},
                  home)
    got = torch.load(out)
    assert got["hit"] == 2 * CHUNK and got["failed"] == []
    expected = pages(make_caches(SHAPE, torch.bfloat16, LAYERS, SEED), "CPU_ATTN", SHAPE, [1, 2, 3, 4])
    assert torch.equal(got["pages"].view(torch.uint8), expected.view(torch.uint8))
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log(), daemon.log()


def test_the_daemon_refuses_a_non_member_where_the_socket_would_let_it_in(socket_users: SocketUsers, daemons,
                                                                         run_dir: Path) -> None:
    """The attach socket's mode keeps non-members out; were it widened (by mistake), the daemon
    would still check its peer: its own user, root, or a member of the socket group."""
    daemon = start_as_daemon_user(socket_users, daemons, run_dir)
    attach = daemon.socket_path.with_name(daemon.socket_path.name + ".attach")
    os.chmod(run_dir, 0o755)
    os.chmod(attach, 0o666)

    def hand_over_as(user: str, group: int, extra_groups: list[int]) -> str:
        out = subprocess.run([str(SYSTEM_PYTHON), "-I", "-c", HAND_OVER, str(attach)], user=user, group=group,
                             extra_groups=extra_groups, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    nobody = pwd.getpwnam("nobody")
    assert hand_over_as(nobody.pw_name, nobody.pw_gid, []) == "closed\n"
    member = pwd.getpwnam(socket_users.worker_user)
    assert hand_over_as(member.pw_name, member.pw_gid, [grp.getgrnam(socket_users.group).gr_gid]) \
        == "acknowledged\n"
    assert daemon.proc.poll() is None
