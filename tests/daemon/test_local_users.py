"""Another local user must not get between the daemon and its workers: the daemon never serves
from a socket directory someone else controls (owned by another user, open to others, or a
symbolic link), and a worker hands its KV caches' descriptors only to a daemon of its own user,
root, or the user that owns the socket's directory when that directory has one of the worker's
groups and nobody else may write in it (a --socket-group daemon). Real daemons; the other user
is `nobody` (the tests run as root)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_mp.testing.launcher import free_port, start_daemon
from lmcache_mp.transfer.attach_channel import AttachChannel

NOBODY = pwd.getpwnam("nobody").pw_uid
NOGROUP = pwd.getpwnam("nobody").pw_gid  # not one of this (root) process's groups
SYSTEM_PYTHON = Path("/usr/bin/python3")  # one `nobody` may run (the venv's may live under /root)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not SYSTEM_PYTHON.exists(),
                                reason="acting as another user needs root and /usr/bin/python3")
# Another user's stand-in for the daemon's attach socket: takes what a worker hands over.
FAKE_ATTACH = """
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen()
print("listening", flush=True)
conn, _ = server.accept()
msg, fds, _, _ = socket.recv_fds(conn, 64, 8)
print(f"received {len(fds)} descriptors", flush=True)
try:
    conn.sendall(b"\\x01")
except OSError:
    pass
"""


@pytest.fixture
def base(short_tmp: Path) -> Path:
    os.chmod(short_tmp, 0o711)  # others may pass through, as they may through /tmp
    return short_tmp


def refusal(daemons, directory: Path, *args: str, url: str | None = None) -> str:
    """Start a daemon with its sockets in `directory`; it must refuse, and make nothing there.
    Returns its log."""
    before = sorted(os.listdir(directory))
    with pytest.raises(RuntimeError, match="daemon exited with 2") as refused:
        daemons("--l1-size-gb", "0.05", *args, url=url or f"ipc://{directory}/d.sock")
    assert sorted(os.listdir(directory)) == before
    return str(refused.value)


def test_a_socket_directory_of_another_user_is_refused(daemons, base: Path) -> None:
    run = base / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, -1)  # made first by another user, e.g. /tmp/lmcache-mp-$UID
    log = refusal(daemons, run)
    assert (f"cannot start: the socket directory {run} (owner uid {NOBODY}, mode 0700) is not owned by "
            "this user (uid 0)") in log


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_socket_directory_others_may_write_in_is_refused(daemons, base: Path, mode: int) -> None:
    run = base / "run"
    run.mkdir()
    os.chmod(run, mode)
    log = refusal(daemons, run)
    assert f"the socket directory {run} (owner uid 0, mode {mode:04o}) is writable by others" in log
    assert stat.S_IMODE(run.stat().st_mode) == mode  # left as it is: it may be shared (/tmp)


def test_a_socket_directory_others_may_read_is_refused_unless_it_is_the_runtime_directory(
        daemons, base: Path) -> None:
    run = base / "run"
    run.mkdir()
    os.chmod(run, 0o755)  # e.g. --listen ipc:///run/x.sock: not the daemon's to narrow
    log = refusal(daemons, run)
    assert f"cannot start: the socket directory {run} (owner uid 0, mode 0755) is open to others" in log
    assert stat.S_IMODE(run.stat().st_mode) == 0o755


def test_a_symlinked_socket_directory_is_refused(daemons, base: Path) -> None:
    target = base / "elsewhere"
    target.mkdir(mode=0o700)
    (base / "run").symlink_to(target)
    log = refusal(daemons, target, url=f"ipc://{base / 'run'}/d.sock")
    assert f"cannot start: the socket directory {base / 'run'} is a symbolic link" in log


def test_the_attach_sockets_runtime_directory_is_checked_too(base: Path) -> None:
    """A TCP-only daemon has its attach socket in the runtime directory (LMCACHE_MP_RUNTIME_DIR,
    which the launcher sets to the directory it is given)."""
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, NOBODY, -1)
    try:
        daemon = start_daemon(runtime, "--l1-size-gb", "0.05", "--allow-unauthenticated-tcp",
                              url=f"tcp://127.0.0.1:{free_port()}")
    except RuntimeError as refused:
        log = str(refused)
    else:
        daemon.stop(signal.SIGKILL)
        pytest.fail("the daemon started")
    assert "daemon exited with 2" in log
    assert f"cannot start: the socket directory {runtime} (owner uid {NOBODY}, mode 0700) is not owned" in log
    assert [p.name for p in runtime.iterdir() if not p.name.endswith(".log")] == []


def test_the_runtime_directory_is_made_private(base: Path) -> None:
    """The runtime directory is the daemon's own: one others may read (a container volume is
    made 0755) is narrowed to 0700, not refused."""
    runtime = base / "runtime"
    runtime.mkdir()
    os.chmod(runtime, 0o755)
    daemon = start_daemon(runtime, "--l1-size-gb", "0.05", url=f"ipc://{runtime}/daemon.sock")
    try:
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    finally:
        assert daemon.stop() == 0


def test_xdg_runtime_directory_of_another_user_is_refused(base: Path) -> None:
    xdg = base / "xdg"
    xdg.mkdir(mode=0o700)
    (xdg / "lmcache-mp").mkdir(mode=0o700)
    os.chown(xdg / "lmcache-mp", NOBODY, -1)
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_MP_RUNTIME_DIR"}
    env["XDG_RUNTIME_DIR"] = str(xdg)
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--l1-size-gb", "0.05"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    assert (f"cannot start: the socket directory {xdg / 'lmcache-mp'} (owner uid {NOBODY}, mode 0700) "
            "is not owned") in out.stderr, out.stderr
    assert os.listdir(xdg / "lmcache-mp") == []


@pytest.fixture
def theirs() -> Iterator[Path]:
    """A directory of `nobody`'s, as /tmp/lmcache-mp-$UID is when another user made it first
    (with a group of theirs: a user can only give what it owns a group it is in)."""
    path = Path(tempfile.mkdtemp(prefix="lmc-theirs-", dir="/tmp"))
    os.chown(path, NOBODY, NOGROUP)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fake_attach(path: Path) -> subprocess.Popen:
    """`nobody` listening on `path`, as another user's stand-in for the daemon's attach socket."""
    fake = subprocess.Popen([str(SYSTEM_PYTHON), "-I", "-c", FAKE_ATTACH, str(path)], user="nobody",
                            group="nogroup", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert fake.stdout is not None and fake.stderr is not None
    if fake.stdout.readline() != "listening\n":
        fake.kill()
        pytest.fail(fake.communicate(timeout=30)[1])
    return fake


def handed_over(fake: subprocess.Popen) -> str:
    """What the stand-in received; it exits after one connection."""
    try:
        out, err = fake.communicate(timeout=30)
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()
    return out + err


def assert_refused_by_the_worker(path: Path) -> None:
    """A worker hands nothing to another user's process listening at `path`."""
    fake = fake_attach(path)
    kv = os.memfd_create("kv-cache")
    try:
        with pytest.raises(PermissionError, match=f"the attach socket {path} is served by uid {NOBODY}"):
            AttachChannel.open(str(path), [kv], timeout_s=10)
    finally:
        os.close(kv)
    assert handed_over(fake) == "received 0 descriptors\n"


