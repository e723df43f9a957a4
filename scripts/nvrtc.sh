#!/usr/bin/env bash
# Compiles every CUDA kernel (kernels/*.cu) for sm_90 (as sm_90a: nvrtc_target) with NVRTC on a machine without a GPU:
# the CUDA 13.0 NVRTC library (the version on the GPU machine, spec/device.md) from its PyPI
# wheel nvidia-cuda-nvrtc, then the ignored test `nvrtc_compiles_every_kernel`
# (src/cuda/context.rs), which compiles each kernel source to a cubin.
#
#   scripts/nvrtc.sh            # download once (58 MB, cached), unpack, run the compile test
#   scripts/nvrtc.sh --resources # also each kernel's registers, spills and shared memory
#                                # (cuobjdump -res-usage on the cubins; cuobjdump from its
#                                # PyPI wheel nvidia-cuda-cuobjdump, 0.3 MB, cached): what
#                                # bounds a kernel's occupancy, read without a GPU
#   scripts/nvrtc.sh --sass FUNC # also FUNC's SASS (cuobjdump -sass, with nvdisasm from the
#                                # wheel nvidia-cuda-nvdisasm, 5 MB, cached) in
#                                # .fixtures/nvrtc/FUNC.sass, and its instruction mix
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

# fetch_wheel NAME VERSION FILE SHA256 PLATFORM...: the wheel into the cache, checked
fetch_wheel() {
  local name=$1 version=$2 file=$3 sha=$4
  shift 4
  if [[ ! -f "$CACHE/$file" ]] || [[ "$(sha256sum "$CACHE/$file" | cut -d' ' -f1)" != "$sha" ]]; then
    log "downloading $name==$version from PyPI"
    rm -f "$CACHE/$file"
    local plat=()
    for p in "$@"; do plat+=(--platform "$p"); done
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      "${plat[@]}" -d "$CACHE" "$name==$version"
    local got
    got="$(sha256sum "$CACHE/$file" | cut -d' ' -f1)"
    if [[ "$got" != "$sha" ]]; then
      log "$CACHE/$file: sha256 $got, expected $sha"
      exit 1
    fi
  fi
}

mkdir -p "$CACHE"
fetch_wheel nvidia-cuda-nvrtc 13.0.88 "$WHEEL" "$WHEEL_SHA256" manylinux_2_12_x86_64 manylinux2010_x86_64
LIB="$CACHE/lib"
if [[ ! -f "$LIB/libnvrtc.so.13" ]]; then
  rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack" "$LIB"
  "$PY" -m zipfile -e "$CACHE/$WHEEL" "$CACHE/unpack"
  cp "$CACHE"/unpack/nvidia/cu13/lib/libnvrtc.so.13 "$CACHE"/unpack/nvidia/cu13/lib/libnvrtc-builtins.so.13.0 "$LIB/"
  rm -rf "$CACHE/unpack"
fi
log "NVRTC from $LIB"
resources=0 sass=""
case "${1:-}" in
--resources) resources=1 ;;
--sass) resources=1 sass="${2:?--sass needs a kernel function name}" ;;
"") ;;
*) log "unknown option $1 (--resources, --sass FUNC)"; exit 2 ;;
esac
# unpack_tool FILE TOOL: bin/TOOL from the wheel
unpack_tool() {
  if [[ ! -x "$CACHE/bin/$2" ]]; then
    rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack" "$CACHE/bin"
    "$PY" -m zipfile -e "$CACHE/$1" "$CACHE/unpack"
    cp "$CACHE/unpack/nvidia/cu13/bin/$2" "$CACHE/bin/" && chmod +x "$CACHE/bin/$2"
    rm -rf "$CACHE/unpack"
  fi
}
CUBINS=""
if ((resources)); then
  w="nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
  fetch_wheel nvidia-cuda-cuobjdump 13.5.37 "$w" 38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58 manylinux2014_x86_64
  unpack_tool "$w" cuobjdump
  if [[ -n "$sass" ]]; then
    w="nvidia_cuda_nvdisasm-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    fetch_wheel nvidia-cuda-nvdisasm 13.5.37 "$w" d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca manylinux2014_x86_64
    unpack_tool "$w" nvdisasm
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
if [[ -n "$sass" ]]; then
  # the first cubin that holds FUNC; its SASS, then opcodes by count (a static mix: loops
  # count once)
  for f in "$CUBINS"/*.cubin; do
    if PATH="$CACHE/bin:$PATH" "$CACHE/bin/cuobjdump" -sass -fun "$sass" "$f" > "$CACHE/$sass.sass" 2>/dev/null \
      && grep -q "Function : $sass" "$CACHE/$sass.sass"; then
      log "$sass ($(basename "$f")): SASS in $CACHE/$sass.sass"
      grep -oE '/\*[0-9a-f]{4}\*/ +(@!?U?P[0-9T] +)?[A-Z0-9_.]+' "$CACHE/$sass.sass" | awk '{print $NF}' \
        | sed 's/\..*//' | sort | uniq -c | sort -rn | head -30
      exit 0
    fi
  done
  log "no cubin holds a function $sass"
  exit 1
fi
