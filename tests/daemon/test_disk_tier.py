"""The disk tier and the chunk object format, with real files: round trips, restarts, damaged and
foreign files, LRU capacity, the directory lock, a really full filesystem, concurrent use."""

from __future__ import annotations

import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey
from lmcache_mp.storage import chunk_format
from lmcache_mp.storage.chunk_format import PREFIX_SIZE, CorruptChunk
from lmcache_mp.storage.pool.pool import MemoryPool
from lmcache_mp.storage.tiers.disk import DiskTier, object_name
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.urls import redact_url

FMT = ChunkFormat("test-model", 2, 0, "vllm_flash", "bfloat16", 4, (2, 16, 8, 64), 256)
OTHER_FMT = ChunkFormat("test-model", 2, 1, "vllm_flash", "bfloat16", 4, (2, 16, 8, 64), 256)
KiB = 1024
MiB = 1024 * KiB


def key(i: int, fmt: ChunkFormat = FMT) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"), fmt)


def payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def file_of(root: Path, k: ChunkKey) -> Path:
    name = object_name(k)
    return root / name[:2] / f"{name}.kv"


def kv_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.kv"))


@pytest.fixture
def tier(tmp_path: Path):
    t = DiskTier(tmp_path / "cache", 64 * MiB)
    yield t
    t.close()


# -- the object format ----------------------------------------------------------------------------


def test_format_round_trip_and_split() -> None:
    data = payload(1000, seed=1)
    header = chunk_format.encode_header(key(1), data)
    assert header[:4] == chunk_format.MAGIC
    assert chunk_format.header_size(header[:PREFIX_SIZE]) == len(header)
    chunk_format.verify(key(1), header, data)
    blob = chunk_format.encode(key(1), data)
    assert blob == header + data.numpy().tobytes()
    assert bytes(chunk_format.split(key(1), blob)) == data.numpy().tobytes()


def _fields_swapped(header: bytes) -> bytes:
    """`header` with OTHER_FMT's fields (same length) in place of FMT's, checksum recomputed."""
    fields, other = FMT.encode(), OTHER_FMT.encode()
    assert len(fields) == len(other) and header.count(fields) == 1
    return header.replace(fields, other)


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda h, p: (b"XXXX" + h[4:], p), "magic"),
    (lambda h, p: (h[:4] + struct.pack("<H", 99) + h[6:], p), "version"),
    (lambda h, p: (h, p[:-1]), "payload is"),
    (lambda h, p: (h, p[:-1] + bytes([p[-1] ^ 1])), "checksum"),
    (lambda h, p: (h[:-1] + bytes([h[-1] ^ 1]), p), "checksum"),
    (lambda h, p: (_fields_swapped(h), p), "do not hash"),
])
def test_format_verify_rejects(damage, reason: str) -> None:
    data = payload(100, seed=2).numpy().tobytes()
    header, data = damage(chunk_format.encode_header(key(1), data), data)
    with pytest.raises(CorruptChunk, match=reason):
        chunk_format.verify(key(1), header, data)


@pytest.mark.parametrize(("other", "reason"), [(key(2), "chunk hash"), (key(1, OTHER_FMT), "fingerprint")])
def test_format_verify_rejects_another_key(other: ChunkKey, reason: str) -> None:
    data = payload(100)
    with pytest.raises(CorruptChunk, match=reason):
        chunk_format.verify(other, chunk_format.encode_header(key(1), data), data)


def test_format_split_rejects_truncated_blob() -> None:
    blob = chunk_format.encode(key(1), payload(100))
    for cut in (3, PREFIX_SIZE + 5, len(blob) - 1):
        with pytest.raises(CorruptChunk):
            chunk_format.split(key(1), blob[:cut])


