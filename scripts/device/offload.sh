#!/usr/bin/env bash
# Checks and benchmarks on the GPU machine, one phase per call (spec/device.md):
# run from the repository root there, with the stripped binary and the SmolLM2
# tokenizer in .device/bin (built and copied here: see scripts/device/README.md).
#   scripts/device/offload.sh check  OUT   gpu-check + identity runs (tiny, SmolLM2 if /tmp/smol exists)
#   scripts/device/offload.sh long   OUT   8,192 tokens on synthetic NOSA-8B, resident vs offloaded
#   scripts/device/offload.sh bench  OUT   offload benchmark grid on synthetic NOSA-8B
#   scripts/device/offload.sh forecast OUT forecast-mode identity, stress and CPU-selection checks
#   scripts/device/offload.sh fbench OUT   sync NOSA vs forecast ± prefetch (BATCH, CONTEXT, FETCH)
#   scripts/device/offload.sh bound OUT    the overlap-bound grid with the fetch table (--fetch auto): sync,
#                                          forecast without and with prefetch, GPU-resident NOSA and forecast beside them;
#                                          32K B 8/32/64, 64K B 8/16/32, 126K B 8/16, one process per context
#                                          (CONTEXTS to choose; about 2 minutes each)
#   scripts/device/offload.sh cache OUT    cache slots: gpu-check's offload group, tiny identity with 0 and 8
#                                          cache slots, then sync / forecast / prefetch / resident at
#                                          CONTEXTS (default 64K:16 126K:16) with CACHE (0,64,192) cache slots
#   scripts/device/offload.sh batch OUT    identity with batches of different-length sequences
#   scripts/device/offload.sh traces OUT   the two example traces (sync vs prefetch), summaries, overhead
#   scripts/device/offload.sh priority OUT copy stream priority high vs default under prefetch
#   scripts/device/offload.sh reserve OUT  prefetch with GEMMs sized for all SMs vs for the SMs the copy
#                                          kernel leaves (--reserve-fetch-sms), sm:4/8/16 (BATCH, CONTEXT)
#   scripts/device/offload.sh wholesm OUT  prefetch with the copy CTAs sharing SMs (default) vs holding
#                                          whole SMs (--fetch-whole-sms), alone and with
#                                          --reserve-fetch-sms, sm:8/16 (BATCH, default 16; CONTEXT,
#                                          default 32K,64K), two alternating rounds
#   scripts/device/offload.sh diagnose OUT where the prefetch step's compute time goes: one traced forecast +
#                                          prefetch run per variant (copy CTAs sharing SMs; holding whole
#                                          SMs; whole SMs + GEMMs sized for the rest; the host store in
#                                          huge pages, SPARDA_HOST_PAGES=huge), each trace summarized with
#                                          its `beside a fetch` table, and one step's per-CTA timeline
#                                          (--cta-timeline: attention CTAs sharing an SM with a copy CTA
#                                          vs alone; with whole SMs none should share) (BATCH, default 16;
#                                          CONTEXT, 32K; FETCH, sm:16); write under run_phases.sh (12 files)
#   scripts/device/offload.sh balanced OUT 64K B 16 (BATCH, CONTEXT): per-CTA timelines and traces of the
#                                          copy kernel on 8 and 16 whole SMs, prefetch on and off
#   scripts/device/offload.sh engines OUT  the beside-a-fetch table per fetch engine (copy engines, sm:8 and
#                                          split:8:50 with whole SMs), one traced prefetch run each
#   scripts/device/offload.sh wholeab OUT  sync, forecast without and with prefetch, copy CTAs sharing SMs vs
#                                          whole SMs + GEMMs sized for the rest, two alternating rounds
#   scripts/device/offload.sh hostpages OUT prefetch and sync step time with the host store from
#                                          cuMemHostAlloc vs huge pages, sm:8/16, two alternating rounds
#   scripts/device/offload.sh eb OUT       all modes under the equivalent-batch protocol
#   scripts/device/offload.sh dmaprefetch OUT  copy engines vs SM kernel vs a split of both with prefetch
#   scripts/device/offload.sh b1 OUT       GPU-resident B=1 L=4K step vs the split-K cap (SPARDA_ATTN_MAX_SPLITS)
#   scripts/device/offload.sh ncu OUT      Nsight Compute on the B=1 4K dense step: each kernel's time, bytes,
#                                          grid and registers; the attention partials and combine in detail
#   scripts/device/offload.sh ncu-attn OUT stall reasons per SASS instruction of the decode attention partials
#                                          and combine (B=1 4K), the partials' time with 1, 2, 4 tiles per CTA
#   scripts/device/offload.sh pdl OUT      programmatic dependent launch: gpu-check-e2e, offload identity, then
#                                          the GPU-resident step with SPARDA_PDL=0 vs on (B 1 4K, B 16 32K)
#   scripts/device/offload.sh gemv OUT     the fused small-batch GEMVs: gpu-check kernels, e2e and tiny identity
#                                          with the defaults, B 1 4K dense: balanced vs capped grid vs cuBLAS
#                                          (GEMV_CASES, GEMV_OPTS: more settings; see the phase)
#   scripts/device/offload.sh cachectas OUT cache slots 0/192 with the copy kernel on 8, 12, 16 whole SMs
#                                          (4 task groups), prefetch on/off, sync, resident (CONTEXTS)
#   scripts/device/offload.sh graphs OUT   offloaded steps as CUDA graphs: the identity checks of `check` and
#                                          `batch`, then (only if all passed) `bound` over CONTEXTS
#   scripts/device/offload.sh longctas OUT forecast + prefetch at 127K B16 with the copy kernel on 8/16/24
#                                          whole SMs (does the 32K/64K fetch table hold at 127K?)
#   scripts/device/offload.sh groups OUT   task groups per copy CTA (SPARDA_FETCH_GROUPS 1, 2, 4) with the
#                                          copy kernel on 4 and 8 whole SMs, prefetch on and off, fetch
#                                          timed alone (BATCH, default 16; CONTEXT, 64K), one traced run
#   scripts/device/offload.sh smallbatch OUT  checks (gpu-check kernels + sample, e2e, tiny offload identity), then
#                                          the small-batch decode step of this binary against the one at BASE
#                                          (default .device/base/sparda), ROUNDS (2) alternating rounds: B 1 4K dense
#                                          (pieces, layer-GEMM ceiling), B 4 4K sparse, B 16 32K sparse; then
#                                          this binary's B 1 4K dense step on the fused GEMVs (SPARDA_GEMV=1);
#                                          write under run_phases.sh (about 20 files)
#   scripts/device/offload.sh ctas OUT     SM fetch kernel under prefetch: 16 vs 8 persistent CTAs vs 264
#                                          short CTAs behind a high-priority compute stream (BATCH, CONTEXT)
set -euo pipefail
phase=${1:?phase}
out=${2:?out dir}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=.device/bin/sparda
tok=.device/bin/tokenizer.json
book=data/texts/hamlet.txt
# For the ncu phases: the Nsight Compute binary ($ncu) and the B=1 4K dense bench it profiles ($nargs)
ncu_b1_setup() {
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  nargs=(bench --model synth:nosa-8b --attention dense --batch 1 --context 4K --steps 2 --warmup 2
    --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json /tmp/ncu_bench.json)
}
case "$phase" in
check)
  $bin gpu-check --json "$out/gpu_check.json" 2>&1 | tail -25 || true
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 2048 --fetch sm,dma,split:8:50 --json "$out/offload_tiny.json" 2>&1 | tail -6 || true
  $bin offload-check --model synth:tiny:6 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 40 --new-tokens 1024 --fetch sm --offload-layer0 --json "$out/offload_tiny_short.json" 2>&1 | tail -4 || true
  # the fetch table's configuration at B 8 (copy CTAs on whole SMs) under
  # forecast prefetch on NOSA-8B: GEMMs sized for fewer SMs once broke the
  # bitwise equality with GPU-resident decode from step 8 (about 45 s)
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 4096 \
    --batch 8 --new-tokens 40 --forecast synth:1 --prefetch on --fetch auto \
    --json "$out/offload_nosa8b_b8_table.json" 2>&1 | tail -3 || true
  if [ -d /tmp/smol ]; then
    $bin offload-check --model /tmp/smol --prompt-file "$book" --prompt-tokens 6000 --new-tokens 2048 \
      --selection infllmv2 --budget-blocks 64 --fetch sm,dma,split:8:50 --json "$out/offload_smollm2.json" 2>&1 | tail -6 || true
  fi
  ;;
