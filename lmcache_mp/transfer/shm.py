"""Zero-copy CPU registration: shared-memory KV caches handed over by file descriptor.

Worker side: `share_cpu_tensors` moves each cache's storage into shared memory *in place*
(`shm_move`: the storage's memory is swapped, so vLLM keeps using the very same tensors and
views) and returns small handles plus one descriptor per storage. `AttachChannel` passes those
descriptors to the daemon over a Unix socket (SCM_RIGHTS) and then stays open: it is the
registration's liveness signal. When the worker exits, even by SIGKILL, the kernel closes
it and the daemon drops the registration.

Daemon side: `AttachListener` accepts the channels, `map_storages` maps the descriptors and
`view_shared` opens each handle as a view of them.

The memory is a memfd (or, where that path is unavailable, torch's unlinked shared memory): there
is no name in /dev/shm to leak, and the kernel frees it once the last process holding it is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmcache_mp.config import SocketAccess, claim_socket_path
from lmcache_mp.custom_types import SharedMemoryTensor
from lmcache_mp.storage.pool_memory import MADV_POPULATE_WRITE, _madvise
from lmcache_mp.transfer.dtypes import dtype_to_str, str_to_dtype
from lmcache_mp.transfer.shm_move import move_to_shared_memory

logger = logging.getLogger(__name__)

TOKEN_BYTES = 16
MAX_FDS = 64  # storages per registration; vLLM uses one for all layers
MAX_CHANNELS = 4096
_ACK = b"\x01"
_POPULATE_STEP_BYTES = 256 << 20


# ---- worker side --------------------------------------------------------------------------


def share_cpu_tensors(tensors: list[torch.Tensor]) -> tuple[list[SharedMemoryTensor], list[int]]:
    """Move each tensor's storage into shared memory in place; return handles and the
    descriptors (owned by torch: do not close them) in storage-index order."""
    handles: list[SharedMemoryTensor] = []
    fds: list[int] = []
    index_of: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"expected CPU tensors, got one on {tensor.device}")
        storage = tensor.untyped_storage()
        if not storage.is_shared():
            move_to_shared_memory(storage)
        key = storage.data_ptr()
        if key not in index_of:
            try:
                fd, _size = storage._share_fd_cpu_()
            except RuntimeError as err:
                raise RuntimeError(
                    "cannot get a descriptor for a shared KV storage; torch's sharing strategy "
                    "must be 'file_descriptor' (the Linux default)"
                ) from err
            index_of[key] = len(fds)
            fds.append(fd)
        handles.append(SharedMemoryTensor(state=SharedMemoryTensor.State(
            storage_index=index_of[key],
            storage_nbytes=storage.nbytes(),
            dtype=dtype_to_str(tensor.dtype),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(),
        )))
    return handles, fds


class AttachChannel:
    """The worker's end of a registration: carries its descriptors once, then stays open."""

    def __init__(self, sock: socket.socket, token: bytes):
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
            if sock.recv(1) != _ACK:
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


def _check_daemon_user(sock: socket.socket, path: str) -> None:
    """Hand the KV caches over only to a process of this user or root (SO_PEERCRED: whoever
    listens on `path`). Another user's could read and write them: one that made the socket
    directory first (/tmp/lmcache-mp-$UID) and listens where the daemon's attach socket should
    be. This refuses no real deployment: a daemon takes attach channels from its own user only,
    unless it runs as root (a vLLM of a --socket-group member registers with a root daemon)."""
    uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    if uid not in (os.geteuid(), 0):
        raise PermissionError(f"the attach socket {path} is served by uid {uid}, not by this user "
                              f"(uid {os.geteuid()}) or root: not handing it the KV caches")


# ---- daemon side ----------------------------------------------------------------------------


@dataclass
class _Channel:
    conn: socket.socket
    token: bytes
    fds: list[int] = field(default_factory=list)
    claimed: bool = False