# -- the disk tier --------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 4097, 3 * MiB + 5])
def test_round_trip(tier: DiskTier, nbytes: int) -> None:
    data = payload(nbytes, seed=nbytes)
    assert not tier.contains(key(1))
    tier.put(key(1), data)
    assert tier.contains(key(1))
    assert torch.equal(tier.get(key(1)), data)
    out = torch.empty(nbytes, dtype=torch.uint8)
    assert tier.get(key(1), out) is out
    assert torch.equal(out, data)
    stats = tier.stats()
    assert (stats.objects, stats.hits_total, stats.writes_total, stats.misses_total) == (1, 2, 1, 0)
    assert stats.bytes == file_of(tier.root, key(1)).stat().st_size
    assert stats.name == f"disk://{tier.root}"
    assert not list((tier.root / "tmp").iterdir())


def test_absent_and_removed_are_misses(tier: DiskTier) -> None:
    assert tier.get(key(1)) is None
    tier.put(key(1), payload(100))
    tier.remove(key(1))
    tier.remove(key(1))
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert not file_of(tier.root, key(1)).exists()
    stats = tier.stats()
    assert (stats.objects, stats.bytes, stats.misses_total, stats.corrupt_total) == (0, 0, 2, 0)


def test_clear_removes_every_object_and_file(tier: DiskTier) -> None:
    for i in range(5):
        tier.put(key(i), payload(100, seed=i))
    tier.put(key(1, OTHER_FMT), payload(100))
    assert tier.clear() == 6
    assert tier.stats().objects == tier.stats().bytes == 0
    assert not any(tier.contains(key(i)) for i in range(5)) and tier.get(key(1)) is None
    assert not list(tier.root.glob("*/*.kv"))
    tier.put(key(1), payload(100, seed=9))  # usable again
    assert torch.equal(tier.get(key(1)), payload(100, seed=9))


def test_same_hash_other_format_is_another_object(tier: DiskTier) -> None:
    tier.put(key(1), payload(100, seed=1))
    tier.put(key(1, OTHER_FMT), payload(100, seed=2))
    assert torch.equal(tier.get(key(1)), payload(100, seed=1))
    assert torch.equal(tier.get(key(1, OTHER_FMT)), payload(100, seed=2))


def test_restart_finds_and_serves_objects(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = DiskTier(root, 64 * MiB)
    for i in range(10):
        first.put(key(i), payload(1000 + i, seed=i))
    bytes_before = first.stats().bytes
    first.close()
    first.close()
    (root / "tmp" / "leftover.123").write_bytes(b"half a write")

    second = DiskTier(root, 64 * MiB)
    assert (second.stats().objects, second.stats().bytes) == (10, bytes_before)
    assert not list((root / "tmp").iterdir())
    for i in range(10):
        assert torch.equal(second.get(key(i)), payload(1000 + i, seed=i))
    second.close()


def _flip(offset_from_end: int | None = None, offset: int | None = None):
    def damage(path: Path, root: Path) -> None:
        data = bytearray(path.read_bytes())
        at = len(data) - offset_from_end if offset_from_end is not None else offset
        data[at] ^= 0x40
        path.write_bytes(bytes(data))
    return damage


def _truncate(keep: int):
    def damage(path: Path, root: Path) -> None:
        with path.open("r+b") as f:
            f.truncate(keep if keep >= 0 else path.stat().st_size + keep)
    return damage


def _replace_with(other: ChunkKey):
    """Copy `other`'s object over the victim's file, as a copy by hand or a name collision would."""
    def damage(path: Path, root: Path) -> None:
        shutil.copyfile(file_of(root, other), path)
    return damage


@pytest.mark.parametrize("damage", [
    _flip(offset_from_end=10),  # payload
    _flip(offset=PREFIX_SIZE + 3),  # header: the chunk hash
    _flip(offset=2),  # header: the magic
    _truncate(-1),
    _truncate(PREFIX_SIZE + 2),
    _truncate(0),  # what a power loss before writeback leaves
    _replace_with(key(2)),  # foreign: another chunk's object
    _replace_with(key(1, OTHER_FMT)),  # same chunk hash, another format
], ids=["payload-flip", "header-flip", "magic-flip", "truncated-payload", "truncated-header", "empty",
        "foreign", "other-format"])
def test_damaged_file_is_a_miss_and_removed(tier: DiskTier, damage) -> None:
    tier.put(key(1), payload(10 * KiB, seed=1))
    tier.put(key(2), payload(10 * KiB, seed=2))
    tier.put(key(1, OTHER_FMT), payload(10 * KiB, seed=3))
    path = file_of(tier.root, key(1))
    damage(path, tier.root)

    out = torch.zeros(10 * KiB, dtype=torch.uint8)
    assert tier.get(key(1), out) is None
    assert not path.exists()
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.corrupt_total, stats.hits_total, stats.objects) == (1, 0, len(kv_files(tier.root)))
    assert stats.bytes == sum(f.stat().st_size for f in kv_files(tier.root))
    assert tier.get(key(1)) is None
    assert tier.stats().misses_total == 1
    tier.put(key(1), payload(10 * KiB, seed=1))  # stored afresh
    assert torch.equal(tier.get(key(1)), payload(10 * KiB, seed=1))