long)
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 6000 --new-tokens 8192 --fetch sm --json "$out/offload_nosa8b_8k.json" 2>&1 | tail -6 || true
  ;;
bench)
  $bin bench --model synth:nosa-8b --attention sparse --kv gpu,offload --fetch sm,dma,split:8:50 --prefetch-ctas 16 \
    --batch "${BATCH:-16,64}" --context "${CONTEXT:-32K}" --steps "${STEPS:-32}" --fetch-timing-steps 8 \
    --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/bench_offload.json" 2>&1 | tail -30 || true
  ;;
forecast)
  # forecast mode: prefetch on/off/stress token- and logits-identical to resident forecast decode;
  # GPU forecast selections vs the CPU reference (tiny)
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 1000 \
    --new-tokens 2048 --forecast synth:1 --fetch sm,dma,split:8:50 --prefetch on,off --copy-delay-us 30 \
    --cpu-check-steps 300 --json "$out/forecast_tiny.json" 2>&1 | tail -12 || true
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 6000 \
    --new-tokens 2048 --forecast synth:1 --fetch sm --prefetch on,off --copy-delay-us 20 \
    --json "$out/forecast_nosa8b.json" 2>&1 | tail -8 || true
  ;;
fbench)
  $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch "${FETCH:-sm}" --prefetch-ctas 16 \
    --forecast synth:1 --prefetch on,off --batch "${BATCH:-8,32}" --context "${CONTEXT:-32K}" \
    --steps "${STEPS:-32}" --fetch-timing-steps 8 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
    --json "$out/bench_forecast.json" 2>&1 | tail -30 || true
  ;;
