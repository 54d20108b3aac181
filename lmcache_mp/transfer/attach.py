"""The attach hand-over of zero-copy CPU registration: a worker's shared-memory descriptors passed
to the daemon over a Unix socket, and the open channel that is then the registration's liveness.

Worker side, and the hand-over's bytes: `attach_channel.AttachChannel`.

Daemon side, here: `AttachListener` accepts the channels; `claim(token)` gives a registration the
descriptors of its channel, for `shm.map_storages` to map.

The attach socket's invariants:
- Who: the daemon takes channels from its own user, root, or, with --socket-group, a member of
  that group (the peer's credentials, SO_PEERCRED and SO_PEERGROUPS); a worker hands its caches
  to its own user, root, or the owner of the socket's directory where that directory has one of
  the worker's groups and only its owner may write in it (`attach_channel`).
- Nobody waits on anybody: one thread serves every connection through a selector, and reads a
  hand-over as it arrives, so an idle or slow client never delays another worker's registration.
- Bounded: connections that have not handed over (MAX_PENDING, closed after
  HANDOVER_DEADLINE_S), hand-overs no REGISTER has claimed (MAX_UNCLAIMED, MAX_UNCLAIMED_FDS,
  closed with their descriptors after CLAIM_DEADLINE_S), all connections (MAX_CHANNELS), and a
  reserve of descriptors below RLIMIT_NOFILE that attach connections never take. Past a bound a
  new connection is refused (closed; its worker retries), never the daemon killed.
- Shared: one process (a peer, by its pid from SO_PEERCRED) holds a small share of the pending
  and unclaimed bounds (MAX_PENDING_PER_PEER, MAX_UNCLAIMED_PER_PEER,
  MAX_UNCLAIMED_FDS_PER_PEER), so one client holding idle connections or unclaimed hand-overs
  never locks the other workers out. (A hand-over without descriptors is a CUDA worker's, its
  registration's liveness: taken like any other, within the same shares. A daemon without CUDA
  still takes it, so that the worker's REGISTER gets its typed refusal rather than a retry loop.)
"""

from __future__ import annotations

import collections
import contextlib
import errno
import grp
import logging
import math
import os
import pwd
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_mp.sockets import SocketAccess, claim_socket_path
from lmcache_mp.transfer.attach_channel import ACK, HANDOVER_BYTES, TOKEN_BYTES, peer_credentials

__all__ = ["CLAIM_DEADLINE_S", "HANDOVER_DEADLINE_S", "MAX_CHANNELS", "MAX_FDS", "MAX_PENDING",
           "MAX_PENDING_PER_PEER", "MAX_UNCLAIMED", "MAX_UNCLAIMED_FDS", "MAX_UNCLAIMED_FDS_PER_PEER",
           "MAX_UNCLAIMED_PER_PEER", "TOKEN_BYTES", "AttachListener"]

logger = logging.getLogger(__name__)

MAX_FDS = 64  # storages per registration; vLLM uses one for all layers
# What clients of the attach socket can make the daemon hold. A worker opens its channel and
# sends REGISTER at once, so its connection is pending, then unclaimed, for moments; these bound
# the clients that never hand over, or never register (without them, a flood of unclaimed
# hand-overs ran the daemon out of descriptors and libzmq aborted it).
MAX_CHANNELS = 4096  # connections of every kind; the claimed ones are registrations' liveness
MAX_PENDING = 64  # connections whose hand-over has not all arrived...
HANDOVER_DEADLINE_S = 5.0  # ...closed after this (a worker sends it right after connecting)
MAX_UNCLAIMED = 64  # hand-overs that no REGISTER has claimed yet...
MAX_UNCLAIMED_FDS = 1024  # ...the descriptors they hold together...
# ...closed, with those descriptors, after this: longer than a worker waits for its REGISTER's
# answer (30 s by default; by default the daemon starts a queued request within 10 s or refuses
# it), so a REGISTER that could still claim one never finds it gone.
CLAIM_DEADLINE_S = 60.0
# One process's share of the bounds above. A worker opens one channel per registration and sends
# its REGISTER at once, so it has one pending or unclaimed for moments (a few, where one process
# registers several caches side by side); a client holding more is refused, and the rest of the
# bounds stay for the other workers (one process holding 64 idle connections, or 64 unclaimed
# hand-overs, refused every other worker's registration).
MAX_PENDING_PER_PEER = 4
MAX_UNCLAIMED_PER_PEER = 4
MAX_UNCLAIMED_FDS_PER_PEER = 2 * MAX_FDS
# Descriptors kept free below RLIMIT_NOFILE for the rest of the daemon: ZeroMQ aborts the whole
# process when it cannot get one (a new client). Attach connections are refused before they
# would take any of these.
FD_RESERVE_MIN = 64
FD_RESERVE_FRACTION = 8  # the reserve: the larger of FD_RESERVE_MIN and 1/8 of the limit
_ACCEPT_RETRY_S = 0.1  # accept() itself failed (no descriptor left at all): tried again after
_REFUSAL_LOG_EVERY_S = 10.0
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python does not name it


