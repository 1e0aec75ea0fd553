#!/usr/bin/env bash
# Interleaved A/B of the speculative step (bench/train_ab.sh): N pairs of
# `strata train` runs, the step after backward (strata.speculative_step
# false, A, the reference) then the speculative step (true, B). OVERRIDES
# (JSON) is merged into the config first. "B/A: blocking + wait" is the
# speculative step's blocking part against the step after backward's.
#   bench/train_speculation_ab.sh [pairs=5] [config=configs/demo.json] [overrides={}]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "$ROOT/bench/train_ab.sh" strata.speculative_step false true "$@"