bound)
  for cell in ${CONTEXTS:-32K:8,32,64 64K:8,16,32 126K:8,16}; do
    l=${cell%%:*}; b=${cell##*:}
    $bin bench --model synth:nosa-8b --attention sparse --kv gpu,offload --fetch auto \
      --forecast synth:1 --prefetch on,off --batch "$b" --context "$l" --steps "${STEPS:-32}" \
      --fetch-timing-steps 8 --ceiling-reps 5 --profile-reps 0 --tokenizer "$tok" \
      --json "$out/bound_$l.json" 2>&1 | tee "$out/bound_$l.log" \
      | grep --line-buffered -E "P .* C .* bound|sparse " || true
    # the log keeps each case's line when the call's limit cuts the bench
    # (its JSON is written at the end): one context with two batch sizes
    # at 64K takes more than 200 s
  done
  ;;
cache)
  # cache slots: gpu-check's offload group (slot_diff with ages against
  # kv::plan_slots_lru), the tiny identity with cache slots, then the
  # overlap-bound bench with CACHE (default 0,64,192) cache slots per KV head
  SPARDA_CHECK_ONLY=offload,guards $bin gpu-check --json "$out/gpu_check_offload.json" 2>&1 \
    | grep -E "slot_diff|FAILED|passed;" || true
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 1024 --fetch sm --cache-slots 0,8 \
    --json "$out/offload_tiny_cache.json" 2>&1 | tail -4 || true
  for cell in ${CONTEXTS:-64K:16 126K:16}; do
    l=${cell%%:*}; b=${cell##*:}
    $bin bench --model synth:nosa-8b --attention sparse --kv gpu,offload --fetch auto \
      --cache-slots "${CACHE:-0,64,192}" --forecast synth:1 --prefetch on,off --batch "$b" \
      --context "$l" --steps "${STEPS:-32}" --fetch-timing-steps 8 --ceiling-reps 0 --profile-reps 0 \
      --tokenizer "$tok" --json "$out/cache_$l.json" 2>&1 | tee "$out/cache_$l.log" \
      | grep --line-buffered -E "P .* C .* bound|sparse |γ" || true
  done
  ;;
reserve)
  # forecast + prefetch with the GEMMs sized for all SMs vs for the SMs the copy
  # kernel leaves (--reserve-fetch-sms), alternating, at the cells of the overlap gap
  for r in 1 2; do
    for rs in off on; do
      flag=(); [[ $rs == on ]] && flag=(--reserve-fetch-sms)
      $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm:4,sm:8,sm:16 \
        --forecast synth:1 --prefetch on --sync off --batch "${BATCH:-8,16}" --context "${CONTEXT:-32K}" \
        --steps "${STEPS:-32}" --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
        "${flag[@]}" --json "$out/bench_reserve_fetch_sms_${rs}_$r.json" 2>&1 | grep -E "sparse|skip" || true
    done
  done
  ;;
wholesm)
  # where the prefetch step's compute time goes when the copy kernel shares SMs with it:
  # copy CTAs on shared SMs vs on whole SMs (compute blocks elsewhere), ± GEMMs sized to match
  for r in 1 2; do
    for v in shared whole whole_reserve; do
      flag=()
      [[ $v == whole* ]] && flag+=(--fetch-whole-sms)
      [[ $v == whole_reserve ]] && flag+=(--reserve-fetch-sms)
      $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm:8,sm:16 \
        --forecast synth:1 --prefetch on --sync off --batch "${BATCH:-16}" --context "${CONTEXT:-32K,64K}" \
        --steps "${STEPS:-32}" --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
        "${flag[@]}" --json "$out/bench_fetch_sms_${v}_$r.json" 2>&1 | grep -E "sparse|skip" || true
    done
  done
  ;;
diagnose)
  for v in shared whole whole_reserve huge; do
    flag=(); envs=()
    [[ $v == whole* ]] && flag+=(--fetch-whole-sms)
    [[ $v == whole_reserve ]] && flag+=(--reserve-fetch-sms)
    [[ $v == huge ]] && envs+=(SPARDA_HOST_PAGES=huge)
    env "${envs[@]}" $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch "${FETCH:-sm:16}" \
      --forecast synth:1 --prefetch on --sync off --batch "${BATCH:-16}" --context "${CONTEXT:-32K}" \
      --steps 16 --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" "${flag[@]}" \
      --trace "$out/trace_diagnose_$v.json" --trace-steps 4 --cta-timeline --json "$out/bench_diagnose_$v.json" 2>&1 \
      | grep -E "sparse|skip|pinned|CTA timeline" || true
    $bin trace summarize "$out/trace_diagnose_$v.json" > "$out/trace_diagnose_${v}_summary.txt" 2>&1 || true
    echo "--- $v"; grep -A8 "beside a fetch" "$out/trace_diagnose_${v}_summary.txt" || true
  done
  ;;
