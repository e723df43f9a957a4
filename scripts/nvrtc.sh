#!/usr/bin/env bash
# Compiles every CUDA kernel (kernels/*.cu) for sm_90 with NVRTC on a machine without a GPU:
# the CUDA 13.0 NVRTC library (the version on the GPU machine, spec/device.md) from its PyPI
# wheel nvidia-cuda-nvrtc, then the ignored test `nvrtc_compiles_every_kernel`
# (src/cuda/context.rs), which compiles each kernel source to a cubin.
#
#   scripts/nvrtc.sh            # download once (58 MB, cached), unpack, run the compile test
#   scripts/nvrtc.sh --resources # also each kernel's registers, spills and shared memory
#                                # (cuobjdump -res-usage on the cubins; cuobjdump from its
#                                # PyPI wheel nvidia-cuda-cuobjdump, 0.3 MB, cached): what
#                                # bounds a kernel's occupancy, read without a GPU
#
# A kernel that NVRTC rejects fails here with NVRTC's log, before any GPU time is spent.
# Env: SPARDA_NVRTC_CACHE download and unpack folder (default: <repo>/.fixtures/nvrtc).
# Network: PyPI only, and only when the wheel is not cached yet.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SPARDA_NVRTC_CACHE:-$ROOT/.fixtures/nvrtc}"
WHEEL="nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
WHEEL_SHA256="ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
PY="${PYTHON:-python3}"

log() { echo "nvrtc.sh: $*" >&2; }

mkdir -p "$CACHE"
if [[ ! -f "$CACHE/$WHEEL" ]] || [[ "$(sha256sum "$CACHE/$WHEEL" | cut -d' ' -f1)" != "$WHEEL_SHA256" ]]; then
  log "downloading nvidia-cuda-nvrtc==13.0.88 from PyPI"
  rm -f "$CACHE/$WHEEL"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    -d "$CACHE" "nvidia-cuda-nvrtc==13.0.88"
  got="$(sha256sum "$CACHE/$WHEEL" | cut -d' ' -f1)"
  if [[ "$got" != "$WHEEL_SHA256" ]]; then
    log "$CACHE/$WHEEL: sha256 $got, expected $WHEEL_SHA256"
    exit 1
  fi
fi
LIB="$CACHE/lib"
if [[ ! -f "$LIB/libnvrtc.so.13" ]]; then
  rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack" "$LIB"
  "$PY" -m zipfile -e "$CACHE/$WHEEL" "$CACHE/unpack"
  cp "$CACHE"/unpack/nvidia/cu13/lib/libnvrtc.so.13 "$CACHE"/unpack/nvidia/cu13/lib/libnvrtc-builtins.so.13.0 "$LIB/"
  rm -rf "$CACHE/unpack"
fi
log "NVRTC from $LIB"
resources=0
[[ "${1:-}" == "--resources" ]] && resources=1
CUBINS=""
if ((resources)); then
  OBJ_WHEEL="nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
  OBJ_SHA256="38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58"
  if [[ ! -f "$CACHE/$OBJ_WHEEL" ]] || [[ "$(sha256sum "$CACHE/$OBJ_WHEEL" | cut -d' ' -f1)" != "$OBJ_SHA256" ]]; then
    log "downloading nvidia-cuda-cuobjdump==13.5.37 from PyPI"
    rm -f "$CACHE/$OBJ_WHEEL"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux2014_x86_64 -d "$CACHE" "nvidia-cuda-cuobjdump==13.5.37"
    got="$(sha256sum "$CACHE/$OBJ_WHEEL" | cut -d' ' -f1)"
    if [[ "$got" != "$OBJ_SHA256" ]]; then
      log "$CACHE/$OBJ_WHEEL: sha256 $got, expected $OBJ_SHA256"
      exit 1
    fi
  fi
  if [[ ! -x "$CACHE/bin/cuobjdump" ]]; then
    rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack" "$CACHE/bin"
    "$PY" -m zipfile -e "$CACHE/$OBJ_WHEEL" "$CACHE/unpack"
    cp "$CACHE"/unpack/nvidia/cu13/bin/cuobjdump "$CACHE/bin/" && chmod +x "$CACHE/bin/cuobjdump"
    rm -rf "$CACHE/unpack"
  fi
  CUBINS="$CACHE/cubins"
  rm -rf "$CUBINS" && mkdir -p "$CUBINS"
fi
cd "$ROOT"
SPARDA_CUBIN_DIR="$CUBINS" LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --release --lib nvrtc_compiles_every_kernel -- --ignored --exact \
  cuda::context::tests::nvrtc_compiles_every_kernel
if ((resources)); then
  # one line per kernel: name, registers per thread, spill stores/loads, static shared memory
  for f in "$CUBINS"/*.cubin; do
    "$CACHE/bin/cuobjdump" -res-usage "$f" | awk -v file="$(basename "$f" .cubin)" '
      /Function/ { fn = $2; sub(":$", "", fn) }
      /REG:/ { printf "%-12s %-40s %s\n", file, fn, $0 }'
  done
fi
