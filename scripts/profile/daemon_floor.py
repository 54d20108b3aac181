#!/usr/bin/env python
"""Run `lmcache-mp serve` with a LOOKUP that only walks the prefix: the floor of any LOOKUP.

    python scripts/profile/daemon_floor.py -- PYTHON -m lmcache_mp.cli serve ARGS...

(the form `launcher.start_daemon(..., command_prefix=[python, this, "--"])` gives). The daemon's
LOOKUP handlers are patched, before it starts, to answer from the prefix walk alone: every
rank's keys looked up in the pool's index with the same C-level iterators as `pin_prefix`, and
nothing pinned, leased or remembered (END_SESSION then finds nothing to release). Everything
else, the message queue, decoding, dispatch, registry and reply, is the product's own. So the
hit rotation of `bench_control_plane.py --parts floor` times what a LOOKUP costs before any of
the work that keeps its hits until the RETRIEVE: the lowest ratio to a PING that faster
leases could ever reach. Never a way to serve: a hit without a lease may be evicted before
it is read.
"""

from __future__ import annotations

import itertools
import sys

from daemon_profile import run_daemon

from lmcache_mp.engine import engine
from lmcache_mp.protocol import PrefixHit
from lmcache_mp.storage.pool.pool import _is_object


def _walk_only(self: engine.Engine, model: str, world_size: int, request_id: str | None,
               hashes: list[bytes], tails: list[bytes] | None = None) -> int | PrefixHit:
    """`Engine._lookup` without pins, leases, tails or lower tiers: the leading chunks every rank
    has (as a PrefixHit without tails for LOOKUP_PREFIX, `tails` its window)."""
    combos = self.registry.format_combos(model, world_size)
    readable = self.storage.pool._readable  # the pool's READY index, which pin_prefix walks
    found = min(len(list(itertools.takewhile(_is_object, map(readable.get, zip(
        hashes, itertools.repeat(spec.fmt.fingerprint)))))) for spec in combos[0]) if hashes and combos else 0
    return found if tails is None else PrefixHit(found)


def main() -> None:
    sep, *command = sys.argv[1:]
    if sep != "--":
        raise SystemExit(__doc__)
    engine.Engine._lookup = _walk_only  # type: ignore[method-assign]
    run_daemon(command, __doc__)


if __name__ == "__main__":
    main()