balanced)
  # the balanced cell (64K B 16: fetch ≈ compute), where the prefetched step is 1.25x
  # max(P, C) and the fetch beside compute takes 12.2 ms against 9.7 alone: per-CTA
  # timelines of the copy kernel on 8 and 16 whole SMs with prefetch on and off (is the
  # copy late to start, or slower while it runs?), and one trace each with prefetch
  for f in sm:8 sm:16; do
    n=${f//:/_}
    $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch "$f" --fetch-whole-sms \
      --forecast synth:1 --prefetch on,off --sync off --batch "${BATCH:-16}" --context "${CONTEXT:-64K}" \
      --steps 16 --fetch-timing-steps 8 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --cta-timeline \
      --trace "$out/trace_balanced_$n.json" --trace-steps 4 --json "$out/bench_balanced_$n.json" 2>&1 \
      | grep -E "sparse|skip|CTA timeline" || true
    $bin trace summarize "$out/trace_balanced_$n.json" > "$out/trace_balanced_${n}_summary.txt" 2>&1 || true
    gzip -f "$out/trace_balanced_$n.json"
  done
  ;;
groups)
  # does one whole-SM copy CTA with several 256-thread task groups (more chunks in flight)
  # fetch faster than one group, so that fewer SMs leave the compute reach the PCIe ceiling?
  for g in 1 2 4; do
    SPARDA_FETCH_GROUPS=$g $bin bench --model synth:nosa-8b --attention sparse --kv offload \
      --fetch sm:4,sm:8 --fetch-whole-sms --forecast synth:1 --prefetch on,off --sync on \
      --batch "${BATCH:-16}" --context "${CONTEXT:-64K}" --steps 16 --fetch-timing-steps 8 \
      --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/bench_groups_$g.json" 2>&1 \
      | grep -E "sparse|skip|fetch" | sed "s/^/groups $g: /" || true
  done
  SPARDA_FETCH_GROUPS=4 $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm:8 \
    --fetch-whole-sms --forecast synth:1 --prefetch on --sync off --batch "${BATCH:-16}" \
    --context "${CONTEXT:-64K}" --steps 16 --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 \
    --tokenizer "$tok" --cta-timeline --trace "$out/trace_groups_4.json" --trace-steps 4 \
    --json "$out/bench_groups_4_traced.json" 2>&1 | grep -E "sparse|skip|CTA timeline" || true
  $bin trace summarize "$out/trace_groups_4.json" > "$out/trace_groups_4_summary.txt" 2>&1 || true
  gzip -f "$out/trace_groups_4.json"
  ;;
engines)
  # the beside-a-fetch table per fetch engine: copy engines (no SMs), SM kernel on 8 whole SMs,
  # and the split (half the misses each way) with whole SMs; one traced prefetch run each
  for f in dma sm:8 split:8:50; do
    n=${f//:/_}
    $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch "$f" --fetch-whole-sms \
      --forecast synth:1 --prefetch on --sync off --batch "${BATCH:-16}" --context "${CONTEXT:-32K}" \
      --steps 16 --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
      --trace "$out/trace_engine_$n.json" --trace-steps 4 --json "$out/bench_engine_$n.json" 2>&1 \
      | grep -E "sparse|skip" || true
    $bin trace summarize "$out/trace_engine_$n.json" > "$out/trace_engine_${n}_summary.txt" 2>&1 || true
    echo "--- $f"; grep -A8 "beside a fetch" "$out/trace_engine_${n}_summary.txt" || true
  done
  ;;
wholeab)
  # sync, forecast without prefetch and forecast + prefetch at each cell, copy CTAs sharing SMs
  # vs holding whole SMs with GEMMs sized for the rest, alternating over two rounds (FETCH, sm:8)
  for r in 1 2; do
    for v in shared whole_reserve; do
      flag=()
      [[ $v == whole_reserve ]] && flag+=(--fetch-whole-sms --reserve-fetch-sms)
      $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch "${FETCH:-sm:8}" \
        --forecast synth:1 --prefetch on,off --batch "${BATCH:-16}" --context "${CONTEXT:-32K,64K}" \
        --steps "${STEPS:-32}" --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
        "${flag[@]}" --json "$out/bench_wholeab_${v}_$r.json" 2>&1 | grep -E "sparse|skip|bound|speedup" || true
    done
  done
  ;;
hostpages)
  for r in 1 2; do
    for hp in driver huge; do
      SPARDA_HOST_PAGES=$hp $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm:8,sm:16 \
        --forecast synth:1 --prefetch on --batch "${BATCH:-16}" --context "${CONTEXT:-32K,64K}" \
        --steps "${STEPS:-32}" --fetch-timing-steps 0 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
        --json "$out/bench_host_pages_${hp}_$r.json" 2>&1 | grep -E "sparse|skip|pinned" || true
    done
  done
  ;;
batch)
  # offloaded decode of a batch of different-length sequences (roll-overs and
  # write-backs at different steps) against GPU-resident decode, bit for bit
  $bin offload-check --model synth:tiny:7 --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 900 \
    --batch 8 --new-tokens 1024 --fetch sm,dma,split:8:50 --json "$out/offload_tiny_batch8.json" 2>&1 | tail -4 || true
  $bin offload-check --model synth:tiny:8 --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 900 \
    --batch 4 --new-tokens 1024 --fetch sm --forecast synth:3 --prefetch on,off --copy-delay-us 30 \
    --json "$out/forecast_tiny_batch4.json" 2>&1 | tail -5 || true
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 5000 \
    --batch 4 --new-tokens 512 --fetch sm --forecast synth:1 --prefetch on,off \
    --json "$out/forecast_nosa8b_batch4.json" 2>&1 | tail -5 || true
  ;;
