"""The disk tier's directory (`disk.py`), reached only through descriptors it holds, never a symlink.

Layout. An object is named by 40 hex digits and is the file `ROOT/ab/ab12...(40 hex).kv`, in
the shard directory of its first two digits (all 256 shards are created at start). Other entries
of the directory: `lock` (the owning daemon's pid, flock'ed while it runs: one daemon per
directory) and `tmp/` (files being written, renamed into place once written; whatever is there at
start is a leftover and is removed, once the lock is taken).

Symlinks. No path under the directory is ever followed: whoever can plant one there must not get
the tier to write, truncate, list or delete anything elsewhere. The directory is opened once and
everything works relative to that descriptor and to one of `tmp/`; every shard and file is opened
with O_NOFOLLOW (shards with O_DIRECTORY too). A symlink, or anything of the wrong type, at
`lock`, `tmp` or a shard refuses the start with an error naming it (so does a `lock` with other
hard links: it is truncated and written). One at an object's name is foreign: never listed,
opened, written through or unlinked (opening it answers None; a write renames its file over the
link itself, which rename never follows). The directory's own path is the operator's to choose,
symlinks included.

Closing. `close` marks the directory closed: from then on the tier touches nothing (the directory
may be another daemon's). Its descriptors, the lock's included, are closed by the last operation
still holding them (`held`), so that none ever uses a descriptor number closed under it and
reused for another file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import threading
from collections.abc import Iterator

_FILE_NAME = re.compile(r"[0-9a-f]{40}\.kv")
_SUFFIX = ".kv"
_LOCK_FILE = "lock"
_TMP_DIR = "tmp"
# A directory of the tier (a shard, tmp/): never reached through a symlink.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# An object opened for reading: never through a symlink, and O_NONBLOCK so that a FIFO put in its
# place cannot hang the reader (on a regular file it changes nothing).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# A new file in tmp/.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskDirectory:
    """The tier's directory, its sub-directories and its lock, held open as descriptors; see the
    module docstring for the layout and invariants. Every method is safe to call concurrently;
    those that touch a file are to be called while `held` yields True."""

    def __init__(self, root: str) -> None:
        """Create and probe `root` and its sub-directories, open them and take the lock. Raises
        OSError where the directory is unusable, and ValueError where one of its entries is a
        symlink or of the wrong kind, or another daemon holds the lock."""
        self.root = root
        self._lock = threading.Lock()  # guards _closed and _holders
        self._closed = False
        self._holders = 0  # operations in flight that use the descriptors
        self._root_fd = self._tmp_fd = self._lock_fd = -1
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            # The operator's path, symlinks and all; below it, nothing is followed.
            self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._tmp_fd = self._own_directory(_TMP_DIR)
            probe = f".probe-{os.getpid()}-{threading.get_ident()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=self._tmp_fd))
            os.unlink(probe, dir_fd=self._tmp_fd)
            for shard in range(256):
                os.close(self._own_directory(f"{shard:02x}"))
            self._lock_fd = self._take_lock()
        except BaseException:
            self._close_descriptors()
            raise

    # -- start --------------------------------------------------------------------------------

    def _own_directory(self, name: str) -> int:
        """The tier's sub-directory `name`, created if absent, opened without following a symlink:
        a symlink there is refused (mkdir leaves it, and opening it fails), never followed."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self._root_fd)
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except NotADirectoryError:  # what O_DIRECTORY | O_NOFOLLOW says of a symlink, too
            self._refuse_symlink(name)
            raise

    def _refuse_symlink(self, name: str) -> None:
        """Raise the start's error if the tier's own entry `name` is a symlink."""
        if stat.S_ISLNK(os.lstat(name, dir_fd=self._root_fd).st_mode):
            raise ValueError(f"disk tier: {os.path.join(self.root, name)} is a symbolic link, and the "
                             "tier follows none under its directory; remove it, or pass another directory")

    def _take_lock(self) -> int:
        # O_NOFOLLOW: the lock is truncated and written, so a symlink would have its target (or,
        # dangling, a new file at its target) written; O_NONBLOCK: a FIFO there cannot hang us.
        try:
            fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o600, dir_fd=self._root_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._refuse_symlink(_LOCK_FILE)
            raise
        try:
            self._check_lock_file(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"disk tier: {self.root} is in use by another lmcache-mp daemon "
                             f"(pid {owner}); give each daemon its own directory") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _check_lock_file(self, fd: int) -> None:
        # A hard link is another way to reach a file outside the directory with our truncate.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise ValueError(f"disk tier: {os.path.join(self.root, _LOCK_FILE)} is not a plain file of "
                             "its own (a FIFO, a device, a hard link to another file?); remove it")

    def remove_temp_files(self) -> None:
        """Remove the leftovers in tmp/ (only ever called once the lock is taken: until then they
        could be another daemon's writes in flight)."""
        with os.scandir(self._tmp_fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    continue  # never one of ours (writes are files); emptying it would walk into it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=self._tmp_fd)  # a symlink goes itself, never its target

    def objects(self) -> Iterator[tuple[str, os.stat_result]]:
        """The name and lstat of each regular file named like an object in its own shard; anything
        else there (a symlink, a FIFO, a directory) is foreign and left out."""
        for shard in range(256):
            prefix = f"{shard:02x}"
            with self._shard(prefix) as shard_fd, os.scandir(shard_fd) as entries:
                for entry in entries:
                    if (_FILE_NAME.fullmatch(entry.name) and entry.name.startswith(prefix)
                            and entry.is_file(follow_symlinks=False)):
                        yield entry.name[:-len(_SUFFIX)], entry.stat(follow_symlinks=False)

    # -- descriptors --------------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Keeps the descriptors open across the caller's file I/O; yields False once the directory
        is closed, when the caller must touch nothing (the directory may be another daemon's)."""
        with self._lock:
            held = not self._closed
            self._holders += held
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    self._holders -= 1
                    last = self._closed and not self._holders
                if last:
                    self._close_descriptors()

    def close(self) -> None:
        """Mark the directory closed; its descriptors close now, or with the last holder. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = not self._holders
        if last:  # else the last operation in flight closes them
            self._close_descriptors()

    def _close_descriptors(self) -> None:
        """Close the descriptors (the lock's releases the flock); once, by close or its last holder."""
        for fd in (self._lock_fd, self._tmp_fd, self._root_fd):
            if fd >= 0:
                os.close(fd)
        self._root_fd = self._tmp_fd = self._lock_fd = -1

    @contextlib.contextmanager
    def _shard(self, name: str) -> Iterator[int]:
        """The shard directory of object `name` (or of a 2-digit prefix), relative to the root and
        never through a symlink: one there raises NotADirectoryError."""
        fd = os.open(name[:2], _DIR_FLAGS, dir_fd=self._root_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- files --------------------------------------------------------------------------------

    def create_temp(self, tmp: str, direct: bool) -> int:
        """A new file `tmp` in tmp/, opened for writing (with O_DIRECT when `direct`). A filesystem
        that refuses O_DIRECT raises EINVAL, and what the open may have created is removed."""
        if not direct:
            return os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=self._tmp_fd)
        try:
            return os.open(tmp, _CREATE_FLAGS | os.O_DIRECT, 0o600, dir_fd=self._tmp_fd)
        except OSError as e:
            if e.errno == errno.EINVAL:
                self.discard_temp(tmp)
            raise

    def discard_temp(self, tmp: str) -> None:
        """Unlink `tmp` from tmp/, if it is there."""
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=self._tmp_fd)

    def publish(self, tmp: str, name: str) -> None:
        """Rename `tmp` from tmp/ to object `name`: it replaces whatever has the name, a symlink
        included, without following it."""
        with self._shard(name) as shard:
            os.rename(tmp, name + _SUFFIX, src_dir_fd=self._tmp_fd, dst_dir_fd=shard)

    def open_object(self, name: str) -> int | None:
        """Object `name`'s file opened for reading; None if it or its shard is a symlink or anything
        else but a regular file (resp. a directory), which is never followed."""
        try:
            with self._shard(name) as shard:
                fd = os.open(name + _SUFFIX, _READ_FLAGS, dir_fd=shard)
        except NotADirectoryError:  # the shard is a symlink, or not a directory
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # the file is a symlink
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device, a directory
            os.close(fd)
            return None
        return fd

    def unlink_object(self, name: str) -> None:
        """Unlink object `name`'s file; unlink never follows a symlink, and the shard is opened
        without following one."""
        with self._shard(name) as shard:
            os.unlink(name + _SUFFIX, dir_fd=shard)
