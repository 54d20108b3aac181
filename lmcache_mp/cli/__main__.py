"""`python -m lmcache_mp.cli ...`: the `lmcache-mp` command."""

import sys

from lmcache_mp.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
