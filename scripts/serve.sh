#!/usr/bin/env bash
# One command: set up .venv (first run only) and run the daemon in the foreground.
# Extra arguments go to `lmcache-mp serve` (see `lmcache-mp serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh base
exec .venv/bin/lmcache-mp serve "$@"
