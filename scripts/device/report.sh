#!/usr/bin/env bash
# The benchmark report (runtime.md §5): every mode side by side under the
# equivalent-batch protocol on synthetic NOSA-8B, the transformers baselines,
# then `sparda report`. One phase per device call (each < 10 minutes):
#
#   scripts/device/report.sh grid16k  OUT   EB 128 at 16K   (B·L = 2 Mi tokens offloaded: 64 GiB pinned)
#   scripts/device/report.sh grid32k  OUT   EB 64  at 32K
#   scripts/device/report.sh grid64k  OUT   EB 32  at 64K
#   scripts/device/report.sh grid96k  OUT   EB 16  at 96K   (1.5 Mi tokens)
#   scripts/device/report.sh grid128k OUT   EB 16  at 128K  (runs as 127K: 128K + the decoded
#                                            steps exceed max_position_embeddings 131,072)
#   scripts/device/report.sh smol     OUT   the SmolLM2 fixture (real weights, real prefill of book
#                                            text; no eviction heads: InfLLM-V2 selection, budget 48
#                                            blocks) at 2K/4K/8K (8K runs as 7K), EB 64, into $SMOL_CELLS
#                                            (default benches/results/eb_grid_smollm2_h200/cells);
#                                            needs `quality.sh fixture` in the same warm machine first
#   scripts/device/report.sh sdpa     OUT   transformers + SDPA, KV on the GPU, at the EB batches
#   scripts/device/report.sh offload  OUT   transformers + DynamicCache(offloading=True)
#   scripts/device/report.sh report   OUT   sparda report (also runs on the CPU machine; CELLS and
#                                            NAME=eb_grid_smollm2_h200 for the SmolLM2 grid's report)
#
# EB per context keeps B·L of the offloaded modes at ≤ 2 Mi tokens: this
# machine's 128 GiB of host RAM bounds the pinned KV store (runtime.md §4:
# B·L under about 3 M tokens). Every grid phase writes one JSON per cell into
# $CELLS (default benches/results/eb_grid_h200/cells, in the working tree so
# it travels to the device) with --resume, stops itself cleanly (SIGINT) 45 s
# before the call's limit, and packs the cells into OUT/cells.tar.gz: unpack it
# into $CELLS on the CPU machine before the next call, and a phase cut short
# resumes where it stopped when called again (cells already there are skipped).
#
# Expects .device/bin/{sparda,tokenizer.json} (the release binary and the
# SmolLM2 tokenizer, carried with `carry: [".device"]`) and optionally
# .device/texts/*.txt (the books of ../shared/data/texts; else data/texts).
# benches/results/README.md ("The equivalent-batch report") has the full
# sequence of calls.
set -euo pipefail
phase=${1:?phase}
out=${2:?out dir}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin/sparda
tok=.device/bin/tokenizer.json
cells=${CELLS:-benches/results/${NAME:-eb_grid_h200}/cells}
texts=${TEXTS:-}
if [ -z "$texts" ] && ls .device/texts/*.txt >/dev/null 2>&1; then texts=.device/texts; fi
steps=${STEPS:-64}
limit=${LIMIT:-540}   # seconds before the bench stops itself (the call's limit is 600)
base=${BASELINES:-benches/results/${NAME:-eb_grid_h200}/baselines}   # the baselines beside this grid

grid() { # CONTEXT EB
  mkdir -p "$cells"
  set +e
  timeout -s INT "$limit" $bin bench --model synth:nosa-8b --equivalent-batch "$2" --context "$1" \
    --kv offload --fetch auto --forecast synth:1 --steps "$steps" --fetch-timing-steps 8 \
    --ceiling-reps 20 --profile-reps 0 --tokenizer "$tok" ${texts:+--texts "$texts"} \
    --resume "$cells" 2>&1 | tail -40
  rc=${PIPESTATUS[0]}
  set -e
  echo "bench exit code $rc (130 or 124: stopped at the time limit; call the phase again to resume)"
  # one archive: a call brings back at most 8 files
  tar czf "$out/cells.tar.gz" -C "$cells" . && tar tzf "$out/cells.tar.gz" | grep -c json
}

case "$phase" in
smol)
  smol_cells=${SMOL_CELLS:-benches/results/eb_grid_smollm2_h200/cells}
  mkdir -p "$smol_cells"
  set +e
  timeout -s INT "$limit" $bin bench --model .fixtures/smollm2-135m-instruct --equivalent-batch "${EB:-64}" \
    --context 2K,4K,8K --kv offload --fetch auto --forecast "${FORECAST:-synth:1}" --prefill sparse \
    --budget-blocks 48 --select-blocks 16 --steps "$steps" --fetch-timing-steps 8 --ceiling-reps 20 \
    --profile-reps 0 ${texts:+--texts "$texts"} --resume "$smol_cells" 2>&1 | tail -40
  echo "bench exit code ${PIPESTATUS[0]} (130 or 124: stopped at the time limit; call the phase again to resume)"
  set -e
  tar czf "$out/smol_cells.tar.gz" -C "$smol_cells" . && tar tzf "$out/smol_cells.tar.gz" | grep -c json
  ;;
grid16k) grid 16K 128 ;;
grid32k) grid 32K 64 ;;
grid64k) grid 64K 32 ;;
grid96k) grid 96K 16 ;;
grid128k) grid 128K 16 ;;
sdpa)
  # full attention, KV on the GPU, at the GPU-resident batch of each EB cell
  # (EB·64·64/L: 16K/EB128 → 32, 32K/EB64 → 8, 64K/EB32 → 2, 96K and 128K/EB16 → 1)
  mkdir -p "$out/baselines"
  for cell in 16K:128 32K:64 64K:32 96K:16 127K:16; do
    timeout 150 python3 benches/baselines/transformers_decode.py --cache gpu --context "${cell%%:*}" \
      --equivalent-batch "${cell##*:}" --steps 16 --warmup 2 \
      --json "$out/baselines/transformers_sdpa_${cell%%:*}.json" 2>&1 | tail -4 || true
  done
  ;;
offload)
  # the offloaded cache moves every layer's whole KV each step: the two cells
  # runtime.md §4 measured (32K B16, 64K B4), then the 16K EB128 cell if time is left
  # (on the 128 GiB H200 machine it was killed with SIGKILL, most likely out of memory, 2026-12-01)
  mkdir -p "$out/baselines"
  timeout 200 python3 benches/baselines/transformers_decode.py --cache offload --context 32K --batch 16 \
    --steps 8 --warmup 1 --json "$out/baselines/transformers_offload_32k_b16.json" 2>&1 | tail -4 || true
  timeout 120 python3 benches/baselines/transformers_decode.py --cache offload --context 64K --batch 4 \
    --steps 8 --warmup 1 --json "$out/baselines/transformers_offload_64k_b4.json" 2>&1 | tail -4 || true
  timeout 220 python3 benches/baselines/transformers_decode.py --cache offload --context 16K \
    --equivalent-batch 128 --steps 4 --warmup 1 \
    --json "$out/baselines/transformers_offload_16k_eb128.json" 2>&1 | tail -4 || true
  ;;
report)
  # the CPU machine's own build first: .device/bin may hold an older binary
  if [ -n "${REPORT_BIN:-}" ]; then
    bin_report=$REPORT_BIN
    [ -x "$bin_report" ] || { echo "REPORT_BIN=$bin_report is not an executable" >&2; exit 2; }
  else
    bin_report=target/release/sparda
    [ -x "$bin_report" ] || bin_report=$bin
  fi
  inputs=("$cells")
  if ls "$base"/*.json >/dev/null 2>&1; then inputs+=("$base"); fi
  "$bin_report" report "${inputs[@]}" --out "$out/${NAME:-eb_grid_h200}" ${README:+--readme "$README"}
  ;;
*)
  echo "unknown phase $phase" >&2
  exit 2
  ;;
esac
