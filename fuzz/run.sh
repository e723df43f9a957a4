#!/usr/bin/env bash
# Builds the fuzz targets with cargo-afl (stable Rust) and fuzzes one target
# for SECONDS (default 600), starting from its committed corpus
# fuzz/corpus/TARGET/; afl's findings go to fuzz/out/TARGET/ (not committed;
# a second run resumes there). Extra arguments go to afl-fuzz.
#
#   fuzz/run.sh TARGET [SECONDS] [afl-fuzz args...]
#   fuzz/run.sh list                       # the targets
#
# Needs cargo-afl: `cargo install cargo-afl` (AFL++ is built on first use,
# or by `cargo afl config --build`; needs make and a C compiler).
# Crashes land in fuzz/out/TARGET/default/crashes/, hangs in .../hangs/;
# replay one with: fuzz/target/release/TARGET < FILE.
set -euo pipefail
cd "$(dirname "$0")"
targets=$(ls src/bin | sed 's/\.rs$//')
target=${1:?usage: fuzz/run.sh TARGET [SECONDS] [afl-fuzz args...]; targets: $(echo $targets)}
if [ "$target" = list ]; then
    echo "$targets"
    exit 0
fi
echo "$targets" | grep -qx "$target" || { echo "unknown target $target; targets: $(echo $targets)" >&2; exit 2; }
secs=${2:-600}
shift $(( $# < 2 ? $# : 2 ))
command -v cargo-afl >/dev/null || { echo "cargo-afl is missing: cargo install cargo-afl" >&2; exit 2; }
nice -n 19 cargo afl build --release --bin "$target"
mkdir -p "out"
# -t: 2 s per input before afl calls it a hang (the machine is shared);
# -m: 4 GB of address space, so that a runaway allocation is a crash.
# afl's status lines go to fuzz/out/TARGET.log; its figures to
# fuzz/out/TARGET/default/fuzzer_stats, summarized at the end.
echo "fuzzing $target for $secs s (log: fuzz/out/$target.log)"
rc=0
AFL_SKIP_CPUFREQ=1 AFL_AUTORESUME=1 AFL_NO_UI=1 \
    nice -n 19 timeout $((secs + 120)) \
    cargo afl fuzz -i "corpus/$target" -o "out/$target" -V "$secs" -t 2000 -m 4096 "$@" \
    "target/release/$target" > "out/$target.log" 2>&1 || rc=$?
stats="out/$target/default/fuzzer_stats"
if [ -f "$stats" ]; then
    grep -E '^(start_time|last_update|run_time|execs_done|execs_per_sec|corpus_count|bitmap_cvg|saved_crashes|saved_hangs) ' "$stats"
fi
exit $rc
