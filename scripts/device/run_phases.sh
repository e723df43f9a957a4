#!/usr/bin/env bash
# Runs several scripts/device/offload.sh phases in one device call, each under
# its own time limit, and packs everything they wrote into one archive (the
# device tool brings back at most 8 files per call):
#   scripts/device/run_phases.sh OUT SECONDS PHASE [PHASE ...]
# e.g. scripts/device/run_phases.sh "$OUT" 200 traces ctas
# Env as for offload.sh (BATCH, CONTEXT, FETCH, ...). SPARDA_COMMIT should
# name the commit the binary was built from (it goes into every report).
set -uo pipefail
out=${1:?out dir}; limit=${2:?seconds per phase}; shift 2
work="$out/results"
mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$work/gpu.txt"
for phase in "$@"; do
  echo "=== $phase (limit ${limit}s)"
  start=$(date +%s)
  timeout "$limit" bash "$(dirname "$0")/offload.sh" "$phase" "$work" 2>&1 | tee "$work/log_$phase.txt" | tail -40
  echo "=== $phase: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
done
tar czf "$out/results.tar.gz" -C "$out" results && rm -rf "$work"
ls -la "$out"