traces)
  # two example traces (sync NOSA fetch vs forecast + prefetch), their
  # summaries and the tracing overhead, B=16 L=32K synthetic NOSA-8B
  common=(--model synth:nosa-8b --attention sparse --kv offload --fetch auto --batch 16 --context 32K
          --steps 8 --fetch-timing-steps 4 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --trace-steps 4)
  $bin bench "${common[@]}" --trace "$out/trace_sync.json" --json "$out/trace_sync_bench.json" 2>&1 | tail -4 || true
  $bin bench "${common[@]}" --forecast synth:1 --prefetch on --sync off \
    --trace "$out/trace_prefetch.json" --json "$out/trace_prefetch_bench.json" 2>&1 | tail -4 || true
  for t in sync prefetch; do
    $bin trace summarize "$out/trace_$t.json" > "$out/trace_${t}_summary.txt" 2>&1 || true
    $bin trace summarize --json "$out/trace_$t.json" > "$out/trace_${t}_summary.json" 2>&1 || true
    head -20 "$out/trace_${t}_summary.txt"
  done
  ls -la "$out"
  ;;
priority)
  # copy stream at the greatest priority (default) vs the default priority, forecast + prefetch
  for pr in 1 0; do
    SPARDA_COPY_PRIORITY=$pr $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch auto \
      --forecast synth:1 --prefetch on,off --batch 16 --context 64K --steps 16 --fetch-timing-steps 4 \
      --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/bench_priority_$pr.json" 2>&1 | tail -3 || true
  done
  ;;
eb)
  # every mode side by side under the equivalent-batch protocol (runtime.md §5)
  $bin bench --model synth:nosa-8b --equivalent-batch 128 --context 16K --kv offload --forecast synth:1 \
    --steps 16 --fetch-timing-steps 4 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
    --json "$out/bench_eb128_16k.json" 2>&1 | tail -10 || true
  $bin bench --model synth:nosa-8b --equivalent-batch 32 --context 64K --kv offload --forecast synth:1 \
    --steps 16 --fetch-timing-steps 4 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
    --json "$out/bench_eb32_64k.json" 2>&1 | tail -10 || true
  ;;
dmaprefetch)
  # copy engines vs SM kernel as the fetch engine under prefetch
  $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm,dma,split:8:50 --forecast synth:1 \
    --prefetch on --batch 32 --context 64K --steps 16 --fetch-timing-steps 4 --ceiling-reps 0 \
    --profile-reps 0 --tokenizer "$tok" --json "$out/bench_dma_prefetch.json" 2>&1 | tail -12 || true
  ;;
b1)
  # GPU-resident decode: the B=1 4K dense step against the split-K cap (64 one-tile
  # splits by default at 4K: 512 CTAs, more than one wave at 3 per SM; about 90 s)
  b1run() {  # name, then env assignments
    local name=$1; shift
    env "$@" $bin bench --model synth:nosa-8b --attention dense,sparse --batch 1 --context 4K --steps 64 \
      --tokenizer "$tok" --json "$out/bench_b1_$name.json" 2>&1 | tail -3 || true
  }
  b1run default
  b1run splits32 SPARDA_ATTN_MAX_SPLITS=32
  b1run splits16 SPARDA_ATTN_MAX_SPLITS=16
  ;;
ncu)
  # Nsight Compute (clocks left alone) on the GPU-resident B=1 4K dense decode step: every
  # kernel of the decode steps with its duration, DRAM bytes, grid and registers (ncu runs the
  # kernels one at a time, PDL overlap included out), then one attention-partials and one
  # combine launch in detail (about 2 min)
  ncu_b1_setup
  sel='regex:rmsnorm|qkv_rope|attn_|swiglu|argmax|embed|gemv|gemm|nvjet|cutlass|Kernel'
  "$ncu" --clock-control none -k "$sel" --launch-count 1200 --csv --log-file "$out/ncu_b1_4k_kernels.csv" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread \
    $bin "${nargs[@]}" > "$out/ncu_b1_4k_run.log" 2>&1 || true
  tail -3 "$out/ncu_b1_4k_run.log"
  for k in attn_partial attn_combine; do
    "$ncu" --clock-control none --set detailed -k "$k" --launch-skip 40 -c 1 --log-file "$out/ncu_detail_$k.txt" \
      $bin "${nargs[@]}" > /dev/null 2>&1 || true
    grep -E "Duration|Registers|Grid Size|Block Size|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Throughput|Waves Per SM" "$out/ncu_detail_$k.txt" | head -12
  done
  ;;
