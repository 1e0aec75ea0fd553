#!/usr/bin/env bash
# The main job: install what is missing, build, then show the machine as
# Strata sees it and run a short CPU Adam benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/setup.sh"
STRATA="$BUILD_DIR/apps/strata/strata"
mkdir -p "$BUILD_DIR/run"
"$STRATA" info --path "$BUILD_DIR/run" --config "$ROOT/configs/zero3_nvme_offload.json"
"$STRATA" bench adam --params 20000000 --threads "$(nproc)"
