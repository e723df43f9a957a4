#!/usr/bin/env bash
# Minimizes TARGET's corpus and replaces fuzz/corpus/TARGET/ with it.
#
#   fuzz/cmin.sh TARGET [MAX_FILES] [MAX_BYTES]     (defaults 200, 5000000)
#
# Inputs: the committed corpus plus afl's queue from fuzz/run.sh
# (fuzz/out/TARGET/default/queue/). afl-showmap records the coverage tuples
# (edge, hit-count bucket) of each input; then, as afl-cmin does, the rarest
# tuple first, each tuple not yet covered brings in the smallest input that
# has it. When that set is over MAX_FILES files or MAX_BYTES bytes, the inputs
# adding the most tuples are kept, up to the limits, and the tuples left out
# are reported. Files are named by their content hash, so reruns are stable.
# (cargo afl cmin, the Python afl-cmin of AFL++, recorded no tuples for
# these persistent-mode targets; afl-showmap does.)
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/cmin.sh TARGET [MAX_FILES] [MAX_BYTES]}
max_files=${2:-200}
max_bytes=${3:-5000000}
[ -d "corpus/$target" ] || { echo "no fuzz/corpus/$target" >&2; exit 2; }
nice -n 19 cargo afl build --release --bin "$target"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/all" "$work/maps"
cp corpus/"$target"/* "$work/all"/
if [ -d "out/$target/default/queue" ]; then
    find "out/$target/default/queue" -maxdepth 1 -type f -name 'id:*' -exec cp {} "$work/all"/ \;
fi
AFL_SKIP_CPUFREQ=1 nice -n 19 cargo afl showmap -i "$work/all" -o "$work/maps" -t 5000 -m 4096 \
    -- "target/release/$target" > "$work/showmap.log" 2>&1 || { tail -5 "$work/showmap.log" >&2; exit 1; }
python3 - "$work/all" "$work/maps" "$work/min" "$max_files" "$max_bytes" "$target" <<'PY'
import hashlib, os, shutil, sys
src, maps, dst, max_files, max_bytes, target = sys.argv[1:7]
max_files, max_bytes = int(max_files), int(max_bytes)
cov, size = {}, {}
for name in os.listdir(maps):
    with open(os.path.join(maps, name)) as f:
        cov[name] = {line.strip() for line in f if line.strip()}
    size[name] = os.path.getsize(os.path.join(src, name))
assert cov, "afl-showmap recorded no input"
count = {}
for t in set().union(*cov.values()):
    count[t] = 0
for s in cov.values():
    for t in s:
        count[t] += 1
by_size = sorted(cov, key=lambda n: (size[n], n))
covered, chosen = set(), []
for t in sorted(count, key=lambda t: (count[t], t)):
    if t in covered:
        continue
    best = next(n for n in by_size if t in cov[n])
    chosen.append(best)
    covered |= cov[best]
total = len(covered)
if len(chosen) > max_files or sum(size[n] for n in chosen) > max_bytes:
    left, kept, covered, used = set(chosen), [], set(), 0
    while left and len(kept) < max_files:
        fits = [n for n in left if used + size[n] <= max_bytes]
        if not fits:
            break
        best = max(fits, key=lambda n: (len(cov[n] - covered), -size[n], n))
        if not cov[best] - covered:
            break
        kept.append(best)
        covered |= cov[best]
        used += size[best]
        left.discard(best)
    chosen = kept
os.makedirs(dst)
for n in chosen:
    data = open(os.path.join(src, n), "rb").read()
    with open(os.path.join(dst, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)
print(f"{target}: {len(cov)} inputs, {total} tuples -> {len(chosen)} files "
      f"({sum(size[n] for n in chosen)} bytes) covering {len(covered)} tuples")
PY
rm -rf "corpus/$target"
mv "$work/min" "corpus/$target"
