#!/usr/bin/env bash
# One command: set up everything the tests need (first run only) and run the whole suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k lookup -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check lmcache_mp vllm_adapter tests scripts examples
# --durations: the CI log names the slowest tests, where the suite's time goes.
exec .venv/bin/python -m pytest -q --durations=25 "$@"
