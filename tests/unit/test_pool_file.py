"""Warm restart at the pool's level: a pool in a file that a new pool adopts (pool/file.py,
pool/records.py, pool/integrity.py), crash consistency under SIGKILL at random instants, and the
files that must never be adopted."""

from __future__ import annotations

import os
import random
import signal
import stat
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.storage.chunk_format import encode_head
from lmcache_mp.storage.pool import memory as pool_memory
from lmcache_mp.storage.pool.file import _layout, open_pool_file
from lmcache_mp.storage.pool.integrity import PoolIntegrity
from lmcache_mp.storage.pool.location import PoolFileError, discard_pool_file
from lmcache_mp.storage.pool.pool import MemoryPool, ObjectState, PoolObject
from tests.support.helpers import wait_for

CAPACITY = 1 << 20
ALIGN = 4096
NBYTES = 3 * ALIGN + 100
FMT = ChunkFormat("m", 1, 0, "CPU_ATTN", "bfloat16", 2, (16, 2, 8), 16)


@pytest.fixture
def pool_path() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="lmc-pool-", dir="/dev/shm"))
    yield directory / "pool"
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


def open_pool(path: Path, *, fresh: bool = False, capacity: int = CAPACITY) -> MemoryPool:
    backing = open_pool_file(path, capacity, ALIGN, fresh=fresh)
    assert backing is not None
    return MemoryPool(capacity, align=ALIGN, backing=backing)


