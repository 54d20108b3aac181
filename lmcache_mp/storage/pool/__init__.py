"""The CPU memory pool (L1): chunks in one shared-memory file that outlives the daemon.

    pool.py          the pool: reserve, commit, lookup, pin, evict (its face to the manager)
    objects.py       one chunk's place in the pool; chains.py: the prefix chains it belongs to
    slabs.py         the pool's memory cut into chunk-sized slots
    memory.py        mapping the pool file, pinned when CUDA is present
    file.py          the pool file's header and records; records.py: the records of its chunks
    restart.py       adopting the chunks of a pool file a stopped daemon left (warm restart)
    integrity.py     checksums: sealing chunks, verifying adopted ones
    seal_process.py  the checksum child process (seal_child.py, run isolated by path)
    mount.py         which file system holds the pool file (tmpfs or not)
    drop.py          dropping a model's chunks (a reset)
    location.py      where pool files live and how they are locked; directory.py: listing them

Nothing is imported here: the CLI reads `location` and `directory` without torch.
"""