ncu-attn)
  # where the B=1 4K decode attention waits: one attn_partial and one attn_combine launch with
  # Nsight Compute's full set (warp stall reasons per SASS instruction, from the saved reports),
  # then attn_partial's duration with 1, 2 and 4 tiles per CTA (SPARDA_ATTN_MAX_SPLITS 128/33/17);
  # writes 10 files: run it under run_phases.sh, which packs them (8 files come back per call)
  ncu_b1_setup
  for k in attn_partial attn_combine; do
    "$ncu" --clock-control none --set full --import-source no -k "$k" --launch-skip 40 -c 1 -o "$out/$k" \
      $bin "${nargs[@]}" > /dev/null 2>&1 || true
    "$ncu" --import "$out/$k.ncu-rep" --page details --print-details all > "$out/${k}_full.txt" 2>&1 || true
    "$ncu" --import "$out/$k.ncu-rep" --page source --print-source sass --csv > "$out/${k}_sass.csv" 2>&1 || true
    grep -E "Duration|Warp Cycles Per Issued|Stall|stall" "$out/${k}_full.txt" | head -20
  done
  for cap in 128 33 17; do
    SPARDA_ATTN_MAX_SPLITS=$cap "$ncu" --clock-control none -k attn_partial --launch-skip 40 -c 8 \
      --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file "$out/attn_partial_cap$cap.csv" \
      $bin "${nargs[@]}" > /dev/null 2>&1 || true
    echo "cap $cap: $(grep -c duration "$out/attn_partial_cap$cap.csv") launches"
  done
  ;;
pdl)
  # programmatic dependent launch (cuda/launch.rs): the end-to-end check against
  # the CPU reference and the offload identity (GPU-resident steps launch with
  # PDL, offloaded ones without: the tokens and logits must still be equal bit
  # for bit), then the GPU-resident step with SPARDA_PDL=0 vs on, two
  # alternating rounds: B 1 at 4K (dense, sparse) and B 16 at 32K (sparse)
  $bin gpu-check-e2e --json "$out/gpu_check_e2e.json" 2>&1 | tail -4 || true
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 1024 --fetch sm,dma --json "$out/offload_tiny.json" 2>&1 | tail -4 || true
  $bin offload-check --model synth:nosa-8b --tokenizer "$tok" --prompt-file "$book" --prompt-tokens 4096 \
    --batch 8 --new-tokens 40 --forecast synth:1 --prefetch on --fetch auto \
    --json "$out/offload_nosa8b_b8_table.json" 2>&1 | tail -3 || true
  for r in 1 2; do
    for p in 0 1; do
      SPARDA_PDL=$p $bin bench --model synth:nosa-8b --attention dense,sparse --batch 1 --context 4K \
        --steps 64 --tokenizer "$tok" --json "$out/bench_b1_4k_pdl${p}_$r.json" 2>&1 | grep -E "dense |sparse |ceiling" || true
      SPARDA_PDL=$p $bin bench --model synth:nosa-8b --attention sparse --batch 16 --context 32K \
        --steps 32 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
        --json "$out/bench_b16_32k_pdl${p}_$r.json" 2>&1 | grep -E "sparse " || true
    done
  done
  ;;
