#!/usr/bin/env bash
# Forecast weights fitted from the SmolLM2 fixture's own activations, at 8K
# context, on the GPU machine (forecast/README.md):
#   scripts/device/forecast.sh PHASE OUT_DIR
# Phases (run in order; `all` runs them all):
#   collect  `sparda forecast collect` on the CPU reference (16 cores there; f32
#            activations) over the training texts, 2 chunks of 8,192 tokens each
#   fit      `sparda forecast fit` for both targets (score, qmean)
#   eval     `sparda forecast eval` on the held-out texts: fitted (both targets),
#            random weights, reuse of the previous step, random choice
#   collect-gpu  the same collection on the GPU engine (`--backend cuda`: bf16 activations read
#            back at the sampled positions) into OUT_DIR/train_gpu.bin, the `score` fit from it
#            (fitted_score_gpu.safetensors) and its eval beside the CPU-collected fit when
#            OUT_DIR/fitted_score.safetensors exists (eval runs on the CPU reference)
#   fit-gpu  collect-gpu without the eval: the weights for the SmolLM2 grid with fitted
#            forecast weights (`FORECAST=OUT_DIR/fitted_score_gpu.safetensors
#            SMOL_CELLS=benches/results/eb_grid_smollm2_fitted_h200/cells report.sh smol OUT`)
#   ppl      `sparda perplexity` on the GPU at 8K: dense base; query-aware InfLLM-V2;
#            forecast with the fitted weights and with random weights (synth:1), each
#            GPU-resident and with --kv offload, prefetch on and off; KL against dense
# Needs the fixture (scripts/device/quality.sh fixture) and the texts in TEXTS_DIR
# (default .device/texts, a copy of ../shared/data/texts).
# Env: FITTED (the fitted weights `ppl` reads; default OUT_DIR/fitted_score.safetensors from
#      `fit`: carry them, e.g. .device/forecast_8k/fitted_score.safetensors, to run `ppl` alone),
#      SPARDA (binary, default .device/bin/sparda), SPARDA_COMMIT, BUDGET (default 48),
#      SELECT (default 16), SCORE (scored tokens per chunk, default 1024), CHUNKS (default 2).
set -uo pipefail
phase=${1:?phase}; out=${2:?out dir}
mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
FX=.fixtures/smollm2-135m-instruct
TEXTS_DIR=${TEXTS_DIR:-.device/texts}
BUDGET=${BUDGET:-48}; SELECT=${SELECT:-16}; SCORE=${SCORE:-1024}; CHUNKS=${CHUNKS:-2}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mode=(--model "$FX" --selection infllmv2 --budget-blocks "$BUDGET" --select-blocks "$SELECT")
train="$TEXTS_DIR/coriolanus.txt,$TEXTS_DIR/henry_iv_part_2.txt,$TEXTS_DIR/richard_iii.txt"
held="data/texts/hamlet.txt,$TEXTS_DIR/paradise_lost.txt"

run() { echo "--- $*"; "$@" || echo "FAILED: $*"; }

do_collect() {
  run "$SPARDA" forecast collect "${mode[@]}" --text "$train" --context 8192 \
    --max-chunks "$CHUNKS" --stride 8 --decode 32 --out "$out/train.bin"
}
do_collect_gpu() {
  run "$SPARDA" forecast collect "${mode[@]}" --text "$train" --context 8192 \
    --max-chunks "$CHUNKS" --stride 8 --decode 32 --backend cuda --out "$out/train_gpu.bin"
  run "$SPARDA" forecast fit --data "$out/train_gpu.bin" --target score \
    --out "$out/fitted_score_gpu.safetensors" --json "$out/fit_score_gpu.json"
  cpu_fit=()
  [[ -f "$out/fitted_score.safetensors" ]] && cpu_fit=(--forecast "score_cpu=$out/fitted_score.safetensors")
  run "$SPARDA" forecast eval "${mode[@]}" --text "$held" --context 8192 --positions 128 \
    --forecast "score_gpu=$out/fitted_score_gpu.safetensors" "${cpu_fit[@]}" \
    --json "$out/eval_gpu.json" | tee "$out/eval_gpu.md"
}
do_fit_gpu() {  # collection on the GPU engine and the `score` fit, no eval (for the SmolLM2 grid)
  run "$SPARDA" forecast collect "${mode[@]}" --text "$train" --context 8192 \
    --max-chunks "$CHUNKS" --stride 8 --decode 32 --backend cuda --out "$out/train_gpu.bin"
  run "$SPARDA" forecast fit --data "$out/train_gpu.bin" --target score \
    --out "$out/fitted_score_gpu.safetensors" --json "$out/fit_score_gpu.json"
}
do_fit() {
  for t in score qmean; do
    run "$SPARDA" forecast fit --data "$out/train.bin" --target "$t" \
      --out "$out/fitted_$t.safetensors" --json "$out/fit_$t.json"
  done
}
do_eval() {
  run "$SPARDA" forecast eval "${mode[@]}" --text "$held" --context 8192 --positions 128 \
    --forecast "score=$out/fitted_score.safetensors" --forecast "qmean=$out/fitted_qmean.safetensors" \
    --forecast random_weights=synth:1 --json "$out/eval.json" | tee "$out/eval.md"
}
do_ppl() {
  for text in data/texts/hamlet.txt "$TEXTS_DIR/paradise_lost.txt"; do
    t=$(basename "$text" .txt); L="$out/ppl/$t"; mkdir -p "$L"
    g=(--model "$FX" --text "$text" --context 8192 --score "$SCORE" --max-chunks "$CHUNKS" --backend cuda)
    s=(--selection infllmv2 --budget-blocks "$BUDGET" --select-blocks "$SELECT")
    run "$SPARDA" perplexity "${g[@]}" --attention dense --save-logits "$L/dense.logits" --json "$L/dense.json"
    run "$SPARDA" perplexity "${g[@]}" "${s[@]}" --kl-base "$L/dense.logits" --json "$L/query_aware.json"
    for f in "fitted=${FITTED:-$out/fitted_score.safetensors}" random=synth:1; do
      name=${f%%=*}; w=${f#*=}
      run "$SPARDA" perplexity "${g[@]}" "${s[@]}" --forecast "$w" --kl-base "$L/dense.logits" \
        --json "$L/forecast_${name}_resident.json"
      for p in on off; do
        run "$SPARDA" perplexity "${g[@]}" "${s[@]}" --forecast "$w" --kv offload --prefetch "$p" \
          --kl-base "$L/dense.logits" --json "$L/forecast_${name}_offload_prefetch_$p.json"
      done
    done
  done
}

case "$phase" in
collect) do_collect ;;
collect-gpu) do_collect_gpu ;;
fit-gpu) do_fit_gpu ;;
fit) do_fit ;;
eval) do_eval ;;
ppl) do_ppl ;;
all) do_collect; do_fit; do_eval; do_ppl ;;
*) echo "unknown phase $phase (collect|collect-gpu|fit-gpu|fit|eval|ppl|all)"; exit 2 ;;
esac
