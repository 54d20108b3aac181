#!/usr/bin/env bash
# CI's first-run check: what a new user's first command does, from scratch.
#   1. set up a fresh venv the way ./scripts/serve.sh does (the base profile only, never .venv),
#      serve from it on a temporary socket, ping it, stop it with SIGTERM: exit 0 expected;
#   2. build the wheel and, from a venv holding only that wheel and its declared base
#      dependencies, outside the source tree, run `lmcache-mp ping --help` and import every
#      module of the daemon.
# A module the base profile imports but does not declare fails here, as it would for a user.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
pip_quiet=(--disable-pip-version-check -q)

work="$(mktemp -d /tmp/lmc-first-run.XXXXXX)"
daemon_pid=""
# The daemon keeps its pool in the default directory, as a user's would: made here, it goes after.
pool_dir="/dev/shm/lmcache-mp-$(id -u)"
[ -e "$pool_dir" ] && pool_dir_made="" || pool_dir_made=1
cleanup() {
  [ -z "$daemon_pid" ] || kill -KILL "$daemon_pid" 2>/dev/null || true
  rm -rf "$work"
  [ -z "$pool_dir_made" ] || rmdir "$pool_dir" 2>/dev/null || true
}
trap cleanup EXIT
step() { echo "first run: $*" >&2; }
fail() { echo "first run FAILED: $*" >&2; [ ! -f "$work/serve.log" ] || tail -n 40 "$work/serve.log" >&2; exit 1; }

step "setting up a fresh base venv as ./scripts/serve.sh does..."
LMCACHE_MP_VENV="$work/venv" scripts/setup.sh base || fail "scripts/setup.sh base"
lmc="$work/venv/bin/lmcache-mp"
url="ipc://$work/run/daemon.sock"
# The runtime directory is private to the daemon: it creates it (0700) under $work.
LMCACHE_MP_RUNTIME_DIR="$work/run" "$lmc" serve --listen "$url" --l1-size-gb 0.0625 \
  >"$work/serve.log" 2>&1 &
daemon_pid=$!
step "daemon pid $daemon_pid on $url; pinging..."
answered=""
for _ in $(seq 1 120); do  # the first PING comes before torch is imported: seconds at most
  kill -0 "$daemon_pid" 2>/dev/null || fail "the daemon exited before answering"
  if "$lmc" ping --url "$url" --count 3 --timeout 2 >"$work/ping.out" 2>&1; then answered=1; break; fi
  sleep 0.5
done
[ -n "$answered" ] || fail "no answer to ping within 60 s: $(cat "$work/ping.out")"
cat "$work/ping.out" >&2
step "waiting for the engine (torch, the pool) to be built..."
serving=""
for _ in $(seq 1 240); do
  kill -0 "$daemon_pid" 2>/dev/null || fail "the daemon exited while building its engine"
  "$lmc" status --url "$url" --json --timeout 30 >"$work/status.json" || fail "lmcache-mp status"
  if grep -q '"phase": "serving"' "$work/status.json"; then serving=1; break; fi
  sleep 0.5
done
[ -n "$serving" ] || fail "the engine was not built within 120 s: $(cat "$work/status.json")"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[ "$rc" = 0 ] || fail "the daemon exited $rc on SIGTERM"
rm "$work/serve.log"  # fail() shows it while the daemon runs, not after
step "served, answered ping and status, built its engine, stopped on SIGTERM with exit 0"
# Its pool file outlives it (warm restart): remove it as a user would, and the memory it holds.
LMCACHE_MP_RUNTIME_DIR="$work/run" "$lmc" clear --url "$url" --pool-file >"$work/clear.out" 2>&1 \
  && grep -q "removed" "$work/clear.out" || fail "lmcache-mp clear --pool-file: $(cat "$work/clear.out")"
step "$(cat "$work/clear.out")"

step "building the wheel and installing it alone into a fresh venv..."
"$python" -m pip wheel "${pip_quiet[@]}" --no-deps -w "$work/dist" "$root" >/dev/null \
  || fail "pip wheel --no-deps ."
"$python" -m venv "$work/wheel-venv"
# The CPU torch first, as setup.sh does: an unpinned torch pulls a multi-GB CUDA build.
"$work/wheel-venv/bin/python" -m pip install "${pip_quiet[@]}" "torch==2.13.0" "$work"/dist/*.whl \
  2>&1 | grep -v "^WARNING: Location" || true
# Outside the source tree, so that only the installed wheel can be imported.
(cd "$work" && "$work/wheel-venv/bin/lmcache-mp" ping --help >/dev/null) \
  || fail "lmcache-mp ping --help from the wheel alone"
# Every daemon module (tiers included) imports with the base dependencies alone: one that
# imports an undeclared module fails here. The exception: a tier whose client is an extra (named
# here, with it) may miss exactly that extra's packages, as declared in the wheel's metadata.
# (vllm_adapter/ runs inside vLLM: the vllm profile.)
(cd "$work" && "$work/wheel-venv/bin/python" -c "
import importlib, pkgutil, re, lmcache_mp
from importlib.metadata import requires
NEEDS_EXTRA = {'lmcache_mp.storage.tiers.s3': 's3', 'lmcache_mp.storage.tiers.mooncake': 'mooncake'}
DISTRIBUTION_OF = {'mooncake': 'mooncake_transfer_engine_non_cuda'}  # imports named unlike their package
def packages(extra):
    return {re.split(r'[<>=!~;\[ ]', r)[0].lower().replace('-', '_')
            for r in requires('lmcache-mp') or [] if re.search(f'extra == .{extra}.', r)}
names = [m.name for m in pkgutil.walk_packages(lmcache_mp.__path__, 'lmcache_mp.')]
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        extra = NEEDS_EXTRA.get(name)
        missing = (e.name or '').split('.')[0]
        if extra is None or DISTRIBUTION_OF.get(missing, missing) not in packages(extra):
            raise
print(f'first run: {len(names)} lmcache_mp modules import from the wheel alone', end='')
print(f' (but {sorted(NEEDS_EXTRA)}: their extras)')") \
  || fail "importing every lmcache_mp module from the wheel and the base dependencies alone"
step "the wheel alone runs lmcache-mp ping --help"