gemv)
  # the fused small-batch GEMVs (kernels/gemv.cu; on by default for B 1): gpu-check's
  # kernel group (gemv in every mode against the CPU reference), the end-to-end
  # check and the tiny offload identity with the defaults, then the B 1 4K dense
  # step, ROUNDS (2) alternating rounds of: the binary at BASE (default .device/base/sparda,
  # if there), this one's default (balanced grid), the grid
  # capped at one warp per row pair (SPARDA_GEMV_GRID=cap, the earlier grid), the
  # balanced grid on one block per SM, and cuBLAS + separate norms (SPARDA_GEMV=0);
  # then B 4 4K sparse (cuBLAS either way: the default takes one row). GEMV_CASES (a
  # list of base balanced alt cap one_per_sm warps4 cublas down_cublas splits64 splits32 splits16;
  # down_cublas: the down projection as one cuBLAS GEMM into the residual (SPARDA_GEMV_DOWN=cublas,
  # after an end-to-end check with it); alt:
  # the binary at ALT, default .device/alt/sparda, if there) picks the cases of each round;
  # warps4 runs blocks of 4 warps (SPARDA_GEMV_WARPS=4, after a gpu-check of the kernel
  # group with it); splitsN caps dense attention at N splits (SPARDA_ATTN_MAX_SPLITS).
  # GEMV_OPTS ("name=NVRTC options;name=options…", e.g. "unroll8=-DGEMV_UNROLL=8"): one more
  # case per entry each round, this binary with those SPARDA_NVRTC_OPTIONS, after a gpu-check
  # of the kernel group under them; an entry without "name=" stops the phase. Errors (NVRTC's
  # among them) are printed, not filtered out
  SPARDA_CHECK_ONLY=kernels $bin gpu-check --json "$out/gpu_check_kernels.json" 2>&1 \
    | grep -E "^gemv|FAIL|passed" || true
  alt=${ALT:-.device/alt/sparda}
  cases=" ${GEMV_CASES:-base balanced cap one_per_sm cublas} "
  want() { [[ $cases == *" $1 "* ]]; }
  if want warps4; then
    echo "gpu-check kernels, SPARDA_GEMV_WARPS=4"
    SPARDA_GEMV_WARPS=4 SPARDA_CHECK_ONLY=kernels $bin gpu-check \
      --json "$out/gpu_check_kernels_warps4.json" 2>&1 | grep -E "^ *gemv |FAIL|cases,|rror" || true
  fi
  IFS=';' read -r -a opt_cases <<<"${GEMV_OPTS:-}"
  for i in "${!opt_cases[@]}"; do
    oc=$(echo "${opt_cases[$i]}" | sed 's/^ *//; s/ *= */=/')
    opt_cases[i]=$oc
    [ -n "$oc" ] || continue
    if [[ $oc != *=* || ! ${oc%%=*} =~ ^[A-Za-z0-9_]+$ ]]; then
      echo "offload.sh gemv: GEMV_OPTS entry '$oc' is not name=options (name: letters, digits, _)" >&2
      exit 2
    fi
    echo "gpu-check kernels, SPARDA_NVRTC_OPTIONS=${oc#*=}"
    SPARDA_NVRTC_OPTIONS="${oc#*=}" SPARDA_CHECK_ONLY=kernels $bin gpu-check \
      --json "$out/gpu_check_kernels_${oc%%=*}.json" 2>&1 | grep -E "^ *gemv |FAIL|cases,|rror" || true
  done
  $bin gpu-check-e2e --json "$out/gpu_check_e2e.json" 2>&1 | tail -4 || true
  if want down_cublas; then
    echo "gpu-check-e2e, SPARDA_GEMV_DOWN=cublas"
    SPARDA_GEMV_DOWN=cublas $bin gpu-check-e2e --json "$out/gpu_check_e2e_down_cublas.json" 2>&1 | tail -4 || true
  fi
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 1024 --fetch sm --json "$out/offload_tiny.json" 2>&1 | tail -3 || true
  base=${BASE:-.device/base/sparda}
  gb() {  # name, binary, then env assignments
    local name=$1 b=$2; shift 2
    env "$@" "$b" bench --model synth:nosa-8b --attention dense --batch 1 --context 4K \
      --steps 64 --tokenizer "$tok" --json "$out/b1_4k_dense_$name.json" 2>&1 \
      | grep -E "^dense |ceiling|rror" | head -3 || true
  }
  for r in $(seq 1 "${ROUNDS:-2}"); do
    echo "round $r"
    if want base && [ -x "$base" ]; then gb "base_$r" "$base" SPARDA_GEMV=1; fi
    if want balanced; then gb "balanced_$r" "$bin" SPARDA_GEMV=1; fi
    if want alt && [ -x "$alt" ]; then gb "alt_$r" "$alt" SPARDA_GEMV=1; fi
    if want cap; then gb "cap_$r" "$bin" SPARDA_GEMV=1 SPARDA_GEMV_GRID=cap; fi
    if want warps4; then gb "warps4_$r" "$bin" SPARDA_GEMV=1 SPARDA_GEMV_WARPS=4; fi
    if want one_per_sm; then gb "balanced_1_per_sm_$r" "$bin" SPARDA_GEMV=1 SPARDA_GEMV_BLOCKS_PER_SM=1; fi
    if want cublas; then gb "cublas_$r" "$bin" SPARDA_GEMV=0; fi
    if want down_cublas; then gb "down_cublas_$r" "$bin" SPARDA_GEMV=1 SPARDA_GEMV_DOWN=cublas; fi
    for oc in "${opt_cases[@]}"; do
      [ -n "$oc" ] && gb "opt_${oc%%=*}_$r" "$bin" SPARDA_GEMV=1 SPARDA_NVRTC_OPTIONS="${oc#*=}"
    done
    for sp in 64 32 16; do  # dense attention in at most sp splits (wider splits, fewer CTAs)
      if want "splits$sp"; then gb "splits${sp}_$r" "$bin" SPARDA_GEMV=1 SPARDA_ATTN_MAX_SPLITS=$sp; fi
    done
  done
  for g in 0 1; do
    SPARDA_GEMV=$g $bin bench --model synth:nosa-8b --attention sparse --batch 4 --context 4K \
      --steps 32 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
      --json "$out/b4_4k_sparse_gemv$g.json" 2>&1 | grep -E "sparse " || true
  done
  ;;
smallbatch)
  base=${BASE:-.device/base/sparda}
  SPARDA_CHECK_ONLY=kernels,sample $bin gpu-check --json "$out/gpu_check_kernels_sample.json" 2>&1 \
    | grep -E "FAIL|passed|failed" | head -20 || true
  $bin gpu-check-e2e --json "$out/gpu_check_e2e.json" 2>&1 | tail -4 || true
  $bin offload-check --model synth:tiny:5 --tokenizer "$tok" --prompt-file "$book" \
    --prompt-tokens 1000 --new-tokens 1024 --fetch sm --json "$out/offload_tiny.json" 2>&1 | tail -3 || true
  sb() {  # name, binary, then env assignments
    local name=$1 b=$2; shift 2
    env "$@" "$b" bench --model synth:nosa-8b --attention dense --batch 1 --context 4K --steps 64 \
      --tokenizer "$tok" --json "$out/b1_4k_dense_$name.json" 2>&1 | grep -E "^dense |ceiling" | head -3 || true
    env "$@" "$b" bench --model synth:nosa-8b --attention sparse --batch 4 --context 4K --steps 32 \
      --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/b4_4k_sparse_$name.json" 2>&1 | grep -E "^sparse " || true
    env "$@" "$b" bench --model synth:nosa-8b --attention sparse --batch 16 --context 32K --steps 32 \
      --prefill synthetic --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
      --json "$out/b16_32k_sparse_$name.json" 2>&1 | grep -E "^sparse " || true
  }
  for r in $(seq 1 "${ROUNDS:-2}"); do
    echo "round $r: base"; sb "base_$r" "$base"
    echo "round $r: this binary"; sb "new_$r" "$bin"
  done
  echo "this binary, fused GEMVs"
  SPARDA_GEMV=1 $bin bench --model synth:nosa-8b --attention dense --batch 1 --context 4K --steps 64 \
    --tokenizer "$tok" --json "$out/b1_4k_dense_new_gemv.json" 2>&1 | grep -E "^dense |ceiling" | head -3 || true
  ;;