def chunk_hash(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def content(i: int) -> torch.Tensor:
    return torch.full((NBYTES,), i % 251 + 1, dtype=torch.uint8)


def store_chain(pool: MemoryPool, first: int, count: int) -> list[PoolObject]:
    """Chunks first..first+count-1, each the child of the one before, committed with records."""
    hashes = [chunk_hash(i) for i in range(first, first + count)]
    keys = [ChunkKey(h, FMT) for h in hashes]
    objects = pool.reserve([k.ident for k in keys], NBYTES)
    assert all(isinstance(o, PoolObject) for o in objects)
    for i, obj in zip(range(first, first + count), objects, strict=True):
        obj.data.copy_(content(i))  # type: ignore[union-attr]
    parents = [chunk_hash(first - 1) if first else b"", *hashes[:-1]]
    records = [(p, encode_head(k, NBYTES)) for p, k in zip(parents, keys, strict=True)]
    pool.commit(objects, records=records)  # type: ignore[arg-type]
    pool.link([k.ident for k in keys])
    return objects  # type: ignore[return-value]


def readable(pool: MemoryPool, i: int) -> bool:
    objects = pool.pin([ChunkKey(chunk_hash(i), FMT).ident])
    if objects is None:
        return False
    try:
        assert torch.equal(objects[0].data, content(i)), f"chunk {i} has wrong bytes"
    finally:
        pool.unpin(objects)
    return True


def drain(pool: MemoryPool) -> None:
    integrity = PoolIntegrity(pool, None)
    try:
        while integrity.step(None):
            pass
    finally:
        integrity.close(0)


def test_a_new_pool_adopts_every_chunk_bit_exact_sealed_or_not(pool_path: Path) -> None:
    pool = open_pool(pool_path)
    store_chain(pool, 0, 6)
    for _ in range(4):  # seal the four oldest; the last two stay COMMITTED
        obj = pool.take_unsealed()
        assert obj is not None
        pool.seal(obj)
        pool.sealed(obj)
    pool.close()
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o600

    again = open_pool(pool_path)
    stats = again.stats()
    assert stats.adoption.adopted_objects == 6 and stats.adoption.adopted_unsealed == 2
    assert stats.unverified == 4 and stats.unsealed == 2
    assert [readable(again, i) for i in range(6)] == [False] * 4 + [True] * 2  # unverified: unseen
    drain(again)
    assert [readable(again, i) for i in range(6)] == [True] * 6
    stats = again.stats()
    assert stats.adoption.verified_total == 4 and stats.unverified == stats.unsealed == 0
    # Chains survive: the tail is evicted first (own class, LRU, ancestors more recent).
    for i in range(6, 6 + again.capacity_bytes // NBYTES):
        store_chain(again, 100 + i, 1)
        if not readable(again, 5):
            break
    assert readable(again, 0), "the chain's head went before its tail"
    again.close()


def test_a_corrupted_sealed_chunk_is_a_miss_and_freed(pool_path: Path) -> None:
    pool = open_pool(pool_path)
    objects = store_chain(pool, 0, 3)
    drain(pool)
    pool.close()
    with open(pool_path, "r+b") as f:  # a byte of the middle chunk's payload, in the file
        f.seek(_layout(CAPACITY, ALIGN).data_offset + objects[1].offset + 17)
        f.write(b"\xff")
    again = open_pool(pool_path)
    drain(again)
    assert [readable(again, i) for i in range(3)] == [True, False, True]
    assert again.stats().adoption.dropped_total == 1 and again.num_objects == 2
    again.close()


def test_an_unsealed_chunk_is_never_served_from_a_pool_file_that_may_outlive_the_machine(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On a disk file system a machine crash writes pages back in any order: a record that
    survived says nothing of its payload. Chunks without a checksum are dropped there; sealed ones
    are verified as anywhere."""
    path = tmp_path / "pools" / "pool"
    pool = open_pool(path)
    assert pool._records is not None and not pool._records.file.in_memory, "tmp_path is on a tmpfs"
    objects = store_chain(pool, 0, 3)
    obj = pool.take_unsealed()  # only the oldest is sealed when the machine dies
    assert obj is not None
    pool.seal(obj)
    pool.sealed(obj)
    pool.close()
    # What the disk may hold after the crash: the last chunk's record, not its payload's page.
    with open(path, "r+b") as f:
        f.seek(_layout(CAPACITY, ALIGN).data_offset + objects[2].offset)
        f.write(bytes(ALIGN))
    again = open_pool(path)
    drain(again)
    assert [readable(again, i) for i in range(3)] == [True, False, False]
    adoption = again.stats().adoption
    assert (adoption.adopted_objects, adoption.verified_total, adoption.dropped_total) == (1, 1, 2)
    assert "not on a tmpfs" in caplog.text
    again.close()


def test_evicted_aborted_and_cleared_chunks_are_not_adopted(pool_path: Path) -> None:
    pool = open_pool(pool_path)
    store_chain(pool, 0, 3)
    writing = pool.reserve([ChunkKey(chunk_hash(50), FMT).ident], NBYTES)
    pool.abort(writing)  # type: ignore[arg-type]
    still_writing = pool.reserve([ChunkKey(chunk_hash(51), FMT).ident], NBYTES)[0]
    assert isinstance(still_writing, PoolObject)
    assert pool.clear() == 3
    store_chain(pool, 10, 2)
    pool.close()
    again = open_pool(pool_path)
    assert again.num_objects == 2 and [readable(again, i) for i in (10, 11)] == [True, True]
    again.close()


def test_fresh_pool_discards_and_a_held_file_is_refused(pool_path: Path) -> None:
    pool = open_pool(pool_path)
    store_chain(pool, 0, 2)
    with pytest.raises(PoolFileError, match="in use by another daemon"):
        open_pool_file(pool_path, CAPACITY, ALIGN, fresh=False)
    pool.close()
    fresh = open_pool(pool_path, fresh=True)
    assert fresh.num_objects == 0
    fresh.close()
    assert discard_pool_file(pool_path) and not pool_path.exists()
    assert not discard_pool_file(pool_path)


def _tamper(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, os.path.getsize(path) - 4096)
    elif how == "garbage":
        with open(path, "r+b") as f:
            f.write(os.urandom(4096))
    elif how == "other size":
        pass  # opened with another capacity below
    elif how == "loose mode":
        os.chmod(path, 0o644)
    elif how == "other user":
        os.chown(path, 65534, 65534)
    elif how == "symlink":
        target = path.with_name("target")
        os.rename(path, target)
        os.symlink(target, path)


@pytest.mark.parametrize("how", ["truncated", "garbage", "other size", "loose mode", "other user",
                                 "symlink"])
def test_a_file_that_is_not_ours_as_written_is_never_adopted(pool_path: Path, how: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    if how == "other user" and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    pool = open_pool(pool_path)
    store_chain(pool, 0, 3)
    pool.close()
    _tamper(pool_path, how)
    target = pool_path.with_name("target")
    before = target.read_bytes() if how == "symlink" else b""
    capacity = 2 * CAPACITY if how == "other size" else CAPACITY
    again = open_pool(pool_path, capacity=capacity)
    assert again.num_objects == 0 and again.stats().adoption.adopted_objects == 0
    assert "not adopted" in caplog.text
    st = os.lstat(pool_path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    if how == "symlink":
        assert target.read_bytes() == before  # the link's target is never touched
    store_chain(again, 0, 1)
    assert readable(again, 0)
    again.close()


# ---- SIGKILL at random instants ------------------------------------------------------------------

_REPORT = struct.Struct("<I")


def _store_until_killed(path: Path, report_fd: int, first: int) -> None:
    """The child: a stream of single-chunk STOREs into the adopted pool, each reported (its
    "answer") once committed; sealing runs beside them as in the daemon."""
    torch.set_num_threads(1)
    pool = open_pool(path)
    integrity = PoolIntegrity(pool, None)
    i = first
    while True:
        store_chain(pool, i, 1)
        integrity.poke()
        os.write(report_fd, _REPORT.pack(i))
        i += 1


def test_sigkill_at_any_instant_loses_no_answered_chunk_and_adopts_no_torn_one(pool_path: Path) -> None:
    rng = random.Random(1)
    open_pool(pool_path).close()
    answered: set[int] = set()
    first = 0
    trials = 200
    for _trial in range(trials):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read_fd)
            try:
                _store_until_killed(pool_path, write_fd, first)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        os.close(write_fd)
        # Kill after a random number of answers (0 to 40), at a random point of the next STORE.
        wanted = rng.randrange(0, 40)
        got = b""
        while len(got) < wanted * _REPORT.size:
            more = os.read(read_fd, 4096)
            assert more, "the child died"
            got += more
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while more := os.read(read_fd, 4096):
            got += more
        os.close(read_fd)
        now = {_REPORT.unpack_from(got, at)[0] for at in range(0, len(got) - len(got) % 4, 4)}
        answered |= now
        pool = open_pool(pool_path)
        drain(pool)
        # Every adopted byte is checked; one chunk past the last answer may be there, committed
        # but killed before its answer went out.
        live = {i for i in range(max(now | {first - 1}) + 2) if readable(pool, i)}
        assert pool.num_objects == len(live), "a chunk was adopted under a key never stored"
        first = max(live | now | {first - 1}) + 1
        # Every chunk answered in this trial and not evicted since is there. The pool holds the
        # newest ~CAPACITY / NBYTES chunks: older ones may have been evicted, which is no loss.
        keep = CAPACITY // (NBYTES + ALIGN) // 2
        recent = {i for i in now if i >= first - keep}
        assert recent <= live, f"answered chunks {sorted(recent - live)} were not adopted"
        assert pool.stats().adoption.dropped_total == 0
        assert all(obj.state is ObjectState.READY for obj in pool._index.values())
        pool.close()


def test_a_kernel_without_populate_write_leaves_adopted_bytes_alone(pool_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14 the pool faults its memory in by writing a byte per page: never into a
    pool file, whose pages may hold the chunks it adopts (they are allocated instead)."""
    pool = open_pool(pool_path)
    store_chain(pool, 0, 3)
    pool.close()
    monkeypatch.setattr(pool_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # EINVAL, as an old kernel says
    again = open_pool(pool_path)
    assert not again._memory._populate, "the fallback was not taken"
    drain(again)
    assert [readable(again, i) for i in range(3)] == [True] * 3
    again.close()


def test_a_pool_file_that_cannot_be_made_leaves_the_pool_in_anonymous_memory(
        caplog: pytest.LogCaptureFixture) -> None:
    """No /dev/shm, a read-only one, a path through a file: one WARNING, and the daemon serves."""
    assert open_pool_file(Path("/etc/hostname/lmcache-mp/pool"), CAPACITY, ALIGN, fresh=False) is None
    assert "the pool lives in anonymous memory" in caplog.text


def test_a_directory_others_may_write_in_is_not_used(pool_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    os.chmod(pool_path.parent, 0o777)  # another user could swap the file for their own
    try:
        assert open_pool_file(pool_path, CAPACITY, ALIGN, fresh=False) is None
    finally:
        os.chmod(pool_path.parent, 0o700)
    assert "is not this user's alone to write in" in caplog.text and not pool_path.exists()


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def test_the_sealer_hashes_in_a_child_at_the_lowest_priority_as_the_daemon_would(pool_path: Path) -> None:
    """The checksums come from a child process at nice 19 (it shares no GIL with the daemon's
    threads, which all stay at the daemon's priority), and a restart verifies every one of them in
    the daemon's own code: the two compute the same checksum."""
    pool = open_pool(pool_path)
    store_chain(pool, 0, 5)
    integrity = PoolIntegrity(pool, None)
    pid = integrity.checksum_pid
    assert pid is not None and _nice(pid) == 19 and _nice(os.getpid()) == 0
    wait_for(lambda: pool.stats().unsealed == 0, "the sealer sealed every chunk")
    integrity.close(0)
    assert not Path(f"/proc/{pid}").exists()  # close() waited for it
    pool.close()
    again = open_pool(pool_path)
    drain(again)
    adoption = again.stats().adoption
    assert (adoption.adopted_unsealed, adoption.verified_total, adoption.dropped_total) == (0, 5, 0)
    assert [readable(again, i) for i in range(5)] == [True] * 5
    again.close()


def test_a_sealer_whose_child_died_seals_in_its_own_thread(pool_path: Path) -> None:
    pool = open_pool(pool_path)
    integrity = PoolIntegrity(pool, None)
    pid = integrity.checksum_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    store_chain(pool, 0, 3)
    integrity.poke()
    wait_for(lambda: pool.stats().unsealed == 0, "sealed without the child")
    assert integrity.checksum_pid is None
    integrity.close(0)
    pool.close()
    again = open_pool(pool_path)
    drain(again)
    assert again.stats().adoption.verified_total == 3 and again.stats().adoption.dropped_total == 0
    again.close()


def _start_sealer_and_wait(path: Path, report_fd: int) -> None:
    """In a child: a pool whose sealer has its checksum process; report that process's pid."""
    pool = open_pool(path)
    integrity = PoolIntegrity(pool, None)
    os.write(report_fd, str(integrity.checksum_pid).encode() + b"\n")
    signal.pause()


def test_the_checksum_process_ends_with_the_daemon_however_it_dies(pool_path: Path) -> None:
    """The kernel closes a SIGKILLed daemon's end of the pipe: the child reads its end and exits."""
    read_fd, write_fd = os.pipe()
    daemon = os.fork()
    if daemon == 0:  # pragma: no cover - the child
        os.close(read_fd)
        try:
            _start_sealer_and_wait(pool_path, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    with os.fdopen(read_fd) as report:
        line = report.readline().strip()
    assert line.isdigit(), line
    checksum_pid = int(line)
    assert Path(f"/proc/{checksum_pid}").exists()
    os.kill(daemon, signal.SIGKILL)
    os.waitpid(daemon, 0)

    def gone() -> bool:  # exited (a zombie until its new parent reaps it counts)
        try:
            return Path(f"/proc/{checksum_pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
        except OSError:
            return True

    wait_for(gone, "the checksum process exited after the daemon was killed")


def test_a_chunk_whose_prefix_went_while_it_was_sealed_is_evicted_first(pool_path: Path) -> None:
    """The sealer pins one chunk while it checksums it, and a pin protects an object, not its
    prefix: a STORE's evictions meanwhile may take its parent. Unpinned, it is a chunk no LOOKUP can
    reach: it goes first, before any chunk that can still be hit (it used to come back as the most
    recently used, and outlive them)."""
    pool = open_pool(pool_path, fresh=True)
    try:
        first, second = store_chain(pool, 0, 2)
        sealed = pool.take_unsealed()
        assert sealed is first
        pool.seal(first)
        pool.sealed(first)
        assert pool.take_unsealed() is second  # pinned by the sealer from here
        others: list[PoolObject] = []
        for i in range(100, 1000):  # single chunks, until one evicts the parent
            others += store_chain(pool, i, 1)
            if first.state is ObjectState.FREED:
                break
        assert first.state is ObjectState.FREED and all(o.state is ObjectState.READY for o in others)
        pool.seal(second)
        pool.sealed(second)
        others += store_chain(pool, 1000, 1)  # one more eviction: the unreachable chunk's
        assert second.state is ObjectState.FREED
        assert all(o.state is ObjectState.READY for o in others)
    finally:
        pool.close()


def test_a_chunk_sealed_under_eviction_comes_back_behind_its_prefix(pool_path: Path) -> None:
    """The same, its parent kept meanwhile (a reader held it): the sealed chunk comes back as its
    commit left it, its ancestors more recent, so evictions take it before its prefix."""
    pool = open_pool(pool_path, fresh=True)
    try:
        first, second = store_chain(pool, 0, 2)
        assert pool.take_unsealed() is first
        pool.seal(first)
        pool.sealed(first)
        assert pool.take_unsealed() is second
        reader = pool.pin([first.key])
        assert reader == [first]
        evictions = pool.stats().evictions
        i = 100
        while pool.stats().evictions == evictions:  # the sealer's pin settled: it left its LRU
            store_chain(pool, i, 1)
            i += 1
        pool.unpin(reader)  # the parent is the most recent now
        pool.seal(second)
        pool.sealed(second)
        while first.state is ObjectState.READY and second.state is ObjectState.READY:
            store_chain(pool, i, 1)
            i += 1
        assert second.state is ObjectState.FREED and first.state is ObjectState.READY, "the tail goes first"
    finally:
        pool.close()
