#!/usr/bin/env bash
# Quality runs on the GPU machine with the SmolLM2 real-weights fixture:
#   scripts/device/quality.sh PHASE OUT_DIR
# Phases:
#   fixture  join the GGUF parts (.device/fx1/part1, .device/fx2/part2, … in that order, one
#            carried per call: a call carries at most 64 MiB with the working tree), check its
#            sha256 and convert it with the project's converter (scripts/fixture.py; the `gguf`
#            package is carried in .device/fx<N>/py beside a part) into .fixtures/smollm2-135m-instruct
#   e2e      sparda gpu-check-e2e with the fixture on real text (data/texts/hamlet.txt)
#   table    the quality table on the GPU: `sparda perplexity` at 8K context in every mode,
#            each scored against the dense run (KL, top-1, Δ perplexity); identity pairs
#            (offloaded vs resident; forecast with prefetch offloaded vs resident). Texts:
#            hamlet.txt (data/texts) and paradise_lost.txt (TEXTS_DIR, default .device/texts,
#            a copy of ../shared/data/texts). About 7 minutes on an H200 (each run compiles
#            its kernels first).
#   table-cpu  CPU vs GPU on one chunk of hamlet (the CPU reference prefills 8K tokens in
#            about 80 s on 16 cores; about 100 s per CPU run)
#   scores   the sparse prefill window-scoring kernels (SPARDA_PREFILL_SCORES): InfLLM-V2
#            budget 64 at 8K on hamlet with the cuBLAS logits (the base, against dense too),
#            then tensor-core-split, tensor-core and tensor-core-bf16x2 (the default) scored against it (KL, top-1, Δ perplexity:
#            what each kernel's selections cost; the exact kernels should be near zero)
# Then: python3 scripts/quality_table.py OUT_DIR > OUT_DIR.md
# Env: SPARDA (binary, default .device/bin/sparda), SPARDA_COMMIT, CHUNKS (per text, default 2),
#      SCORE (scored tokens per chunk, default 1024), CPU_SCORE (default 64).
set -uo pipefail
phase=${1:?phase}; out=${2:?out dir}
mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
FX=.fixtures/smollm2-135m-instruct
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}

case "$phase" in
fixture)
  mkdir -p .fixtures/cache
  gguf=.fixtures/cache/SmolLM2-135M-Instruct.Q4_1.gguf
  parts=(); for ((i = 1; i <= 9; i++)); do [[ -f .device/fx$i/part$i ]] && parts+=(.device/fx$i/part$i); done
  cat "${parts[@]}" > "$gguf"
  py=$(ls -d .device/fx*/py 2>/dev/null | head -1)
  want=$(grep -o 'GGUF_SHA256="[0-9a-f]*"' scripts/fixture.sh | cut -d'"' -f2)
  got=$(sha256sum "$gguf" | cut -d' ' -f1)
  [[ "$got" == "$want" ]] || { echo "GGUF sha256 $got != $want"; exit 1; }
  PYTHONPATH=$py python3 scripts/fixture.py --gguf "$gguf" --out "$FX" --gguf-sha256 "$want"
  ;;
e2e)
  "$SPARDA" gpu-check-e2e --model "$FX" --text data/texts/hamlet.txt \
    --json "$out/gpu_check_e2e.json"
  ;;