def _peer_groups(sock: socket.socket, uid: int, gid: int) -> set[int]:
    """Every group of the process at the other end of `sock` when it connected: its gid and its
    supplementary groups (SO_PEERGROUPS, Linux 4.13); the user database's where the kernel cannot
    tell (then a group given only to the process, not to its user, is not seen)."""
    for max_groups in (256, 65536):  # NGROUPS_MAX is 65536
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * max_groups)
        except OSError as err:
            if err.errno == errno.ERANGE:
                continue
            break
        return {gid, *struct.unpack(f"{len(raw) // 4}I", raw)}
    try:
        return {gid, *os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)}
    except KeyError:  # a uid without a name (a container's)
        return {gid}


@dataclass
class _Channel:
    """One attach connection: pending until its hand-over has all arrived, then unclaimed until a
    REGISTER claims its descriptors, then claimed: the registration's liveness signal."""

    conn: socket.socket
    pid: int  # the peer: the process that connected (SO_PEERCRED), whose shares it counts in
    since: float  # time.monotonic() when accepted; once handed over, when its hand-over completed
    data: bytes = b""  # the hand-over's bytes so far
    fds: list[int] = field(default_factory=list)  # received and not claimed: ours to close
    token: bytes = b""  # set once the hand-over is complete
    claimed: bool = False

    @property
    def pending(self) -> bool:
        return not self.token