def test_damage_found_after_restart(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with_damage = DiskTier(root, 64 * MiB)
    with_damage.put(key(1), payload(KiB, seed=1))
    with_damage.put(key(2), payload(KiB, seed=2))
    with_damage.close()
    _truncate(-100)(file_of(root, key(1)), root)
    restarted = DiskTier(root, 64 * MiB)
    assert restarted.contains(key(1))  # the index trusts names and sizes; the read does not
    assert restarted.get(key(1)) is None and restarted.stats().corrupt_total == 1
    assert torch.equal(restarted.get(key(2)), payload(KiB, seed=2))
    restarted.close()


def test_deleted_behind_our_back_is_a_miss(tier: DiskTier) -> None:
    tier.put(key(1), payload(KiB))
    file_of(tier.root, key(1)).unlink()
    assert tier.get(key(1)) is None
    stats = tier.stats()
    assert (stats.objects, stats.bytes, stats.misses_total, stats.corrupt_total) == (0, 0, 1, 0)


def test_wrong_size_out_is_a_miss_not_corrupt(tier: DiskTier) -> None:
    tier.put(key(1), payload(KiB, seed=1))
    assert tier.get(key(1), torch.empty(KiB + 1, dtype=torch.uint8)) is None
    stats = tier.stats()
    assert (stats.misses_total, stats.corrupt_total, stats.objects) == (1, 0, 1)
    assert torch.equal(tier.get(key(1), torch.empty(KiB, dtype=torch.uint8)), payload(KiB, seed=1))


def test_lru_eviction_keeps_within_capacity(tmp_path: Path) -> None:
    chunk = 100 * KiB
    file_size = chunk + 4096  # the header, padded to a 4 KiB block
    tier = DiskTier(tmp_path / "cache", 3 * file_size + file_size // 2)
    for i in range(3):
        tier.put(key(i), payload(chunk, seed=i))
    assert tier.get(key(0)) is not None  # read: now the most recently used
    tier.put(key(3), payload(chunk, seed=3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.get(key(2)) is not None
    tier.put(key(4), payload(chunk, seed=4))
    assert [tier.contains(key(i)) for i in range(5)] == [False, False, True, True, True]
    stats = tier.stats()
    assert (stats.objects, stats.bytes, stats.evictions_total) == (3, 3 * file_size, 2)
    assert stats.bytes <= stats.capacity_bytes
    assert len(kv_files(tier.root)) == 3

    tier.put(key(9), payload(4 * file_size))  # larger than the whole tier
    assert not tier.contains(key(9)) and tier.stats().write_errors_total == 1
    assert tier.stats().objects == 3
    tier.close()


def test_lru_order_survives_restart(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    chunk = 10 * KiB
    first = DiskTier(root, 64 * MiB)
    for i in range(4):
        first.put(key(i), payload(chunk, seed=i))
        time.sleep(0.02)  # file times tick at the kernel's clock granularity (a few ms)
    for i in (1, 0):
        first.get(key(i))
        time.sleep(0.02)
    first.close()
    file_size = file_of(root, key(0)).stat().st_size

    smaller = DiskTier(root, 2 * file_size)  # evicts at start, oldest mtime first: 2, then 3
    assert [smaller.contains(key(i)) for i in range(4)] == [True, True, False, False]
    assert smaller.stats().evictions_total == 2 and len(kv_files(root)) == 2
    smaller.put(key(5), payload(chunk, seed=5))  # evicts 1, read before 0
    assert [smaller.contains(key(i)) for i in (0, 1, 5)] == [True, False, True]
    smaller.close()


def test_one_daemon_per_directory(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = DiskTier(root, MiB)
    with pytest.raises(ValueError, match=rf"in use by another lmcache-mp daemon \(pid {os.getpid()}\)"):
        DiskTier(root, MiB)
    first.close()
    first.put(key(1), payload(KiB))  # a closed tier writes nothing: the directory is not its own
    assert not first.contains(key(1)) and not kv_files(root)
    second = DiskTier(root, MiB)
    second.close()


def test_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"cannot use .*a-file/cache as a cache directory .*writable"):
        DiskTier(tmp_path / "a-file" / "cache", MiB)
    with pytest.raises(ValueError, match="capacity must be positive"):
        DiskTier(tmp_path / "cache", 0)


def test_directory_is_private(tmp_path: Path) -> None:
    DiskTier(tmp_path / "cache", MiB).close()
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: its bytes and mtime, to show that nothing touched them."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target_exists", [True, False], ids=["to-a-file", "dangling"])
def test_symlinked_lock_is_refused_and_its_target_untouched(tmp_path: Path, target_exists: bool) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    if target_exists:
        victim.write_bytes(b"precious, not a pid\n")
        os.utime(victim, ns=(10**18, 10**18))
    (root / "lock").symlink_to(victim)
    with pytest.raises(ValueError, match=rf"{root}/lock is a symbolic link"):
        DiskTier(root, MiB)
    if target_exists:
        assert victim.read_bytes() == b"precious, not a pid\n" and victim.stat().st_mtime_ns == 10**18
    else:
        assert not victim.exists()  # not created through the link either
    assert (root / "lock").is_symlink()


def test_hard_linked_lock_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious, not a pid\n")
    os.link(victim, root / "lock")
    with pytest.raises(ValueError, match=rf"{root}/lock is not a plain file of its own"):
        DiskTier(root, MiB)
    assert victim.read_bytes() == b"precious, not a pid\n"


def test_symlinked_tmp_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(b"keep me")
    (victim / f"{'ab' * 20}.kv.7").write_bytes(b"named like a temp file")
    before = _snapshot(victim)
    (root / "tmp").symlink_to(victim, target_is_directory=True)
    with pytest.raises(ValueError, match=rf"{root}/tmp is a symbolic link"):
        DiskTier(root, MiB)
    assert _snapshot(victim) == before


def test_symlinked_shard_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    for i, age in enumerate((1, 2)):  # named like objects; the tier could hold only one of them
        path = victim / f"ab{i:038x}.kv"
        path.write_bytes(bytes(10 * KiB))
        os.utime(path, (age, age))
    before = _snapshot(victim)
    (root / "ab").symlink_to(victim, target_is_directory=True)
    with pytest.raises(ValueError, match=rf"{root}/ab is a symbolic link"):
        DiskTier(root, 15 * KiB)
    assert _snapshot(victim) == before


def test_symlinked_object_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, MiB)
    tier.put(key(1), payload(KiB, seed=1))
    path = file_of(root, key(1))
    victim = tmp_path / "victim.kv"  # a valid object for key(1), outside the tier
    shutil.copyfile(path, victim)
    os.utime(victim, ns=(10**18, 10**18))
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    path.unlink()
    path.symlink_to(victim)

    assert tier.get(key(1)) is None  # neither read nor served through the link
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.objects, stats.bytes, stats.hits_total, stats.misses_total) == (0, 0, 0, 1)
    assert path.is_symlink() and (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    tier.put(key(1), payload(KiB, seed=1))  # replaces the link itself, never writes through it
    assert not path.is_symlink() and torch.equal(tier.get(key(1)), payload(KiB, seed=1))
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    tier.remove(key(1))
    path.symlink_to(victim)
    tier.close()

    restarted = DiskTier(root, 1)  # a link is never indexed, so never evicted nor its target removed
    assert restarted.stats().objects == 0 and path.is_symlink()
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    restarted.close()


def test_oversized_file_does_not_empty_the_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cache"
    first = DiskTier(root, MiB)
    for i in range(5):
        first.put(key(i), payload(10 * KiB, seed=i))
    stored = first.stats().bytes
    first.close()
    huge = root / "ab" / f"ab{0:038x}.kv"  # named like an object, sparse, and the newest
    with huge.open("wb") as f:
        f.truncate(1 << 36)
    os.utime(huge, ns=(4 * 10**18, 4 * 10**18))  # the year 2096

    with caplog.at_level(logging.WARNING, logger="lmcache_mp.storage.tiers.disk"):
        restarted = DiskTier(root, MiB)
    assert all(restarted.contains(key(i)) for i in range(5))
    stats = restarted.stats()
    assert (stats.objects, stats.bytes, stats.evictions_total, stats.corrupt_total) == (5, stored, 0, 1)
    assert not huge.exists()  # larger than the whole tier: no object of it, so removed on its own
    warnings = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert len(warnings) == 1 and huge.name[:-3] in warnings[0], warnings
    for i in range(5):
        assert torch.equal(restarted.get(key(i)), payload(10 * KiB, seed=i))
    restarted.close()


def test_concurrent_use_never_returns_wrong_bytes(tmp_path: Path) -> None:
    chunk = 64 * KiB
    keys = [key(i) for i in range(12)]
    expected = {k: payload(chunk + i, seed=i) for i, k in enumerate(keys)}
    tier = DiskTier(tmp_path / "cache", 6 * (chunk + KiB))  # about half the keys fit: evictions
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            k = rng.choice(keys)
            op = rng.random()
            if op < 0.4:
                tier.put(k, expected[k])
            elif op < 0.9:
                got = tier.get(k)
                if got is not None and not torch.equal(got, expected[k]):
                    errors.append(f"wrong bytes for {k.chunk_hash.hex()}")
            else:
                tier.remove(k)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = tier.stats()
    files = kv_files(tier.root)
    assert stats.corrupt_total == 0 and stats.write_errors_total == 0
    assert stats.objects == len(files) and stats.bytes == sum(f.stat().st_size for f in files)
    assert stats.bytes <= stats.capacity_bytes
    assert not list((tier.root / "tmp").iterdir())
    for k in keys:
        got = tier.get(k)
        assert got is None or torch.equal(got, expected[k])
    tier.close()


_FULL_DISK_CHILD = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from lmcache_mp.storage.tiers.disk import DiskTier
    from lmcache_mp.chunks import ChunkFormat, ChunkKey

    fmt = ChunkFormat("m", 1, 0, "layout", "uint8", 1, (1,), 16)
    root = Path(sys.argv[1])
    tier = DiskTier(root, 1 << 30)  # the filesystem (2 MiB) runs out long before the capacity
    chunks = [torch.full((256 * 1024,), i, dtype=torch.uint8) for i in range(16)]
    for i, chunk in enumerate(chunks):
        tier.put(ChunkKey(bytes([i]) * 16, fmt), chunk)
    stats = tier.stats()
    assert 1 <= stats.writes_total < 16 and stats.write_errors_total == 16 - stats.writes_total, stats
    assert stats.objects == stats.writes_total, stats
    for i in range(stats.writes_total):
        assert torch.equal(tier.get(ChunkKey(bytes([i]) * 16, fmt)), chunks[i]), i
    assert not os.listdir(root / "tmp"), os.listdir(root / "tmp")
    assert len(list(root.glob("??/*.kv"))) == stats.writes_total
    print("ok", stats.writes_total, stats.write_errors_total)
""")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --user --mount (unprivileged namespaces)")
def test_full_filesystem_is_counted_not_raised(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_FULL_DISK_CHILD)
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         f'mount -t tmpfs -o size=2m tmpfs "{mnt}" && exec "{sys.executable}" "{script}" "{mnt}/cache"'],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
    assert "write failed" in result.stderr  # logged, at a limited rate
    assert result.stderr.count("write failed") < 16 - int(result.stdout.split()[1])


# -- URLs -----------------------------------------------------------------------------------------


def test_open_tier_from_url(tmp_path: Path) -> None:
    tier = open_tier(f"disk://{tmp_path}/cache?size_gb=0.5")
    assert isinstance(tier, DiskTier)
    assert tier.stats().capacity_bytes == 512 * MiB
    assert tier.root == tmp_path / "cache"
    tier.close()


@pytest.mark.parametrize(("url", "message"), [
    ("disk://relative/path?size_gb=1", "absolute path"),
    ("disk:relative?size_gb=1", "absolute path"),
    ("disk:///abs/path", "size_gb"),
    ("disk:///abs/path?size_gb=0", "positive"),
    ("disk:///abs/path?size_gb=-1", "positive"),
    ("disk:///abs/path?size_gb=nan", "positive"),
    ("disk:///abs/path?size_gb=lots", "positive"),
    ("disk:///abs/path?size_gb=1&size_gb=2", "exactly one"),
    ("disk:///abs/path?size_gb=1&sync=1", "unknown parameters"),
    ("ftp://bucket/x", r"supported schemes are disk://"),
    ("/just/a/path", r"supported schemes are disk://"),
])
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_tier(url)


@pytest.mark.parametrize(("url", "shown"), [
    ("disk:///var/cache/kv?size_gb=1", "disk:///var/cache/kv?size_gb=1"),
    ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
    ("rediss://user:s3:cret@host/0?password=s3cret&db=1", "rediss://user:***@host/0?password=***&db=1"),
    ("redis://user@host", "redis://user@host"),
    ("redis://[::1", "<unparseable URL>"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


def test_unsupported_url_error_hides_password() -> None:
    with pytest.raises(ValueError) as info:
        open_tier("memcached://:s3cret@host")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("nbytes", [64 * KiB, 64 * KiB + 100, 4 * MiB + 4096 + 7])
def test_page_aligned_payloads_go_by_direct_io_and_read_back(tier: DiskTier, nbytes: int) -> None:
    """Pool objects are page-aligned: their whole blocks are written with O_DIRECT (on a
    filesystem that has it), the tail buffered; either way the bytes read back exactly."""
    pool = MemoryPool(16 * MiB, align=4096)
    [slot] = pool.reserve(["k"], nbytes)
    assert slot.data.data_ptr() % 4096 == 0
    slot.data.copy_(payload(nbytes, seed=nbytes))
    tier.put(key(nbytes), slot.data)
    got = tier.get(key(nbytes), out=torch.empty(nbytes, dtype=torch.uint8))
    assert got is not None and torch.equal(got, slot.data)
    path = file_of(tier.root, key(nbytes))
    assert path.stat().st_size == 4096 + nbytes  # the header padded to one block
    if _supports_direct_io(path.parent):
        assert tier._direct  # never fell back to buffered writes


def _supports_direct_io(directory: Path) -> bool:
    try:
        fd = os.open(directory / "direct-probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / "direct-probe")
    return True
