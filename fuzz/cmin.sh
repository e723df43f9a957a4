#!/usr/bin/env bash
# Minimizes TARGET's corpus: afl-cmin over the committed corpus plus afl's
# queue from fuzz/run.sh (fuzz/out/TARGET/default/queue/) keeps the smallest
# set of inputs that covers every path seen, and replaces fuzz/corpus/TARGET/
# with it (files renamed to their content hash, so reruns are stable).
#
#   fuzz/cmin.sh TARGET
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/cmin.sh TARGET}
[ -x "target/release/$target" ] || nice -n 19 cargo afl build --release --bin "$target"
all=$(mktemp -d)
min=$(mktemp -d)
trap 'rm -rf "$all" "$min"' EXIT
cp "corpus/$target"/* "$all"/
if [ -d "out/$target/default/queue" ]; then
    find "out/$target/default/queue" -maxdepth 1 -type f -exec cp {} "$all"/ \;
fi
AFL_SKIP_CPUFREQ=1 nice -n 19 cargo afl cmin -i "$all" -o "$min" -t 5000 -m 4096 -- "target/release/$target" >/dev/null
rm -rf "corpus/$target"
mkdir -p "corpus/$target"
for f in "$min"/*; do
    cp "$f" "corpus/$target/$(sha1sum "$f" | cut -c1-16)"
done
echo "$target: $(ls "$all" | wc -l) inputs -> $(ls "corpus/$target" | wc -l) in fuzz/corpus/$target ($(du -sh "corpus/$target" | cut -f1))"