class _RefusalLog:
    """Warnings about refused attach connections, at most one per kind every `_REFUSAL_LOG_EVERY_S`
    (with a count of those left out): a flood of connections must not flood the log."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < _REFUSAL_LOG_EVERY_S:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        logger.warning(message + (f" ({quiet} more like it since the last warning)" if quiet else ""), *args)


class AttachListener:
    """Accepts attach channels on a Unix socket (mode 0600, or 0660 for `access`'s group) from this
    user, root, or (with a group) the group's members. `claim(token)` hands the descriptors of a
    channel to the registration that names its token; when a channel closes, `on_close(token)`
    runs on the listener thread.

    One thread serves every connection through a selector, never waiting on one: a hand-over is
    read as it arrives (pieces put together), so no slow or idle client delays another worker's.
    What clients can make it hold is bounded (see the constants above): connections that have not
    handed over, hand-overs not claimed, their descriptors, and a reserve of descriptors kept for
    the rest of the daemon. Past a bound, the new connection is refused (closed): its worker
    retries; the daemon never runs out. One process holds a share of each bound only."""

    def __init__(self, path: Path, on_close: Callable[[bytes], None], access: SocketAccess) -> None:
        self.path = path
        self._on_close = on_close
        self._group_gid = None if access.group is None else grp.getgrnam(access.group).gr_gid
        self._cond = threading.Condition()
        # Under _cond (claim runs on other threads): the handed-over channels by token, claimed
        # or not, and the unclaimed ones among them, oldest first.
        self._channels: dict[bytes, _Channel] = {}
        self._unclaimed: dict[bytes, _Channel] = {}
        self._unclaimed_of: collections.Counter[int] = collections.Counter()  # by pid
        self._unclaimed_fds_of: collections.Counter[int] = collections.Counter()  # by pid
        # The listener thread's alone: every connection by descriptor, and the pending ones
        # among them, oldest first, and how many of those each process has.
        self._by_fd: dict[int, _Channel] = {}
        self._pending: dict[int, _Channel] = {}
        self._pending_of: collections.Counter[int] = collections.Counter()
        self._refusals = _RefusalLog()
        self._accept_paused_until = 0.0  # while accept() itself fails (out of descriptors)
        access.make_directory(path.parent)
        self._claim = claim_socket_path(path, f"attach socket {path}")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        access.secure(path)
        self._server.listen(64)
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="attach-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for channel in list(self._by_fd.values()):
            self._drop(channel, notify=False)
        self._selector.close()
        self._server.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.path.unlink(missing_ok=True)
        self._claim.release()

    def claim(self, token: bytes, timeout_s: float = 5.0) -> list[int]:
        """The descriptors sent with `token`; the caller owns (and must close) them."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                channel = self._channels.get(token)
                if channel is not None and not channel.claimed:
                    channel.claimed = True
                    self._take_unclaimed_locked(channel)
                    fds, channel.fds = channel.fds, []
                    return fds
                if channel is not None:
                    raise ValueError("this attach channel was already used by a registration")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ValueError("no attach channel with this token: the worker must open it first")
                self._cond.wait(remaining)

    def is_open(self, token: bytes) -> bool:
        with self._cond:
            return token in self._channels

    @property
    def num_channels(self) -> int:
        """Handed-over channels, claimed or not."""
        return len(self._channels)

    def _run(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            self._expire(now)
            self._resume_accepting(now)
            for key, _ in self._selector.select(timeout=self._until_next_deadline(now)):
                if key.fileobj is self._server:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    os.read(self._wake_r, 64)
                elif (channel := self._by_fd.get(key.fd)) is not None:  # None: closed this round
                    if channel.pending:
                        self._receive_handover(channel)
                    else:
                        self._on_readable(channel)

    def _until_next_deadline(self, now: float) -> float:
        deadlines = [now + 1.0]
        if self._pending:
            deadlines.append(next(iter(self._pending.values())).since + HANDOVER_DEADLINE_S)
        with self._cond:
            if self._unclaimed:
                deadlines.append(next(iter(self._unclaimed.values())).since + CLAIM_DEADLINE_S)
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - now)

    def _expire(self, now: float) -> None:
        """Close the connections that sent no (complete) hand-over in time, and the hand-overs
        that no REGISTER claimed in time, with their descriptors."""
        while self._pending:
            channel = next(iter(self._pending.values()))
            if now - channel.since < HANDOVER_DEADLINE_S:
                break
            self._refusals.warn("idle", "closed an attach connection that sent no hand-over within %.1f s",
                                HANDOVER_DEADLINE_S)
            self._drop(channel, notify=False)
        expired: list[tuple[_Channel, list[int]]] = []
        with self._cond:
            while self._unclaimed:
                channel = next(iter(self._unclaimed.values()))
                if now - channel.since < CLAIM_DEADLINE_S:
                    break
                expired.append((channel, self._detach_locked(channel)))
        for channel, fds in expired:
            self._refusals.warn("unclaimed", "closed an attach channel (and its %d descriptors) that no "
                                "registration claimed within %.0f s", len(fds), CLAIM_DEADLINE_S)
            self._close(channel, fds)

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as err:  # EMFILE, ENFILE, ENOBUFS: it would be readable, and fail, again and again
            self._refusals.warn("accept", "cannot accept attach connections (%s): trying again in %.1f s",
                                err, _ACCEPT_RETRY_S)
            self._selector.unregister(self._server)
            self._accept_paused_until = time.monotonic() + _ACCEPT_RETRY_S
            return
        pid, uid, gid = peer_credentials(conn)
        refusal = self._refusal(conn, pid, uid, gid)
        if refusal is not None:
            self._refusals.warn(*refusal)
            conn.close()
            return
        conn.setblocking(False)
        channel = _Channel(conn, pid, time.monotonic())
        self._by_fd[conn.fileno()] = channel
        self._pending[conn.fileno()] = channel
        self._pending_of[pid] += 1
        self._selector.register(conn, selectors.EVENT_READ)

    def _resume_accepting(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._server, selectors.EVENT_READ)

    def _refusal(self, conn: socket.socket, pid: int, uid: int, gid: int) -> tuple[str, ...] | None:
        """Why a new connection is refused (a kind and a message for `_RefusalLog`), if it is."""
        if not self._trusts(conn, uid, gid):
            return ("uid", f"refusing an attach channel from uid {uid}: neither this user, root, nor a "
                           "member of the socket group")
        if len(self._by_fd) >= MAX_CHANNELS:
            return ("channels", f"refusing an attach channel: {MAX_CHANNELS} are open")
        if self._pending_of[pid] >= MAX_PENDING_PER_PEER:
            return ("pending peer", f"refusing an attach channel from pid {pid}: {MAX_PENDING_PER_PEER} of "
                                    "its connections have not handed over their descriptors yet")
        if len(self._pending) >= MAX_PENDING:
            return ("pending", f"refusing an attach channel: {MAX_PENDING} connections have not handed "
                               "over their descriptors yet")
        if _descriptors_to_spare() < 1 + MAX_FDS:  # the connection, and what it may hand over
            return ("descriptors", "refusing an attach channel: the daemon is short of descriptors "
                                   "(RLIMIT_NOFILE; the rest are kept for its other connections)")
        return None

    def _trusts(self, conn: socket.socket, uid: int, gid: int) -> bool:
        """Whether the peer may hand over KV caches: this user, root, or a member of the socket
        group (its groups when it connected). The socket's mode lets only these in already; this
        holds should it be widened."""
        if uid in (os.geteuid(), 0):
            return True
        return self._group_gid is not None and self._group_gid in _peer_groups(conn, uid, gid)

    def _receive_handover(self, channel: _Channel) -> None:
        """Read what has arrived of `channel`'s hand-over: its token, then the number of descriptors
        sent with it (SCM_RIGHTS). Once all of it has, the channel is unclaimed (and acknowledged)."""
        if _descriptors_to_spare() < MAX_FDS:
            self._refuse_pending(channel, "descriptors", "refusing an attach hand-over: the daemon is "
                                 "short of descriptors (RLIMIT_NOFILE)")
            return
        try:
            msg, fds, flags, _addr = socket.recv_fds(channel.conn, HANDOVER_BYTES - len(channel.data),
                                                     MAX_FDS - len(channel.fds))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._refuse_pending(channel, "failed", f"attach channel failed during hand-over: {err}")
            return
        channel.data += msg
        channel.fds += fds
        if flags & socket.MSG_CTRUNC:  # the kernel closed the descriptors past MAX_FDS
            self._refuse_pending(channel, "malformed", f"refusing an attach hand-over of more than {MAX_FDS} "
                                 "descriptors")
        elif not msg:
            if channel.data or channel.fds:
                self._refuse_pending(channel, "malformed", "an attach connection closed mid hand-over")
            else:  # another daemon probing whether the path is in use
                logger.debug("an attach connection closed without a hand-over")
                self._drop(channel, notify=False)
        elif len(channel.data) == HANDOVER_BYTES:
            self._complete_handover(channel)

    def _complete_handover(self, channel: _Channel) -> None:
        token, count = channel.data[:TOKEN_BYTES], struct.unpack("<I", channel.data[TOKEN_BYTES:])[0]
        if count != len(channel.fds):
            self._refuse_pending(channel, "malformed", f"malformed attach hand-over ({count} descriptors "
                                 f"announced, {len(channel.fds)} sent)")
            return
        with self._cond:
            refusal = self._unclaimed_refusal_locked(token, channel)
            if refusal is None:
                self._take_pending(channel)
                channel.token, channel.since = token, time.monotonic()
                self._channels[token] = self._unclaimed[token] = channel
                self._unclaimed_of[channel.pid] += 1
                self._unclaimed_fds_of[channel.pid] += len(channel.fds)
                self._cond.notify_all()
        if refusal is not None:
            self._refuse_pending(channel, *refusal)
            return
        try:
            channel.conn.send(ACK)  # one byte, into an empty buffer: never blocks
        except OSError:  # the worker is gone already
            self._drop(channel, notify=False)

    def _unclaimed_refusal_locked(self, token: bytes, channel: _Channel) -> tuple[str, str] | None:
        num_fds, pid = len(channel.fds), channel.pid
        if token in self._channels:
            return ("token", "refusing an attach hand-over: its token is another channel's")
        if self._unclaimed_of[pid] >= MAX_UNCLAIMED_PER_PEER:
            return ("unclaimed peer", f"refusing an attach hand-over from pid {pid}: "
                                      f"{MAX_UNCLAIMED_PER_PEER} of its hand-overs are waiting for their "
                                      "registration")
        if self._unclaimed_fds_of[pid] + num_fds > MAX_UNCLAIMED_FDS_PER_PEER:
            return ("unclaimed peer fds", f"refusing an attach hand-over from pid {pid}: its unclaimed "
                                          f"ones would hold over {MAX_UNCLAIMED_FDS_PER_PEER} descriptors")
        if len(self._unclaimed) >= MAX_UNCLAIMED:
            return ("unclaimed", f"refusing an attach hand-over: {MAX_UNCLAIMED} are waiting for "
                                 "their registration")
        if sum(len(c.fds) for c in self._unclaimed.values()) + num_fds > MAX_UNCLAIMED_FDS:
            return ("unclaimed fds", f"refusing an attach hand-over: unclaimed ones hold "
                                     f"{MAX_UNCLAIMED_FDS} descriptors at most")
        return None

    def _refuse_pending(self, channel: _Channel, kind: str, message: str) -> None:
        self._refusals.warn(kind, message)
        self._drop(channel, notify=False)

    def _on_readable(self, channel: _Channel) -> None:
        try:
            data = channel.conn.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the worker is gone (exit, crash or SIGKILL)
            self._drop(channel, notify=True)

    def _drop(self, channel: _Channel, notify: bool) -> None:
        with self._cond:
            fds = self._detach_locked(channel)
        self._close(channel, fds)
        if notify and channel.token:
            try:
                self._on_close(channel.token)
            except Exception:
                logger.exception("cleanup after a closed attach channel failed")

    def _detach_locked(self, channel: _Channel) -> list[int]:
        """Take `channel` out of the tables `claim` reads; returns its unclaimed descriptors."""
        if channel.token and self._channels.get(channel.token) is channel:
            del self._channels[channel.token]
            if not channel.claimed:
                self._take_unclaimed_locked(channel)
        fds, channel.fds = channel.fds, []
        return fds

    def _take_unclaimed_locked(self, channel: _Channel) -> None:
        """`channel` is unclaimed no more (claimed, or closing): out of that table and its shares."""
        del self._unclaimed[channel.token]
        _uncount(self._unclaimed_of, channel.pid, 1)
        _uncount(self._unclaimed_fds_of, channel.pid, len(channel.fds))

    def _take_pending(self, channel: _Channel) -> None:
        """`channel` is pending no more (handed over, or closing): out of that table and its share."""
        if self._pending.pop(channel.conn.fileno(), None) is not None:
            _uncount(self._pending_of, channel.pid, 1)

    def _close(self, channel: _Channel, fds: list[int]) -> None:
        """Close a detached channel's connection and descriptors (on the listener thread)."""
        self._take_pending(channel)
        self._by_fd.pop(channel.conn.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(channel.conn)
        channel.conn.close()
        for fd in fds:
            os.close(fd)


def _uncount(counter: collections.Counter[int], pid: int, n: int) -> None:
    """Take `n` off `pid`'s count, forgetting it at zero: a share table lists only live peers."""
    counter[pid] -= n
    if counter[pid] <= 0:
        del counter[pid]


def _descriptors_to_spare() -> float:
    """How many more descriptors this process may open before it eats into the reserve kept below
    RLIMIT_NOFILE for the rest of the daemon (libzmq aborts the process when it gets none)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    reserve = max(FD_RESERVE_MIN, soft // FD_RESERVE_FRACTION)
    return soft - reserve - _open_descriptors()


def _open_descriptors() -> int:
    """This process's open descriptors (read on each new attach connection and hand-over: a
    few thousand entries at most, as the caps above keep them)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir held
    except OSError:  # no /proc: the caps alone bound the attach socket
        return 0
