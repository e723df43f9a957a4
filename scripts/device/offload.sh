#!/usr/bin/env bash
# Issue 4 checks and benchmark on the GPU machine (spec/device.md): run from
# the repository root there, with the stripped binary and the SmolLM2
# tokenizer in .device/bin (built and copied here: see README "GPU machine").
#   scripts/device/offload.sh check  OUT   gpu-check + identity runs (tiny, SmolLM2 if /tmp/smol exists)
#   scripts/device/offload.sh long   OUT   8,192 tokens on synthetic NOSA-8B, resident vs offloaded
#   scripts/device/offload.sh bench  OUT   offload benchmark grid on synthetic NOSA-8B
set -euo pipefail
phase=${1:?phase}
out=${2:?out dir}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin/sparda
tok=.device/bin/tokenizer.json
book=data/texts/hamlet.txt
case "$phase" in
check)
  $bin gpu-check --json "$out/gpu_check.json" 2>&1 | tail -25 || true
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 2048 --fetch sm,dma --json "$out/offload_tiny.json" 2>&1 | tail -6 || true
  $bin offload-check --model synth:tiny:6 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 40 --new-tokens 1024 --fetch sm --offload-layer0 --json "$out/offload_tiny_short.json" 2>&1 | tail -4 || true
  if [ -d /tmp/smol ]; then
    $bin offload-check --model /tmp/smol --prompt-file "$book" --prompt-tokens 6000 --new-tokens 2048 \
      --selection infllmv2 --budget-blocks 64 --fetch sm,dma --json "$out/offload_smollm2.json" 2>&1 | tail -6 || true
  fi
  ;;
long)
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 6000 --new-tokens 8192 --fetch sm --json "$out/offload_nosa8b_8k.json" 2>&1 | tail -6 || true
  ;;
bench)
  $bin bench --model synth:nosa-8b --attention sparse --kv gpu,offload --fetch sm,dma --prefetch-ctas 16 \
    --batch "${BATCH:-16,64}" --context "${CONTEXT:-32K}" --steps "${STEPS:-32}" --fetch-timing-steps 8 \
    --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/bench_offload.json" 2>&1 | tail -30 || true
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
