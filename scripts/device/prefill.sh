#!/usr/bin/env bash
# The prefill benchmark on the GPU machine: prefill tokens/s and time to
# first token of synthetic NOSA-8B (book prompts), dense and sparse prefill,
# KV on the GPU and offloaded (the spill to pinned host memory included),
# B = 1 and 4, beside the transformers SDPA baseline of the same shape.
# One phase per device call (each < 10 minutes):
#   scripts/device/prefill.sh check        OUT   the tensor-core prefill attention (--prefill-attention
#                                                tensor-core), dense and sparse: gpu-check's kernel cases
#                                                (attention_dense_prefill and attention_sparse_prefill
#                                                among them) and gpu-check-e2e (its *-tc-prefill cases,
#                                                tiny-nosa-sparse-tc-prefill and tiny-infllmv2-tc-prefill
#                                                included; SmolLM2 real text too when MODEL names the
#                                                fixture directory)
#   scripts/device/prefill.sh perf         OUT   generate on MODEL (default synth:nosa-8b) with a dense
#                                                prefill of CONTEXT book tokens (default 16384), rowwise
#                                                then tensor-core: prefill ms and the generated text
#   scripts/device/prefill.sh short-sparse OUT   4K, 16K, 32K, sparse prefill
#   scripts/device/prefill.sh short-dense  OUT   the same, dense prefill (NOSA_F)
#   scripts/device/prefill.sh long-sparse  OUT   64K, 128K (runs as 127K: 128K and the first
#                                                token's position exceed max_position_embeddings)
#   scripts/device/prefill.sh long-dense   OUT   the same, dense prefill
#   scripts/device/prefill.sh baseline     OUT   transformers SDPA prefill at 4K … 128K
#   scripts/device/prefill.sh chunks       OUT   32K and 128K (as 127K), B = 1, KV on GPU, dense and sparse
#                                                prefill with SPARDA_PREFILL_CHUNK 512, 1024 (the default)
#                                                and 2048 (CHUNKS to choose): one process each; with
#                                                CHUNKS_E2E=1 gpu-check-e2e at each chunk first
#   scripts/device/prefill.sh ab           OUT   the binary at BASE (default .device/bin/sparda_base: an
#                                                earlier commit's build, carried beside this one) against
#                                                this one, alternating over ROUNDS (default 2): 32K B = 1
#                                                dense and sparse prefill, KV on GPU, then the B = 1 4K
#                                                decode step (dense and sparse attention); one process
#                                                each (about 35 s), files *_base_<r>.json / *_new_<r>.json
#   scripts/device/prefill.sh opts         OUT   NVRTC tuning options against each other: per OPTS entry
#                                                (label=options, ";"-separated; "base=" the defaults)
#                                                gpu-check's kernels group, then dense prefill at DENSE_CONTEXT
#                                                (default 32K) and sparse at CONTEXT (default 32K,128K), B = 1,
#                                                over ROUNDS (default 1); OPTS_ENV=1: entries of label=VAR=value
#                                                (environment settings, e.g. "base=;v8=SPARDA_SWIGLU=v8")
#   scripts/device/prefill.sh scores       OUT   the sparse prefill window-scoring kernels: gpu-check's kernel
#                                                and selection cases (qa_prefill_scores* among them), then per
#                                                SPARDA_PREFILL_SCORES value in SCORES (default: the set to
#                                                compare, tensor-core-split tensor-core-bf16x2) gpu-check-e2e and sparse prefill at CONTEXT
#                                                (default 32K,128K), one process each; per SCORES_OPTS entry
#                                                (label=NVRTC options) the select cases and the prefill again;
#                                                with NCU=1 Nsight Compute sections of one window-scoring
#                                                launch per value; and a traced prefill of TRACE_TOKENS
#                                                (default 32768; past hamlet.txt's 52.8K tokens the prompt is
#                                                hamlet.txt repeated, or TRACE_PROMPT) per value in TRACE_SCORES
#                                                (default tensor-core-bf16x2, the default; its phases); about
#                                                5 minutes without options
#   scripts/device/prefill.sh union        OUT   sparse prefill at CONTEXT (default 32K,128K), B = 1, KV on the GPU,
#                                                with SPARDA_PREFILL_UNION_STATS=1: per prefill, the mean blocks per
#                                                row selection, per warp union and per tile union of the sparse
#                                                tensor-core attention (every eighth layer; its downloads slow the
#                                                prefill, so its times are not comparable)
# Then, here: sparda report OUT/prefill_*.json OUT/transformers_sdpa_prefill.json \
#   --out benches/results/prefill_nosa8b_h200_<date>_<commit>   (a table and PREFIX.prefill.svg)
# Env: SPARDA (default .device/bin/sparda), SPARDA_COMMIT, BATCH (default 1,4),
#      PREFILL_ATTENTION (extra `--prefill-attention` value when the binary has it).
set -uo pipefail
phase=${1:?phase: check|perf|short-sparse|short-dense|long-sparse|long-dense|baseline|chunks|opts|ab|scores|union}; out=${2:?out dir}; mkdir -p "$out"
SPARDA=${SPARDA:-.device/bin/sparda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
tok=${TOKENIZER:-.device/bin/tokenizer.json}
texts=.device/texts; ls $texts/*.txt >/dev/null 2>&1 || texts=data/texts
batch=${BATCH:-1,4}
extra=()
[[ -n "${PREFILL_ATTENTION:-}" ]] && extra=(--prefill-attention "$PREFILL_ATTENTION")
bench() { # name, context list
  "$SPARDA" bench --model synth:nosa-8b --tokenizer "$tok" --texts "$texts" --steps 0 \
    --attention sparse --kv gpu,offload --batch "$batch" --context "$2" "${extra[@]}" \
    --prefill "$3" --json "$out/prefill_$1_$3.json" 2>&1 | grep -v "^\s*$" | tail -12
}
prefill_b1() { # binary, context list, prefill mode, JSON path, more bench arguments…: prefill only, B = 1, KV on the GPU
  # (stopped after RUN_TIMEOUT seconds when set)
  local bin=$1 ctx=$2 mode=$3 json=$4; shift 4
  timeout -k 10 "${RUN_TIMEOUT:-0}" "$bin" bench --model synth:nosa-8b --tokenizer "$tok" --texts "$texts" --steps 0 --attention sparse \
    --kv gpu --batch 1 --context "$ctx" "$@" --prefill "$mode" --json "$json" 2>&1
}
case "$phase" in
check)
  SPARDA_CHECK_ONLY=kernels "$SPARDA" gpu-check --json "$out/gpu_check_kernels.json" 2>&1 \
    | grep -E "FAIL|error:|cases|passed, max" | tail -40
  "$SPARDA" gpu-check-e2e ${MODEL:+--model "$MODEL"} --json "$out/gpu_check_e2e.json" --steps 48 2>&1 | tail -16
  ;;
perf)
  for pa in rowwise tensor-core; do
    "$SPARDA" generate --model "${MODEL:-synth:nosa-8b}" --tokenizer "$tok" --prompt-file data/texts/hamlet.txt \
      --prompt-tokens "${CONTEXT:-16384}" --max-new-tokens 32 --backend cuda --prefill dense \
      --prefill-attention "$pa" --json "$out/generate_${pa}.json" 2>&1 | tail -3
  done
  ;;
short-sparse) bench short 4K,16K,32K sparse ;;
short-dense) bench short 4K,16K,32K dense ;;
long-sparse) bench long 64K,128K sparse ;;
long-dense) bench long 64K,128K dense ;;
chunks)
  # CHUNKS_E2E=1: first gpu-check-e2e at each chunk (its chunk-boundary prompts follow the chunk;
  # MODEL, a checkpoint directory such as the SmolLM2 fixture, adds the real-text cases)
  if [[ "${CHUNKS_E2E:-0}" == 1 ]]; then
    for c in ${CHUNKS:-512 1024 2048}; do
      SPARDA_PREFILL_CHUNK=$c "$SPARDA" gpu-check-e2e ${MODEL:+--model "$MODEL"} \
        --json "$out/gpu_check_e2e_chunk$c.json" 2>&1 | tail -3 | sed "s/^/chunk $c: /"
    done
  fi
  for c in ${CHUNKS:-512 1024 2048}; do
    for m in dense sparse; do
      SPARDA_PREFILL_CHUNK=$c prefill_b1 "$SPARDA" "${CONTEXT:-32K,128K}" "$m" "$out/prefill_chunk${c}_$m.json" \
        "${extra[@]}" | grep -E "prefill|tokens/s" | tail -4
    done
  done
  ;;
opts)
  # OPTS: "label=NVRTC options;…" (an empty options part: the defaults), alternating over ROUNDS
  # (default 1): gpu-check's OPTS_GROUP (default kernels: the prefill attention cases among them;
  # select for the window-scoring kernels; OPTS_CHECK=0 skips it) once per entry, then per round
  # OPTS_MODES (default "dense sparse"): dense prefill at DENSE_CONTEXT (default 32K) and sparse prefill at
  # CONTEXT (default 32K,128K), B = 1, KV on the GPU, one process each, files
  # prefill_<mode>_opts_<label>_<r>.json; each process stopped after OPTS_TIMEOUT seconds (default 240: a
  # kernel variant that never finishes, e.g. a wait that is never satisfied, costs no more than that).
  # OPTS_ENV=1: each entry's part after "label=" is environment assignments instead
  # ("base=;v8=SPARDA_SWIGLU=v8": the SwiGLU kernels against each other)
  IFS=';' read -ra opts <<< "${OPTS:?OPTS: label=NVRTC options;…}"
  for o in "${opts[@]}"; do
    [[ "$o" == *=* ]] || { echo "OPTS entry '$o': give label=options (an empty options part for the defaults)"; exit 2; }
  done
  # the entry's environment, exported in the subshell that runs it
  entry_env() { if [[ "${OPTS_ENV:-0}" == 1 ]]; then [[ -n "$1" ]] && export $1; else export SPARDA_NVRTC_OPTIONS="$1"; fi; }
  [[ "${OPTS_CHECK:-1}" == 1 ]] && for o in "${opts[@]}"; do
    l=${o%%=*}
    g=${OPTS_GROUP:-kernels}
    ( entry_env "${o#*=}"; SPARDA_CHECK_ONLY=$g timeout -k 10 "${OPTS_TIMEOUT:-240}" "$SPARDA" gpu-check \
      --json "$out/gpu_check_${g//,/_}_opts_$l.json" 2>&1 | grep -E "FAIL|error:|cases|attention_|qa_prefill_scores_m32s|swiglu" | sed "s/^/$l: /"
    rc=${PIPESTATUS[0]}; [[ $rc == 124 ]] && echo "$l: gpu-check timed out after ${OPTS_TIMEOUT:-240} s (a kernel that never finishes?)" )
  done
  for r in $(seq 1 "${ROUNDS:-1}"); do
    for o in "${opts[@]}"; do
      l=${o%%=*}
      for m in ${OPTS_MODES:-dense sparse}; do
        ctx=${CONTEXT:-32K,128K}; [[ $m == dense ]] && ctx=${DENSE_CONTEXT:-32K}
        ( entry_env "${o#*=}"; RUN_TIMEOUT=${OPTS_TIMEOUT:-240} prefill_b1 "$SPARDA" "$ctx" "$m" \
          "$out/prefill_${m}_opts_${l}_$r.json" | grep -E "prefill only|error" | sed "s/^/$l $r $m: /"
        [[ ${PIPESTATUS[0]} == 124 ]] && echo "$l $r $m: timed out after ${OPTS_TIMEOUT:-240} s" )
      done
    done
  done
  ;;
union)
  SPARDA_PREFILL_UNION_STATS=1 prefill_b1 "$SPARDA" "${CONTEXT:-32K,128K}" sparse "$out/prefill_sparse_union_stats.json" \
    | grep -E "union stats|prefill only|rror" | tee "$out/union_stats.txt"
  ;;
ab)
  base=${BASE:-.device/bin/sparda_base}
  [[ -x "$base" ]] || { echo "ab: no base binary at $base"; exit 2; }
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in base new; do
      bin=$SPARDA; [[ $v == base ]] && bin=$base
      for m in dense sparse; do
        prefill_b1 "$bin" "${CONTEXT:-32K}" "$m" "$out/prefill_32k_${m}_${v}_$r.json" \
          | grep -E "prefill only" | sed "s/^/$v $r: /"
      done
      "$bin" bench --model synth:nosa-8b --tokenizer "$tok" --attention dense,sparse --batch 1 --context 4K \
        --steps 64 --json "$out/decode_b1_4k_${v}_$r.json" 2>&1 | grep -E "B=1 L=4K|sparse +gpu" | sed "s/^/$v $r: /"
    done
  done
  ;;
scores)
  # (the select group holds the prefill scoring kernels' cases against the CPU reference)
  # SCORES: the SPARDA_PREFILL_SCORES values to check end to end and time (default
  # tensor-core-split tensor-core-bf16x2); SCORES_OPTS: "label=NVRTC options;…", each timed with SPARDA_PREFILL_SCORES
  # = OPTS_SCORES (default tensor-core-bf16x2, the default), its select cases and (unless OPTS_E2E=0)
  # gpu-check-e2e checked, with SPARDA_NVRTC_OPTIONS set, files *_opts_<label>; TRACE_SCORES: those to trace at
  # TRACE_TOKENS prompt tokens (default tensor-core-bf16x2, the default kernels, at 32768; 0: none; the prompt
  # TRACE_PROMPT, default hamlet.txt, four copies of it past 50,000 tokens); NCU=1: Nsight Compute sections of the
  # last window-scoring launch of an 8K-token sparse prefill per SCORES value (or NCU_SCORES;
  # ncu_<value>.txt)
  kinds=${SCORES:-tensor-core-split tensor-core-bf16x2}
  dflt=tensor-core-bf16x2  # DEFAULT_PREFILL_SCORES (src/cuda/ops/prefill_scores.rs)
  SPARDA_CHECK_ONLY=kernels,select "$SPARDA" gpu-check \
    --json "$out/gpu_check_kernels_select.json" 2>&1 | grep -E "FAIL|error:|qa_|attention|cases" | tail -16
  for k in $kinds; do
    SPARDA_PREFILL_SCORES=$k "$SPARDA" gpu-check-e2e ${MODEL:+--model "$MODEL"} \
      --json "$out/gpu_check_e2e_scores_$k.json" --steps 48 2>&1 | grep -E "fail|FAIL|passed|sparse-tc" | sed "s/^/$k: /" | tail -6
  done
  for k in $kinds; do
    SPARDA_PREFILL_SCORES=$k prefill_b1 "$SPARDA" "${CONTEXT:-32K,128K}" sparse "$out/prefill_sparse_scores_$k.json" \
      | grep -E "prefill only" | sed "s/^/$k: /"
  done
  IFS=';' read -ra opts <<< "${SCORES_OPTS:-}"
  for o in "${opts[@]}"; do
    [[ "$o" == *=* ]] || { echo "SCORES_OPTS entry '$o': give label=options"; continue; }
    l=${o%%=*}
    SPARDA_NVRTC_OPTIONS="${o#*=}" SPARDA_CHECK_ONLY=select "$SPARDA" gpu-check \
      --json "$out/gpu_check_select_opts_$l.json" 2>&1 | grep -E "FAIL|error:|cases" | sed "s/^/$l: /" | tail -4
    [[ "${OPTS_E2E:-1}" == 1 ]] && SPARDA_PREFILL_SCORES=${OPTS_SCORES:-$dflt} SPARDA_NVRTC_OPTIONS="${o#*=}" \
      "$SPARDA" gpu-check-e2e ${MODEL:+--model "$MODEL"} --json "$out/gpu_check_e2e_opts_$l.json" --steps 48 2>&1 \
      | grep -E "fail|FAIL|passed|sparse-tc" | sed "s/^/$l: /" | tail -6
    SPARDA_PREFILL_SCORES=${OPTS_SCORES:-$dflt} SPARDA_NVRTC_OPTIONS="${o#*=}" prefill_b1 "$SPARDA" \
      "${CONTEXT:-32K,128K}" sparse "$out/prefill_sparse_scores_opts_$l.json" | grep -E "prefill only|error" | sed "s/^/$l: /"
  done
  if [[ "${NCU:-0}" == 1 ]]; then
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for k in ${NCU_SCORES:-$kinds}; do
      # 8 chunks of 1024 rows x 32 layers: launch 255 is the last chunk's last layer
      SPARDA_PREFILL_SCORES=$k "$ncu" --clock-control none -k regex:qa_prefill_scores --launch-skip 255 \
        --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy \
        --section WarpStateStats --section LaunchStats "$SPARDA" generate --model synth:nosa-8b \
        --tokenizer "$tok" --prompt-file data/texts/hamlet.txt --prompt-tokens 8192 --max-new-tokens 1 \
        --backend cuda --prefill sparse > "$out/ncu_$k.txt" 2>&1
      grep -E "qa_prefill|Duration|Throughput|Pipe|Bank|Registers|Achieved Occupancy|Stall|Issued" "$out/ncu_$k.txt" | head -40
    done
  fi
  # where the time goes: a traced sparse prefill with each (phases qkv, rope_append, compress, window_logits,
  # window_scores, select, attention, o_proj, ffn; about 35 s each at 32K)
  tt=${TRACE_TOKENS:-32768}
  tp=${TRACE_PROMPT:-data/texts/hamlet.txt}
  if [[ -z "${TRACE_PROMPT:-}" && $tt -gt 50000 ]]; then  # hamlet.txt is 52.8K tokens
    tp="$out/.trace_prompt.txt"
    for _ in 1 2 3 4; do cat data/texts/hamlet.txt; done > "$tp"
  fi
  [[ $tt == 0 ]] || for k in ${TRACE_SCORES:-$dflt}; do
    SPARDA_PREFILL_SCORES=$k "$SPARDA" generate --model synth:nosa-8b --tokenizer "$tok" \
      --prompt-file "$tp" --prompt-tokens "$tt" --max-new-tokens 2 --backend cuda \
      --prefill sparse --trace "$out/trace_$k.json" 2>&1 | grep "^prefill" | sed "s/^/$k: /"
    "$SPARDA" trace summarize "$out/trace_$k.json" 2>&1 | head -20 > "$out/trace_sparse_${tt}_$k.txt"
    cat "$out/trace_sparse_${tt}_$k.txt"; rm -f "$out/trace_$k.json"
  done
  rm -f "$out/.trace_prompt.txt"
  ;;
baseline)
  python3 benches/baselines/transformers_prefill.py --context 4K,16K,32K,64K,128K \
    --batch "$batch" --json "$out/transformers_sdpa_prefill.json" ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
