#!/usr/bin/env bash
# The long run on the GPU machine: B = 8 sequences from 4K-token prompts (hamlet, different
# offsets), 20,000 greedy decode steps each, synthetic NOSA-8B, offloaded KV with forecast
# selection (random projections) and prefetch, against a GPU-resident run of the same selection:
# tokens and logits bits compared at every step; GPU memory and the process's resident memory
# sampled every 1,000 steps; the tokens at steps 2K, 8K and 20K spelled out in the report.
# The two runs take about 4 and 5.5 minutes on an H200: each phase fits one device call.
#   scripts/device/soak.sh resident OUT_DIR   record the GPU-resident run (RESIDENT file)
#   scripts/device/soak.sh offload OUT_DIR    the offloaded run, compared with that record
#   scripts/device/soak.sh both OUT_DIR       both in one process
# Env: SPARDA (binary, default .device/bin/sparda), SPARDA_COMMIT, NEW_TOKENS (default 20000),
#      RESIDENT (default .device/soak/resident_nosa8b_b8.json; kept on the machine between calls).
set -uo pipefail
phase=${1:?phase: resident|offload|both}; out=${2:?out dir}; mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
tok=${TOKENIZER:-.device/bin/tokenizer.json}
resident=${RESIDENT:-.device/soak/resident_nosa8b_b8.json}
mkdir -p "$(dirname "$resident")"
args=(offload-check --model synth:nosa-8b --tokenizer "$tok"
  --prompt-file data/texts/hamlet.txt --prompt-tokens 4096 --batch 8
  --new-tokens "${NEW_TOKENS:-20000}" --forecast synth:1 --prefetch on
  --sample-memory-every 1000)
json="$out/soak_offload_forecast_prefetch_nosa8b_b8.json"
case "$phase" in
resident) "$SPARDA" "${args[@]}" --save-resident "$resident" --json "$json" && cp "$resident" "$out/" ;;
offload) "$SPARDA" "${args[@]}" --resident "$resident" --json "$json" ;;
both) "$SPARDA" "${args[@]}" --json "$json" ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