cachectas)
  # cache slots with fewer copy CTAs: the pool's hits cut the fetched bytes, so fewer whole SMs
  # may reach the same fetch time and leave more SMs to compute. Forecast + prefetch (and
  # without prefetch, for the bound) with the copy kernel on 8, 12 and 16 whole SMs (4 task
  # groups each) and 0 and 192 cache slots, GPU-resident beside them, at CONTEXTS (default 64K:16)
  for cell in ${CONTEXTS:-64K:16}; do
    l=${cell%%:*}; b=${cell##*:}
    SPARDA_FETCH_GROUPS=4 $bin bench --model synth:nosa-8b --attention sparse --kv gpu,offload \
      --fetch sm:8,sm:12,sm:16 --fetch-whole-sms --cache-slots "${CACHE:-0,192}" --forecast synth:1 \
      --prefetch on,off --sync on --batch "$b" --context "$l" --steps "${STEPS:-32}" --fetch-timing-steps 8 \
      --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/cache_ctas_$l.json" 2>&1 \
      | tee "$out/cache_ctas_$l.log" | grep --line-buffered -E "P .* C .* bound|^sparse " || true
  done
  ;;
graphs)
  # offloaded steps as CUDA graphs: identity first (tiny sm/dma/split, layer 0
  # offloaded, a batch of 8 different lengths (write-backs at different steps,
  # the write-back graph), forecast prefetch on/off/delayed, a forecast batch
  # of 4); the bound cells only when every check passed. CONTEXTS as `bound`
  # (default the cells not yet measured with graphs); about 140 s of checks, then about 2 min per batch size
  "$0" check "$out" > "$out/graphs_identity.log" 2>&1 || true
  "$0" batch "$out" >> "$out/graphs_identity.log" 2>&1 || true
  grep -E "IDENTICAL|DIFFERENT|no decode step replayed|passed|failed|steps from a CUDA graph" "$out/graphs_identity.log" | cut -c1-220
  if grep -qE "DIFFERENT|no decode step replayed|FAILED" "$out/graphs_identity.log"; then
    echo "graphs: an identity check failed; no timing"; exit 0
  fi
  CONTEXTS=${CONTEXTS:-32K:32 64K:8,16} "$0" bound "$out"
  ;;
longctas)
  # Whether the fetch table, swept at 32K and 64K, holds at 127K: forecast +
  # prefetch with the copy kernel on whole SMs at 8 (the table's B16 choice),
  # 16 and 24 CTAs, GEMMs sized for the SMs left, B16 (the 128K EB16 cell)
  $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm:8,sm:16,sm:24 \
    --fetch-whole-sms --reserve-fetch-sms --forecast synth:1 --prefetch on --sync off \
    --batch "${BATCH:-16}" --context "${CONTEXT:-127K}" --steps "${STEPS:-32}" --fetch-timing-steps 8 \
    --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" --json "$out/bench_long_ctas.json" 2>&1 \
    | tee "$out/bench_long_ctas.log" | grep --line-buffered -E "sparse |skip" || true
  # more than 120 s (weights, the 127K fill, three configurations): give its call room
  ;;
ctas)
  # Forecast + prefetch: the persistent fetch kernel holds SMs that a wave of
  # GEMM/attention CTAs then waits for. Fewer persistent CTAs, and many short
  # fetch CTAs behind a higher-priority compute stream, against 16 CTAs.
  run_ctas() {  # name, CTAs, then env assignments
    local name=$1 n=$2; shift 2
    env "$@" $bin bench --model synth:nosa-8b --attention sparse --kv offload --fetch sm --prefetch-ctas "$n" \
      --forecast synth:1 --prefetch on,off --batch "${BATCH:-16,32}" --context "${CONTEXT:-64K}" --steps 16 \
      --fetch-timing-steps 4 --ceiling-reps 0 --profile-reps 0 --tokenizer "$tok" \
      --json "$out/bench_ctas_$name.json" 2>&1 | tail -4 || true
  }
  run_ctas 16 16
  run_ctas 8 8
  run_ctas short264 264 SPARDA_COMPUTE_PRIORITY=high SPARDA_COPY_PRIORITY=0
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