table|table-cpu|scores)
  CHUNKS=${CHUNKS:-2}; SCORE=${SCORE:-1024}; CPU_SCORE=${CPU_SCORE:-64}
  TEXTS_DIR=${TEXTS_DIR:-.device/texts}
  common=(--model "$FX" --context 8192 --score "$SCORE" --max-chunks "$CHUNKS")
  b48=(--selection infllmv2 --budget-blocks 48 --select-blocks 16)
  b64=(--selection infllmv2 --budget-blocks 64 --select-blocks 16)
  b96=(--selection infllmv2 --budget-blocks 96 --select-blocks 24)
  ppl() { # name, args…: one run, its JSON and log under $out/<text>/
    local name=$1; shift
    echo "--- $t $name: sparda perplexity $*"
    "$SPARDA" perplexity "$@" --json "$out/$t/$name.json" >"$out/$t/$name.log" 2>&1 \
      || { echo "FAILED: $name"; tail -5 "$out/$t/$name.log"; }
    tail -3 "$out/$t/$name.log"
  }
  if [[ "$phase" == scores ]]; then
    t=hamlet_scores; mkdir -p "$out/$t"; L="$out/$t"
    g=("${common[@]}" --text data/texts/hamlet.txt --backend cuda)
    ppl dense "${g[@]}" --save-logits "$L/dense.logits"
    SPARDA_PREFILL_SCORES=cublas ppl infllmv2_b64_s16_cublas_scores "${g[@]}" "${b64[@]}" \
      --kl-base "$L/dense.logits" --save-logits "$L/cublas.logits"
    for k in tensor-core-split tensor-core tensor-core-bf16x2; do
      SPARDA_PREFILL_SCORES=$k ppl "infllmv2_b64_s16_${k//-/_}_scores_vs_cublas" "${g[@]}" "${b64[@]}" \
        --kl-base "$L/cublas.logits"
    done
    rm -f "$L"/*.logits
    exit 0
  fi
  [[ "$phase" == table ]] && for text in data/texts/hamlet.txt "$TEXTS_DIR/paradise_lost.txt"; do
    t=$(basename "$text" .txt); mkdir -p "$out/$t"; L="$out/$t"
    g=("${common[@]}" --text "$text" --backend cuda)
    ppl dense "${g[@]}" --save-logits "$L/dense.logits"
    ppl infllmv2_b48_s16 "${g[@]}" "${b48[@]}" --kl-base "$L/dense.logits"
    ppl infllmv2_b64_s16 "${g[@]}" "${b64[@]}" --kl-base "$L/dense.logits" --save-logits "$L/b64.logits"
    ppl infllmv2_b96_s24 "${g[@]}" "${b96[@]}" --kl-base "$L/dense.logits"
    ppl infllmv2_b64_s16_dense_prefill "${g[@]}" "${b64[@]}" --prefill dense --kl-base "$L/dense.logits"
    ppl infllmv2_b64_s16_offload "${g[@]}" "${b64[@]}" --kv offload --kl-base "$L/dense.logits"
    ppl infllmv2_b64_s16_offload_vs_resident "${g[@]}" "${b64[@]}" --kv offload --kl-base "$L/b64.logits"
    ppl forecast_random_b64_s16 "${g[@]}" "${b64[@]}" --forecast synth --kl-base "$L/dense.logits" --save-logits "$L/fc.logits"
    ppl forecast_random_b64_s16_offload_prefetch_vs_resident "${g[@]}" "${b64[@]}" --forecast synth --kv offload --kl-base "$L/fc.logits"
    rm -f "$L"/*.logits
  done
  [[ "$phase" == table ]] && exit 0
  # CPU vs GPU on one chunk of hamlet (the CPU reference decodes too slowly for more).
  t=hamlet_cpu; mkdir -p "$out/$t"; L="$out/$t"
  c1=(--model "$FX" --context 8192 --score "$CPU_SCORE" --max-chunks 1 --text data/texts/hamlet.txt)
  ppl cpu_dense "${c1[@]}" --backend cpu --save-logits "$L/cpu_dense.logits"
  ppl gpu_dense_vs_cpu "${c1[@]}" --backend cuda --kl-base "$L/cpu_dense.logits"
  ppl cpu_infllmv2_b64_s16 "${c1[@]}" "${b64[@]}" --backend cpu --save-logits "$L/cpu_b64.logits"
  ppl gpu_infllmv2_b64_s16_vs_cpu "${c1[@]}" "${b64[@]}" --backend cuda --kl-base "$L/cpu_b64.logits"
  rm -f "$L"/*.logits
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
