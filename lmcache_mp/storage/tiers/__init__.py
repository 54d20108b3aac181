"""The tiers below the pool: where chunks go when the pool evicts them, and come back from.

    base.py      the tier interface every tier implements
    open.py      builds the tiers from their URLs; urls.py: the URL forms
    disk.py      a local directory (disk_directory.py: its index; disk_file.py: one chunk's file)
    remote.py    what the network tiers share
    redis.py     Valkey / Redis, incl. cluster
    v1.py        LMCache's v1 remote protocol

Nothing is imported here: the CLI reads `urls` without torch.
"""
