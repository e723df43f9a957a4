#!/usr/bin/env bash
# The full fetch-table sweep on the GPU machine, split into calls of under 10 minutes that add to
# one table (sparda tune-ctas --append):
#   scripts/device/tune.sh PART OUT_DIR     PART: 1 (B 1,4,8 at 32K and 64K), 2 (B 16,32),
#                                                 3 (B 64,128: 64K where host memory allows)
# Each call must carry the table of the previous part as OUT_DIR/fetch_nvidia_h200.json
# (copy it into an ignored path such as .device/tune/ between calls). Then commit it as
# tuning/fetch_nvidia_h200.json (built into the binary).
# Each cell also measures the split configurations (split:N:25/50/75 at the cell's fastest CTA count):
# 12 configurations instead of 9; TUNE_FLAGS="--no-split" (or "--split-pct 50") shortens a part.
# Env: SPARDA (binary, default .device/bin/sparda), SPARDA_COMMIT, TUNE_FLAGS (extra tune-ctas flags).
set -uo pipefail
part=${1:?part}; out=${2:?out dir}; mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
case "$part" in
1) batches=1,4,8 ;;
2) batches=16,32 ;;
3) batches=64,128 ;;
*) echo "unknown part $part"; exit 2 ;;
esac
# shellcheck disable=SC2086 # TUNE_FLAGS is a list of flags
"$SPARDA" tune-ctas --batch "$batches" --context 32K,64K --append ${TUNE_FLAGS:-} \
  --out "$out/fetch_nvidia_h200.json" 2>&1 | tee "$out/tune_part$part.log"
