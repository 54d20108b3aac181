"""The worker's end of the attach hand-over (`attach.py` is the daemon's): `AttachChannel` passes
the descriptors of `shm.share_cpu_tensors` to the daemon over a Unix socket (SCM_RIGHTS) and then
stays open: it is the registration's liveness signal. When the worker exits, even by SIGKILL, the
kernel closes it and the daemon drops the registration.

The hand-over: the channel's token (TOKEN_BYTES) and how many descriptors come with it (a
little-endian u32), the descriptors alongside; the daemon answers one byte (ACK) once it has it all.

Who: a worker hands its caches to its own user, root, or the owner of the socket's directory where
that directory has one of the worker's groups and only its owner may write in it
(`_owns_a_directory_of_my_group`).
"""

from __future__ import annotations

import os
import socket
import stat
import struct

TOKEN_BYTES = 16
HANDOVER_BYTES = TOKEN_BYTES + 4  # the token, then how many descriptors come with it
ACK = b"\x01"


class AttachChannel:
    """The worker's end of a registration: carries its descriptors once, then stays open."""

    def __init__(self, sock: socket.socket, token: bytes) -> None:
        self._sock = sock
        self.token = token

    @classmethod
    def open(cls, path: str, fds: list[int], timeout_s: float = 10.0) -> AttachChannel:
        token = os.urandom(TOKEN_BYTES)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            _check_daemon_user(sock, path)
            socket.send_fds(sock, [token + struct.pack("<I", len(fds))], fds)
            if sock.recv(1) != ACK:
                raise ConnectionError(f"the daemon at {path} refused the attach channel")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock, token)

    def is_open(self) -> bool:
        """False once the daemon's end has closed (it stopped or restarted)."""
        try:
            return bool(self._sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK))
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._sock.close()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of the process at the other end of `sock`, as they were when it
    connected (or listened); the pid as this process's pid namespace sees it."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


def _check_daemon_user(sock: socket.socket, path: str) -> None:
    """Hand the KV caches over only to a process trusted with them (SO_PEERCRED: whoever listens
    on `path`): a process of this user, of root, or of the owner of the socket's directory where
    that is a --socket-group daemon's (`_owns_a_directory_of_my_group`). Anyone else could read and write
    them: another user that made the socket directory first (/tmp/lmcache-mp-$UID) and listens
    where the daemon's attach socket should be."""
    uid = peer_credentials(sock)[1]
    if uid in (os.geteuid(), 0) or _owns_a_directory_of_my_group(uid, path):
        return
    raise PermissionError(f"the attach socket {path} is served by uid {uid}, not by this user "
                          f"(uid {os.geteuid()}), root, or the owner of its directory where that directory "
                          "has one of this user's groups and only its owner may write in it (a "
                          "--socket-group daemon's): not handing it the KV caches")


def _owns_a_directory_of_my_group(uid: int, path: str) -> bool:
    """Whether `uid` owns the directory of the socket `path`, nobody else may write in it, and its
    group is one of this process's: what a --socket-group daemon running as another user makes
    (0750, its group the socket group, of which the worker must be a member to reach it at all).
    Why that is enough: a user can give a directory only a group it is a member of itself, so a
    squatter passes only if it shares one of this worker's groups with it; and the members of the
    socket group are trusted with each other's caches already (each may RETRIEVE what the others
    stored). Nobody but the owner may write in it, so the owner's is the only socket there. The
    one exposure left is a catch-all group (`users`) that a hostile local user shares with the
    worker: keep the vLLM user out of such groups, or run the daemon as vLLM's own user or root."""
    try:
        st = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022
            and st.st_gid in {os.getegid(), *os.getgroups()})
