"""What a client of the attach socket can make the daemon hold, and wait for. A client may open
attach channels and hand over descriptors that no REGISTER ever claims, or connect and send
nothing. The daemon bounds both (a cap on unclaimed hand-overs and on their descriptors, a
deadline for each, a reserve of descriptors below RLIMIT_NOFILE kept for the rest of the daemon;
one process's share of each) and reads hand-overs side by side, so no client delays or locks out
another worker's registration. Real daemons (under `prlimit` for a low descriptor limit); the
clients speak the attach protocol by hand, as `AttachChannel.open` does, from this process, or
from a hostile one of their own."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_mp.mq import MessageQueueClient
from lmcache_mp.testing.launcher import DaemonProcess
from lmcache_mp.transfer.attach import (
    MAX_FDS,
    MAX_PENDING,
    MAX_UNCLAIMED,
    MAX_UNCLAIMED_FDS,
    MAX_UNCLAIMED_PER_PEER,
    TOKEN_BYTES,
)
from tests.support.helpers import status, wait_for

REGISTRATION_DEADLINE_S = 20.0  # a worker's registration of the small test caches, under load

# Runs the daemon with some of attach.py's bounds changed (JSON in argv[1]), so that a deadline
# can be reached quickly or put out of reach. The launcher appends its own command line:
# [python, -m, lmcache_mp.cli, serve, ...], so the daemon's arguments start at argv[5].
PATCHED_DAEMON = """
import json, sys
import lmcache_mp.transfer.attach as attach
for name, value in json.loads(sys.argv[1]).items():
    assert hasattr(attach, name), name
    setattr(attach, name, value)
from lmcache_mp.cli.main import main
sys.exit(main(sys.argv[5:]))
"""


# One process's shares put out of reach: the tests of the bounds on all clients together flood
# them from this one process.
NO_PEER_SHARES = {"MAX_PENDING_PER_PEER": 1 << 30, "MAX_UNCLAIMED_PER_PEER": 1 << 30,
                  "MAX_UNCLAIMED_FDS_PER_PEER": 1 << 30}


def start(daemons: Callable[..., DaemonProcess], nofile: int | None = None, **bounds: float) -> DaemonProcess:
    """A daemon with `nofile` as its descriptor limit (soft and hard) and attach.py's `bounds`."""
    prefix: list[str] = ["prlimit", f"--nofile={nofile}:{nofile}", "--"] if nofile else []
    if bounds:
        prefix += [sys.executable, "-c", PATCHED_DAEMON, json.dumps(bounds)]
    return daemons("--l1-size-gb", "0.05", command_prefix=prefix)


def attach_path(daemon: DaemonProcess) -> str:
    client = MessageQueueClient(daemon.url, request_timeout_s=30)
    try:
        return client.handshake("attach test").attach_socket
    finally:
        client.close()


def handover_message(fds: list[int]) -> bytes:
    return os.urandom(TOKEN_BYTES) + struct.pack("<I", len(fds))


def acknowledged(sock: socket.socket) -> bool:
    """Whether the daemon acknowledged the hand-over sent on `sock` (False: it closed it)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b"\x01"
    except ConnectionResetError:  # closed with our hand-over unread
        return False


def hand_over(path: str, fds: list[int]) -> socket.socket | None:
    """A hand-over as a worker sends it: the open channel if the daemon took it, else None (it
    closed the connection, maybe before the hand-over was even sent)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    try:
        socket.send_fds(sock, [handover_message(fds)], fds)
        if acknowledged(sock):
            sock.settimeout(None)  # blocking again, as the worker's: MSG_DONTWAIT answers at once
            return sock
    except BrokenPipeError:
        pass
    sock.close()
    return None


