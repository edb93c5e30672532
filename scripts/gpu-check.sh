#!/usr/bin/env bash
# Build every package from source against the machine's own torch (CUDA
# variant required), run every test suite including the GPU tests, then the
# benchmarks. For a GPU machine without network access.
#   scripts/gpu-check.sh [package ...]   (default: every op package)
#   RESULTS=dir keeps logs and benchmark tables there (default bench-results);
#   ARCHIVE=file.tgz also packs them into one file; BENCH=0 skips benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=$(mkdir -p "${RESULTS:-bench-results}" && cd "${RESULTS:-bench-results}" && pwd)
export OPS_CUDA=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(round-op vecadd-op lltm-op)
status=0
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
$PY -m pip install -q --no-build-isolation --no-deps packages/opscommon || exit 1
for p in "${packages[@]}"; do
  [ -f "packages/$p/setup.py" ] || { echo "skip $p: no setup.py"; continue; }
  echo "=== build $p"
  if ! $PY -m pip install --no-build-isolation --no-deps packages/$p >"$RESULTS/build-$p.log" 2>&1; then
    grep -E "error|Error" "$RESULTS/build-$p.log" | head -40; status=1; continue
  fi
  grep "opscommon.build" "$RESULTS/build-$p.log" | head -2
done
for p in opscommon "${packages[@]}"; do
  [ -d "packages/$p/tests" ] || continue
  echo "=== test $p"
  (cd /tmp && $PY -X faulthandler -m pytest -q -p no:cacheprovider "$OLDPWD/packages/$p/tests" -rs 2>&1 | tee "$RESULTS/test-$p.log" | tail -25) || status=1
done
if [ "${BENCH:-1}" = 1 ]; then
  for p in "${packages[@]}"; do
    for b in packages/$p/bench/bench_*.py; do
      [ -f "$b" ] || continue
      echo "=== bench $b"
      $PY "$b" --out "$RESULTS" 2>&1 | tee "$RESULTS/$(basename "$b" .py).txt" || status=1
    done
  done
fi
[ -n "${ARCHIVE:-}" ] && tar czf "$ARCHIVE" -C "$RESULTS" .
exit $status
