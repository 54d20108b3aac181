"""`lmcache-mp pools`: list the pool files of a directory (what each holds, since when it is unused,
which process holds it) and remove the stopped daemons' ones (`pool/directory.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmcache_mp.storage.pool.directory import PoolFileInfo, age, pool_files, remove_stopped
from lmcache_mp.storage.pool.location import default_pool_directory


def add_parser(sub: argparse._SubParsersAction) -> None:
    pools = sub.add_parser(
        "pools", help="list the pool files of daemons, running or stopped, and remove stopped ones",
        description="List the pool files in a directory: the memory each holds (shared memory, until "
                    "the file is removed), and the daemon that holds it, or since when it is unused "
                    "(a stopped daemon's). A daemon's start removes the stopped ones unused for its "
                    "pool_file_ttl_s; --remove-stopped removes them all now.")
    pools.add_argument("--dir", type=Path, default=default_pool_directory(), metavar="DIR",
                       help="the directory of the pool files (default: %(default)s, where "
                            "--pool-file auto puts them)")
    pools.add_argument("--remove-stopped", action="store_true",
                       help="remove every pool file no process holds, and give back its memory: the "
                            "next start of a stopped daemon begins with an empty pool")
    pools.set_defaults(func=cmd_pools)


def cmd_pools(args: argparse.Namespace) -> int:
    files = pool_files(args.dir)
    held = sum(info.held_bytes for info in files) / 2**30
    print(f"{args.dir}: {len(files)} pool file{'' if len(files) == 1 else 's'}, {held:.2f} GiB held")
    for info in files:
        print(_line(info))
    if args.remove_stopped:
        removed = remove_stopped(args.dir)
        for info in removed:
            print(f"removed {info.path} ({info.held_bytes / 2**30:.2f} GiB)")
        freed = sum(info.held_bytes for info in removed) / 2**30
        print(f"{len(removed)} removed, {freed:.2f} GiB given back")
    return 0


def _line(info: PoolFileInfo) -> str:
    state = f"in use by {info.holder}" if info.holder else f"stopped, unused {age(info.unused_s)}"
    return f"{info.path.name}  {info.held_bytes / 2**30:.2f} GiB  {state}"
