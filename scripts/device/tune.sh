#!/usr/bin/env bash
# The full fetch-table sweep on the GPU machine, split into calls of under 10 minutes that add to
# one table (sparda tune-ctas --append: each finished cell is written at once, cells already in
# the table are skipped, so a part cut at the time limit resumes when called again):
#   scripts/device/tune.sh PART OUT_DIR     PART: 1 (B 1,4,8 at 32K and 64K), 2 (B 16,32),
#                                                 3 (B 64,128: 64K where host memory allows),
#                                                 prefetch-means (prefetch cells of B 1-32 at 32K and
#                                                 64K still on round medians measured again on round
#                                                 means: SM kernel 4-16 CTAs, sm-whole:2-16; about 4 min),
#                                                 second (a second, separate sweep at 32K, B 1-64,
#                                                 into OUT_DIR/second_sweep.json, then the table in
#                                                 use checked against it: tune-ctas --compare)
# The table grows in $TABLE (default .device/tune/fetch_nvidia_h200.json, carried with
# `carry: [".device/binz", ".device/tune"]`); the call copies it to OUT_DIR: copy it back into
# .device/tune/ before the next call. Then commit it as tuning/fetch_nvidia_h200.json (built
# into the binary).
# Protocol (TUNE_FLAGS replaces it): SM kernel at 2,4,8,12,16,32 CTAs, the copy engines, split:N:50
# at the cell's fastest CTA count, and (prefetch mode) sm-whole:2/4/8/12/16; 2 rounds × (3 warm-up +
# 12 timed steps) per configuration: about 75 s per (context, B) at B ≤ 8 with sm-whole:4/8/16
# (2026-12-01); the two more whole-SM counts add a few seconds per prefetch cell.
# Env: SPARDA (binary, default .device/bin/sparda), SPARDA_COMMIT, TUNE_FLAGS, TABLE,
# LIMIT (seconds before the sweep stops itself, default 550).
set -uo pipefail
part=${1:?part}; out=${2:?out dir}; mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
table=${TABLE:-.device/tune/fetch_nvidia_h200.json}
mkdir -p "$(dirname "$table")"
# prefetch-means appends to the committed table of that name when none was carried
# (parts 1-3 start a table of their own)
if [[ $part == prefetch-means && ! -f $table && -f tuning/$(basename "$table") ]]; then
  cp "tuning/$(basename "$table")" "$table"
  echo "tune.sh: starting from tuning/$(basename "$table")"
fi
flags=${TUNE_FLAGS:---ctas 2,4,8,12,16,32 --split-pct 50 --repeats 2 --steps 12}
if [[ $part == prefetch-means ]]; then
  timeout -s INT "${LIMIT:-550}" "$SPARDA" tune-ctas --mode prefetch --batch 1,4,8,16,32 --context 32K,64K \
    --ctas 4,8,12,16 --no-dma --no-split --repeats 2 --steps 16 --append --remeasure-medians \
    --out "$table" 2>&1 | tee "$out/tune_prefetch_means.log"
  cp "$table" "$out/" 2>/dev/null || echo "no table written"
  exit 0
fi
if [[ $part == second ]]; then
  # shellcheck disable=SC2086 # flags is a list of flags
  timeout -s INT "${LIMIT:-550}" "$SPARDA" tune-ctas --batch 1,4,8,16,32,64 --context 32K $flags \
    --out "$out/second_sweep.json" 2>&1 | tee "$out/tune_second.log"
  "$SPARDA" tune-ctas --compare "$out/second_sweep.json" 2>&1 | tee "$out/compare.txt"
  exit 0
fi
case "$part" in
1) batches=1,4,8 ;;
2) batches=16,32 ;;
3) batches=64,128 ;;
*) echo "unknown part $part"; exit 2 ;;
esac
# shellcheck disable=SC2086 # flags is a list of flags
timeout -s INT "${LIMIT:-550}" "$SPARDA" tune-ctas --batch "$batches" --context 32K,64K --append $flags \
  --out "$table" 2>&1 | tee "$out/tune_part$part.log"
echo "tune-ctas exit code ${PIPESTATUS[0]} (130 or 124: stopped at the time limit; call the part again to resume)"
cp "$table" "$out/" 2>/dev/null || echo "no table written"
