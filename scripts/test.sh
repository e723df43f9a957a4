#!/usr/bin/env bash
# The test command: builds the SmolLM2 real-weights fixture if it is not
# cached yet (scripts/fixture.sh), then runs every CPU test in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fixture.sh
cargo test --release "$@"
