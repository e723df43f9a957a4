#!/usr/bin/env bash
# The tensor-core dense prefill attention (kernels/attn_prefill.cu, --prefill-attention
# tensor-core) on the GPU, in one device call, from the repository root there:
#   scripts/device/prefill.sh check OUT   gpu-check's kernel cases (attention_dense_prefill
#                                         among them) and gpu-check-e2e (its *-tc-prefill
#                                         cases; SmolLM2 real text too when MODEL names the
#                                         fixture directory)
#   scripts/device/prefill.sh perf OUT    generate on MODEL (default synth:nosa-8b) with a
#                                         dense prefill of CONTEXT book tokens (default 16384),
#                                         rowwise then tensor-core: prefill ms and the
#                                         generated text of each (JSON reports in OUT)
# Expects .device/bin/{sparda,tokenizer.json}; SPARDA_COMMIT names the build's commit.
set -uo pipefail
phase=${1:?phase}
out=${2:?out dir}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin/sparda
tok=.device/bin/tokenizer.json
book=data/texts/hamlet.txt
mkdir -p "$out"
case "$phase" in
check)
  SPARDA_CHECK_ONLY=kernels $bin gpu-check --json "$out/gpu_check_kernels.json" 2>&1 | tail -16
  $bin gpu-check-e2e ${MODEL:+--model "$MODEL"} --json "$out/gpu_check_e2e.json" --steps 48 2>&1 | tail -16
  ;;
perf)
  model=${MODEL:-synth:nosa-8b}
  ctx=${CONTEXT:-16384}
  for pa in rowwise tensor-core; do
    $bin generate --model "$model" --tokenizer "$tok" --prompt-file "$book" --prompt-tokens "$ctx" \
      --max-new-tokens 32 --backend cuda --prefill dense --prefill-attention "$pa" \
      --json "$out/generate_${pa}.json" 2>&1 | tail -3
  done
  ;;
*)
  echo "unknown phase $phase (check | perf)" >&2
  exit 2
  ;;
esac