def test_a_worker_hands_its_descriptors_only_to_its_own_user_or_root(daemon, worker_for,
                                                                     theirs: Path) -> None:
    """The attach socket the daemon names is checked by its peer's credentials: another user's
    process listening there (it squatted the socket directory first) gets nothing."""
    worker_for(daemon.url)  # registers, or raises: a daemon of our own user is trusted
    assert_refused_by_the_worker(theirs / "d.sock.attach")


def test_a_worker_hands_its_descriptors_to_the_user_of_a_directory_of_its_group(theirs: Path) -> None:
    """The worker's side of --socket-group: such a daemon runs as another user than its workers,
    in a directory of its own whose group is theirs (mode 0750). A worker trusts the owner of such
    a directory: only a member of one of the worker's groups can have given it that group."""
    os.chown(theirs, NOBODY, os.getegid())
    os.chmod(theirs, 0o750)
    fake = fake_attach(theirs / "d.sock.attach")
    kv = os.memfd_create("kv-cache")
    try:
        channel = AttachChannel.open(str(theirs / "d.sock.attach"), [kv], timeout_s=10)
        channel.close()
    finally:
        os.close(kv)
    assert handed_over(fake) == "received 1 descriptors\n"


@pytest.mark.parametrize(("mode", "group"), [(0o750, "nogroup"), (0o770, "mine"), (0o757, "mine")],
                         ids=["a group not the worker's", "writable by the group", "writable by others"])
def test_a_worker_refuses_the_owner_of_any_other_directory(theirs: Path, mode: int, group: str) -> None:
    """The owner of the socket directory is trusted only where that directory has one of the
    worker's groups and nobody but its owner may put a socket in it."""
    os.chown(theirs, NOBODY, NOGROUP if group == "nogroup" else os.getegid())
    os.chmod(theirs, mode)
    assert_refused_by_the_worker(theirs / "d.sock.attach")
