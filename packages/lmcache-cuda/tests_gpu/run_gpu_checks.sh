#!/usr/bin/env bash
# GPU checks for lmcache-cuda (docs/design/platform.md#device-cuda). Needs one CUDA GPU, a CUDA
# build of torch, nvcc, cmake, Python headers, pybind11 and msgspec (pip packages, or the repo
# .venv's copies carried to the machine: .venv/lib/python3.*/site-packages/{pybind11,msgspec}).
# Finishes in well under 5 minutes:
#   1. CMake + nvcc build of lmcache.devices.cuda._C (one arch, CUDAARCHS, default 90) and
#      the C++ host-side tests (ctest);
#   2. native kernels vs the torch baseline, bit for bit, on formats #1 #2 #3 #6 (D2H and
#      H2D, skip/partial chunks, pinned-host and device chunks), pointer-mode memcpy and
#      tensor_from_ptr;
#   3. an LMCache-driven round trip between two processes: CUDA IPC wrapper over the wire,
#      event IPC, GPUCacheContext on the "server" side, store then retrieve.
# Usage (from anywhere):  bash packages/lmcache-cuda/tests_gpu/run_gpu_checks.sh
# Results: JSON in $OUT/gpu_checks.json when OUT is set. Exit code 0 = all passed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-}"
for cand in "$PY" python3 python "$ROOT/.venv/bin/python"; do
  [ -n "$cand" ] || continue
  if "$cand" -c "import torch,sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY="$cand"; break
  fi
  PY=""
done
if [ -z "$PY" ]; then
  echo "FAIL: no python with a CUDA build of torch and a visible GPU (set PYTHON=...)" >&2
  exit 2
fi
echo "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'))"
DEST=packages/lmcache-cuda/src/lmcache/devices/cuda
PREBUILT="$(ls "$ROOT"/build/cuda-prebuilt/_C*.so 2>/dev/null | head -1 || true)"

if command -v nvcc >/dev/null; then
  PYBIND="$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)"
  if [ -z "$PYBIND" ]; then
    PYBIND="$(ls -d "$ROOT"/.venv/lib/python3*/site-packages/pybind11/share/cmake/pybind11 2>/dev/null | head -1 || true)"
  fi
  [ -n "$PYBIND" ] || { echo "FAIL: pybind11 not found (pip install pybind11, or carry .venv's)" >&2; exit 2; }
  BUILD="$(mktemp -d /tmp/lmcache-cuda-build.XXXXXX)"
  echo "== building the CUDA extension in $BUILD (arch ${CUDAARCHS:-90})"
  cmake -S packages/lmcache-cuda -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDAARCHS:-90}" -DLMCACHE_CUDA_HOST_TESTS=ON \
    -Dpybind11_DIR="$PYBIND" -DPython_EXECUTABLE="$(command -v "$PY")" >"$BUILD/cmake.log" 2>&1 \
    || { tail -30 "$BUILD/cmake.log"; exit 1; }
  cmake --build "$BUILD" -j "$(nproc)" >"$BUILD/build.log" 2>&1 || { tail -40 "$BUILD/build.log"; exit 1; }
  ctest --test-dir "$BUILD" --output-on-failure
  cp "$BUILD"/_C*.so "$DEST"/
elif [ -n "$PREBUILT" ]; then
  # No toolkit here: use the module built elsewhere with nvcc (carried as
  # build/cuda-prebuilt/; CPython 3.11, sm_80/sm_90, static CUDA 13 runtime).
  echo "== nvcc not found; using the prebuilt $PREBUILT"
  cp "$PREBUILT" "$DEST"/
else
  echo "FAIL: nvcc not on PATH and no build/cuda-prebuilt/_C*.so carried" >&2
  exit 2
fi

# Source checkouts of core and the cuda wheel (PEP 420 namespaces merge on the path).
export PYTHONPATH="$ROOT/packages/lmcache-core/src:$ROOT/packages/lmcache-cuda/src${PYTHONPATH:+:$PYTHONPATH}"
# Besides torch, the checked code needs only msgspec (wire codec). Without it, borrow the
# repo .venv's copy (same Python minor version) without exposing that venv's CPU torch.
if ! "$PY" -c "import msgspec" 2>/dev/null; then
  PYVER="$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
  SRC="$ROOT/.venv/lib/$PYVER/site-packages/msgspec"
  [ -d "$SRC" ] || { echo "FAIL: msgspec missing (pip install msgspec, or carry .venv/lib/$PYVER/site-packages/msgspec)" >&2; exit 2; }
  SHIM="$(mktemp -d /tmp/lmcache-pydeps.XXXXXX)"
  ln -s "$SRC" "$SHIM/msgspec"
  export PYTHONPATH="$PYTHONPATH:$SHIM"
fi
echo "== kernel and IPC checks"
timeout 240 "$PY" packages/lmcache-cuda/tests_gpu/gpu_checks.py ${OUT:+--out "$OUT/gpu_checks.json"}
