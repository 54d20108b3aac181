#!/usr/bin/env bash
# The checks to make whenever a GPU machine is lent (docs/benchmarks/cuda.md): where a copy's
# time goes (copy_probe.py), the full self-test, the lmcache door's self-test, then the tests marked
# `cuda`, each bounded, every log kept under $OUT. Run from the repository root with the pyzmq, msgspec and redis wheels
# in .whl (that machine has torch and pytest but no registry): `bash scripts/gpu_lent_run.sh`,
# about 3 minutes on an H100.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import torch, zmq, msgspec; print("torch", torch.__version__, "cuda", torch.version.cuda)'
timeout -k 10 90 python3 scripts/gpu/copy_probe.py 2>&1 | tee "$OUT/probe.log"
echo "probe exit code ${PIPESTATUS[0]}"
timeout -k 10 "${SELFTEST_S:-300}" python3 scripts/gpu/selftest.py --pin-gib "${PIN_GIB:-8,32}" \
  --out "$OUT/gpu_selftest.json" 2>&1 | tee "$OUT/selftest.log"
echo "self-test exit code ${PIPESTATUS[0]}"
timeout -k 10 120 python3 scripts/gpu/selftest_door.py --out "$OUT/gpu_selftest_door.json" 2>&1 \
  | tee "$OUT/selftest_door.log"
echo "door self-test exit code ${PIPESTATUS[0]}"
timeout -k 10 "${PYTEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests/smoke/test_cuda.py \
  2>&1 | tee "$OUT/pytest_cuda.log"
echo "pytest -m cuda exit code ${PIPESTATUS[0]}"
tar czf "$OUT/daemon_logs.tgz" /tmp/lmc-gpu-* /tmp/pytest-of-* 2>/dev/null
exit 0
