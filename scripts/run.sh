#!/usr/bin/env bash
# The main job: install what is missing, build, show the machine as Strata
# sees it, then train the example model with its states offloaded to NVMe
# (configs/demo.json: on the GPU if there is one, else on the host device with
# a 26 MiB HBM budget; the swap files go under the build tree).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${STRATA_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/setup.sh"
STRATA="$BUILD_DIR/apps/strata/strata"
mkdir -p "$BUILD_DIR/run"
"$STRATA" info --path "$BUILD_DIR/run"
"$STRATA" train --config "$ROOT/configs/demo.json" --nvme-path "$BUILD_DIR/run/nvme" --plot "$BUILD_DIR/run/plots"
