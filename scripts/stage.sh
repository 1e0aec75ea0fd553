# Sourced by scripts/test.sh and scripts/check_platform.sh: `stage NAME` ends
# the current stage (if any), printing its elapsed time, and starts the one
# named NAME (`stage ""` ends the last). STAGE_PREFIX, if set, goes before
# each line's "stage" ("[trixie] ").
STAGE_NAME=""
STAGE_START=0
stage() {
  if [ -n "$STAGE_NAME" ]; then
    echo "== ${STAGE_PREFIX:-}stage done: $STAGE_NAME ($((SECONDS - STAGE_START)) s; $SECONDS s in all)"
  fi
  STAGE_NAME="$1"
  STAGE_START=$SECONDS
  [ -z "$STAGE_NAME" ] || echo "== ${STAGE_PREFIX:-}stage: $STAGE_NAME"
}