class AttachListener:
    """Accepts attach channels on a Unix socket (mode 0600, or 0660 for `access`'s group).
    `claim(token)` hands the descriptors of a channel to the registration that names its token;
    when a channel closes, `on_close(token)` runs on the listener thread."""

    def __init__(self, path: Path, on_close: Callable[[bytes], None], access: SocketAccess):
        self.path = path
        self._on_close = on_close
        self._channels: dict[bytes, _Channel] = {}
        self._by_fd: dict[int, _Channel] = {}
        self._cond = threading.Condition()
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
        return len(self._by_fd)

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is self._server:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    os.read(self._wake_r, 64)
                else:
                    self._on_readable(self._by_fd[key.fd])

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except BlockingIOError:
            return
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid() and os.getuid() != 0:
            logger.warning("refusing an attach channel from uid %d", uid)
            conn.close()
            return
        if len(self._by_fd) >= MAX_CHANNELS:
            logger.warning("refusing an attach channel: %d are open", MAX_CHANNELS)
            conn.close()
            return
        conn.settimeout(2.0)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, TOKEN_BYTES + 4, MAX_FDS)
        except OSError as err:
            logger.warning("attach channel failed during hand-over: %s", err)
            conn.close()
            return
        if not msg and not fds:  # closed before any hand-over: another daemon probing the path
            logger.debug("an attach connection closed without a hand-over")
            conn.close()
            return
        if len(msg) != TOKEN_BYTES + 4 or struct.unpack("<I", msg[TOKEN_BYTES:])[0] != len(fds):
            logger.warning("malformed attach hand-over (%d bytes, %d fds)", len(msg), len(fds))
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        channel = _Channel(conn, msg[:TOKEN_BYTES], list(fds))
        conn.sendall(_ACK)
        conn.setblocking(False)
        with self._cond:
            self._channels[channel.token] = channel
            self._by_fd[conn.fileno()] = channel
            self._cond.notify_all()
        self._selector.register(conn, selectors.EVENT_READ)

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
            self._channels.pop(channel.token, None)
            self._by_fd.pop(channel.conn.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(channel.conn)
        channel.conn.close()
        for fd in channel.fds:
            os.close(fd)
        if notify:
            try:
                self._on_close(channel.token)
            except Exception:
                logger.exception("cleanup after a closed attach channel failed")


def map_storages(fds: list[int], nbytes: list[int]) -> list[torch.UntypedStorage]:
    """Map shared-memory descriptors (closing them) as torch storages. The mapping lives as
    long as any tensor viewing it. Nothing is touched: `prebuild_page_tables` once the
    registration is accepted."""
    storages = []
    try:
        for fd, size in zip(fds, nbytes, strict=True):
            _check_cannot_shrink(fd)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"shared memory descriptor holds {actual} bytes, the handle says {size}")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            storages.append(torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage())
    finally:
        for fd in fds:
            os.close(fd)
    return storages


def _check_cannot_shrink(fd: int) -> None:
    """Refuse memory its worker could cut short under the daemon's mapping: the daemon's next
    copy of the cut pages would die of SIGBUS. A memfd sealed with F_SEAL_SHRINK (as `shm_move`
    makes them) cannot shrink; nothing else is accepted."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: not a memfd (a plain file, torch's shm_open memory, a pipe...)
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("its shared memory can shrink under the daemon: only a memfd sealed with "
                         f"F_SEAL_SHRINK is accepted, as the worker adapter makes them (seals {seals:#x})")


def prebuild_page_tables(storages: list[torch.UntypedStorage]) -> None:
    """Build the page tables of freshly mapped storages on a background thread, once their
    registration is accepted (a refused one must not fault in the worker's memory)."""
    threading.Thread(target=_build_page_tables, args=(storages,), name="attach-populate", daemon=True).start()


def _build_page_tables(storages: list[torch.UntypedStorage]) -> None:
    """Build the page tables of freshly mapped storages, so the first copies don't take a page fault
    per page. In the background: with MAP_POPULATE, REGISTER took ~0.7 s per GiB before it answered.
    Holding `storages` keeps the mappings alive until done; a copy meanwhile faults on its own."""
    for storage in storages:
        for start in range(0, storage.nbytes(), _POPULATE_STEP_BYTES):
            try:
                _madvise(storage.data_ptr() + start, min(_POPULATE_STEP_BYTES, storage.nbytes() - start),
                         MADV_POPULATE_WRITE)
            except OSError as err:  # a kernel before 5.14: pages are mapped as copies touch them
                logger.debug("not prebuilding the page tables of a shared KV cache: %s", err)
                return


def view_shared(handle: SharedMemoryTensor, storages: list[torch.UntypedStorage]) -> torch.Tensor:
    """The tensor `handle` describes, viewing one of the mapped `storages`. The geometry is
    the client's, so it is checked: a view that would reach outside the mapping is refused."""
    st = handle.state
    if not 0 <= st.storage_index < len(storages):
        raise ValueError(f"handle names shared storage {st.storage_index}, "
                         f"only {len(storages)} were attached")
    storage = storages[st.storage_index]
    if storage.nbytes() != st.storage_nbytes:
        raise ValueError(f"shared storage {st.storage_index} has {storage.nbytes()} bytes, "
                         f"the handle says {st.storage_nbytes}")
    dtype = str_to_dtype(st.dtype)
    if (len(st.shape) != len(st.stride) or min(st.shape, default=1) <= 0
            or min(st.stride, default=0) < 0 or st.storage_offset < 0):
        raise ValueError(f"invalid view: shape {st.shape}, stride {st.stride}, "
                         f"offset {st.storage_offset}")
    last = st.storage_offset + sum((n - 1) * s for n, s in zip(st.shape, st.stride, strict=True))
    # A KV cache's elements are distinct bytes: more of them than the storage holds (a zero
    # stride repeating one) is no cache, and would overflow torch's element count.
    if max(last + 1, math.prod(st.shape)) * dtype.itemsize > storage.nbytes():
        raise ValueError(f"a {st.shape} view at offset {st.storage_offset} overruns the "
                         f"{storage.nbytes()}-byte shared storage")
    view = torch.empty(0, dtype=dtype)
    view.set_(storage, st.storage_offset, st.shape, st.stride)
    return view
