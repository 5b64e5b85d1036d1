# A device run's parts within a time budget, sourced by examples/two_gpu.sh and examples/gpu_round.sh: each part
# runs under `timeout` (its whole process group), one that fails or runs out is logged and the next one runs, and
# STATUS collects one line a part for the summary. Reads BUDGET (seconds), PARTS (names to run) and DRY (plan only).
T0=$(date +%s)
STATUS=()

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# part NAME LIMIT MIN LOG COMMAND...: run COMMAND under `timeout` for min(LIMIT, time left - 15 s), appending to
# LOG; skipped when fewer than MIN seconds are left. Records "NAME: ok | failed (rc) | TIMED OUT | skipped".
part() {
  local name=$1 limit=$2 min=$3 log=$4; shift 4
  local secs=$(( $(left) - 15 )); [ "$secs" -gt "$limit" ] && secs=$limit
  if [ "$secs" -lt "$min" ]; then
    STATUS+=("$name: skipped (${secs}s left of the budget, needs ${min}s)"); echo "== $name: skipped" | tee -a "$log"
    return 1
  fi
  echo "== $name (limit ${secs}s, at +$(( $(date +%s) - T0 ))s)" | tee -a "$log"
  if [ -n "$DRY" ]; then
    echo "   $*" | tee -a "$log"; STATUS+=("$name: dry run"); return 0
  fi
  local t=$(date +%s) rc
  timeout -k 10 "$secs" "$@" >> "$log" 2>&1; rc=$?
  local took=$(( $(date +%s) - t ))
  case $rc in
    0) STATUS+=("$name: ok (${took}s)") ;;
    124|137) STATUS+=("$name: TIMED OUT after ${took}s (see $(basename "$log"))") ;;
    *) STATUS+=("$name: failed, exit $rc, ${took}s (see $(basename "$log"))") ;;
  esac
  echo "-- $name: exit $rc after ${took}s" | tee -a "$log"
  return $rc
}

want() { [[ " $PARTS " == *" $1 "* ]]; }
