#!/usr/bin/env bash
# The GPU checks and the step-time comparison that belong to the one decode
# path, in one device call (spec/device.md), from the repository root there:
#   scripts/device/decode_path.sh check OUT   gpu-check, gpu-check-e2e (tiny cases), offload-check
#                                             identity (tiny; batch of different lengths; forecast
#                                             prefetch on/off with injected delays) and the steps that
#                                             mix dense and sparse rows (dense_len inside the batch):
#                                             resident vs offloaded, forecast selections vs the CPU
#                                             reference, graph and eager launch
#   scripts/device/decode_path.sh perf OUT    B16 32K sync and forecast (+/- prefetch) step times of
#                                             this build (.device/bin/sparda) and a baseline build
#                                             (.device/base/sparda), alternating, REPS times each
# Expects .device/bin/{sparda,tokenizer.json}; SPARDA_COMMIT names the build's commit.
set -uo pipefail
phase=${1:?phase}
out=${2:?out dir}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin/sparda
tok=.device/bin/tokenizer.json
book=data/texts/hamlet.txt
oc() { $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" "$@"; }
case "$phase" in
check)
  $bin gpu-check --json "$out/gpu_check.json" 2>&1 | tail -8
  $bin gpu-check-e2e --json "$out/gpu_check_e2e.json" --steps 48 2>&1 | tail -10
  oc --prompt-tokens 1000 --new-tokens 2048 --fetch sm,dma,split:8:50 --json "$out/offload_tiny.json" 2>&1 | tail -4
  oc --prompt-tokens 900 --new-tokens 1024 --batch 8 --fetch sm,dma,split:8:50 --json "$out/offload_tiny_batch8.json" 2>&1 | tail -4
  oc --prompt-tokens 1000 --new-tokens 1024 --batch 4 --forecast synth:1 --fetch sm,split:8:50 --prefetch on,off \
    --copy-delay-us 30 --cpu-check-steps 200 --json "$out/forecast_tiny_batch4.json" 2>&1 | tail -8
  # dense_len 300 inside the batch: prompts 400, 339, 278, 217 tokens (two rows cross during decode)
  oc --prompt-tokens 400 --new-tokens 512 --batch 4 --dense-len 300 --fetch sm,dma,split:8:50 \
    --json "$out/offload_tiny_dense_len_batch4.json" 2>&1 | tail -4
  oc --prompt-tokens 400 --new-tokens 512 --batch 4 --dense-len 300 --forecast synth:1 --fetch sm \
    --prefetch on,off --copy-delay-us 30 --cpu-check-steps 160 \
    --json "$out/forecast_tiny_dense_len_batch4.json" 2>&1 | tail -8
  SPARDA_DECODE=forward oc --prompt-tokens 400 --new-tokens 256 --batch 4 --dense-len 300 --forecast synth:1 \
    --fetch sm --prefetch on --cpu-check-steps 160 \
    --json "$out/forecast_tiny_dense_len_batch4_eager.json" 2>&1 | tail -8
  ;;
perf)
  run() { # build label rep
    "$1" bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm --prefetch-ctas 16 \
      --forecast synth:1 --prefetch on,off --batch 16 --context 32K --steps "${STEPS:-48}" \
      --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
      --json "$out/perf_${2}_$3.json" 2>&1 | tail -8
  }
  for r in $(seq 1 "${REPS:-3}"); do
    run .device/base/sparda base "$r"
    run "$bin" new "$r"
  done
  ;;
esac