def closed_by_daemon(sock: socket.socket) -> bool:
    """Whether the daemon has closed its end (`sock` must be in blocking mode: with a timeout,
    Python waits for it to be readable first)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def held_by(daemon: DaemonProcess, fd: int) -> int:
    """How many of the daemon's descriptors are the open file `fd` is (a memfd we sent it)."""
    mine = os.fstat(fd)
    count = 0
    for entry in os.scandir(f"/proc/{daemon.proc.pid}/fd"):
        try:
            st = os.stat(entry.path)
        except FileNotFoundError:  # closed meanwhile
            continue
        count += (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
    return count


@pytest.fixture
def kv() -> Iterator[int]:
    fd = os.memfd_create("attach-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    yield fd
    os.close(fd)


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Sockets a test keeps open; closed at its end."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def flood(path: str, fds: list[int], held: list[socket.socket], attempts: int) -> int:
    """Hand over `fds` again and again, keeping every channel the daemon takes, until it refuses
    one (or `attempts` are made). Returns how many it took."""
    taken = 0
    for _ in range(attempts):
        sock = hand_over(path, fds)
        if sock is None:
            return taken
        held.append(sock)
        taken += 1
    return taken


def serve_new_clients(daemon: DaemonProcess, path: str, count: int = 16) -> None:
    """`count` new clients at once, each a descriptor for ZeroMQ (which aborts the daemon when it
    cannot get one), each answered."""
    clients = [MessageQueueClient(daemon.url, request_timeout_s=30) for _ in range(count)]
    try:
        for client in clients:
            assert client.handshake("one more client").attach_socket == path
    finally:
        for client in clients:
            client.close()
    assert daemon.proc.poll() is None, daemon.log()


def test_unclaimed_hand_overs_past_the_descriptor_limit_are_refused_not_fatal(
        daemons, worker_for, kv: int, held: list[socket.socket]) -> None:
    """Hand-overs no REGISTER claims, each holding a descriptor, until past the daemon's
    limit: it ran out, and libzmq aborted it (exit -6) at its next connections. Now the flood is
    refused while the daemon has descriptors to spare: it serves on, and once the flood is gone
    its listener takes the next worker's channel."""
    limit = 512
    daemon = start(daemons, nofile=limit, **NO_PEER_SHARES)
    path = attach_path(daemon)
    flood(path, [kv], held, attempts=limit)  # two descriptors each: past the limit
    serve_new_clients(daemon, path)
    for sock in held:
        sock.close()
    wait_for(lambda: held_by(daemon, kv) == 0, "the unclaimed descriptors closed")
    worker_for(daemon.url)  # registers: its channel is taken
    assert len(status(daemon.url).registered_instances) == 1
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log(), daemon.log()


def test_a_reserve_of_descriptors_is_kept_for_the_rest_of_the_daemon(daemons, kv: int,
                                                                     held: list[socket.socket]) -> None:
    """Hand-overs of many descriptors each, within the caps on unclaimed ones, but until the
    daemon is short of descriptors: it refuses them while it still has a reserve, so new clients
    (each a descriptor for ZeroMQ, which aborts the daemon when it gets none) are served."""
    limit = 256
    daemon = start(daemons, nofile=limit, **NO_PEER_SHARES)
    path = attach_path(daemon)
    taken = flood(path, [kv] * 16, held, attempts=limit // 16)
    assert taken < limit // 16, "never refused"
    serve_new_clients(daemon, path)
    assert "Too many open files" not in daemon.log()


def test_unclaimed_hand_overs_are_capped(daemons, kv: int, held: list[socket.socket]) -> None:
    daemon = start(daemons, nofile=8192, **NO_PEER_SHARES)  # descriptors to spare: the caps refuse
    path = attach_path(daemon)
    assert flood(path, [kv], held, attempts=MAX_UNCLAIMED + 8) == MAX_UNCLAIMED
    for sock in held:
        sock.close()
    held.clear()
    wait_for(lambda: held_by(daemon, kv) == 0, "the unclaimed descriptors closed")
    # The descriptors they hold are capped too.
    assert flood(path, [kv] * MAX_FDS, held, attempts=MAX_UNCLAIMED) == MAX_UNCLAIMED_FDS // MAX_FDS
    assert daemon.proc.poll() is None


def test_an_unclaimed_hand_over_is_closed_after_its_deadline(daemons, worker_for, kv: int,
                                                              held: list[socket.socket]) -> None:
    """A hand-over no REGISTER claims in time is closed, and its descriptors with it; a claimed
    channel (a registration's liveness) is never closed by the daemon."""
    daemon = start(daemons, CLAIM_DEADLINE_S=5.0)  # the worker's REGISTER claims its channel sooner
    worker = worker_for(daemon.url)
    sock = hand_over(attach_path(daemon), [kv])
    assert sock is not None  # acknowledged: the daemon holds the descriptor
    held.append(sock)
    wait_for(lambda: closed_by_daemon(sock), "the unclaimed hand-over closed by the daemon")
    wait_for(lambda: held_by(daemon, kv) == 0, "its descriptor closed")
    # The worker registered before that hand-over was made: still registered, channel open.
    assert status(daemon.url).registered_instances == [worker.instance_id]
    assert worker.registration.channel is not None and worker.registration.channel.is_open()


def connect_idle(path: str, count: int) -> list[socket.socket]:
    """Connections to the attach socket that send nothing."""
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(count)]
    for sock in idle:
        sock.connect(path)
    return idle


def test_idle_connections_do_not_delay_a_registration(daemons, worker_for, short_tmp,
                                                      held: list[socket.socket]) -> None:
    """Hand-overs were read one at a time, waiting up to 2 s for each: four idle
    connections delayed a worker's registration by 8 s. Now they are read side by side: the
    worker registers while every idle connection is still waiting (their deadline put out of
    reach here, so that only the order of events counts, not the time they take)."""
    daemon = start(daemons, HANDOVER_DEADLINE_S=600.0, **NO_PEER_SHARES)
    held.extend(connect_idle(attach_path(daemon), 8))
    worker_for(daemon.url)
    assert len(status(daemon.url).registered_instances) == 1
    assert not any(closed_by_daemon(idle) for idle in held), "an idle connection was served first"


def test_idle_connections_are_closed_after_a_short_deadline(daemons, held: list[socket.socket]) -> None:
    daemon = start(daemons, HANDOVER_DEADLINE_S=0.5, **NO_PEER_SHARES)
    held.extend(connect_idle(attach_path(daemon), 8))
    wait_for(lambda: all(closed_by_daemon(idle) for idle in held), "every idle connection closed")
    assert daemon.proc.poll() is None


def test_a_hand_over_that_arrives_in_pieces_is_put_together(daemons, kv: int,
                                                           held: list[socket.socket]) -> None:
    """A slow client's hand-over may arrive in several reads (a stream socket keeps no message
    boundaries): the daemon keeps what arrived, descriptors included, until the rest does."""
    daemon = start(daemons, HANDOVER_DEADLINE_S=600.0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.append(sock)
    sock.connect(attach_path(daemon))
    message = handover_message([kv, kv])
    socket.send_fds(sock, [message[:7]], [kv, kv])
    wait_for(lambda: held_by(daemon, kv) == 2, "the first piece received, with its descriptors")
    sock.sendall(message[7:])
    assert acknowledged(sock)
    assert held_by(daemon, kv) == 2


def test_the_daemon_takes_its_hard_descriptor_limit(daemons) -> None:
    """Every client connection costs a descriptor, and libzmq aborts when an accept finds none:
    the daemon raises its soft limit to the hard one as it starts."""
    daemon = daemons("--l1-size-gb", "0.05", command_prefix=["prlimit", "--nofile=256:4096", "--"])
    limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
    line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line


# A hostile client in a process of its own: COUNT connections to the attach socket, each left idle
# or handing over a hand-over no REGISTER will claim (with one descriptor, or none); it prints how
# many hand-overs the daemon acknowledged, then holds every connection until its stdin closes.
HOSTILE_CLIENT = """
import os, socket, struct, sys
path, kind, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = os.memfd_create("hostile", os.MFD_CLOEXEC)
os.ftruncate(kv, 1 << 20)
fds = {"idle": None, "empty": [], "unclaimed": [kv]}[kind]
held, acknowledged = [], 0
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    held.append(sock)
    if fds is not None:
        try:
            socket.send_fds(sock, [os.urandom(16) + struct.pack("<I", len(fds))], fds)
            acknowledged += sock.recv(1) == b"\\x01"
        except OSError:  # refused: closed by the daemon
            pass
print(acknowledged, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def hostile_client() -> Iterator[Callable[[str, str, int], int]]:
    """hostile_client(path, kind, count) -> hand-overs acknowledged; its connections stay open
    until the test ends."""
    procs: list[subprocess.Popen] = []

    def run(path: str, kind: str, count: int) -> int:
        procs.append(subprocess.Popen([sys.executable, "-c", HOSTILE_CLIENT, path, kind, str(count)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        return int(procs[-1].stdout.readline())

    yield run
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.parametrize(("kind", "count", "deadline"), [
    ("idle", MAX_PENDING, "HANDOVER_DEADLINE_S"),
    ("unclaimed", MAX_UNCLAIMED, "CLAIM_DEADLINE_S"),
    ("empty", MAX_UNCLAIMED, "CLAIM_DEADLINE_S"),
], ids=["idle connections", "unclaimed hand-overs", "hand-overs without descriptors"])
def test_one_client_holding_the_attach_bounds_locks_no_worker_out(
        daemons, worker_for, hostile_client, kind: str, count: int, deadline: str) -> None:
    """One process held 64 idle connections, or 64 hand-overs that no REGISTER claims: every
    other worker's attach channel was refused (40 of 40 registrations in 20 s) until they expired,
    and the client opened them again. Now one process holds a small share of each bound (hand-overs
    without descriptors, a CUDA worker's, included). Its connections are held here for the whole
    test (the deadlines put out of reach), so what counts is the bounds alone; the real worker
    connects after all of them."""
    daemon = start(daemons, **{deadline: 600.0})
    acknowledged = hostile_client(attach_path(daemon), kind, count)
    began = time.monotonic()
    worker = worker_for(daemon.url)
    assert status(daemon.url).registered_instances == [worker.instance_id]
    assert time.monotonic() - began < REGISTRATION_DEADLINE_S
    if kind != "idle":
        assert acknowledged == MAX_UNCLAIMED_PER_PEER
    assert "Traceback" not in daemon.log()
