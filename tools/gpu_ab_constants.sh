#!/usr/bin/env bash
# One call: the chooser's constants A/B'd on the batches whose auto decision each changes (tools/ab_constants.py),
# one JSON and log per group, packed after each into OUTDIR/constants.tgz.
#   bash tools/gpu_ab_constants.sh OUTDIR [MAX_CASES] [SECONDS_PER_GROUP] [GROUPS]   (groups: e.g. "small rules")
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}; MAX=${2:-10}; SECS=${3:-100}; WANT=" ${4:-small rules more} "
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" constants
group() {   # group NAME --set A=B ...
  local name=$1; shift
  [[ $WANT == *" $name "* ]] || return 0
  timeout "$SECS" python tools/ab_constants.py "$R/$name.json" --max-cases "$MAX" "$@" > "$R/$name.log" 2>&1
  echo "rc=$?" >> "$R/$name.log"; grep -E "^[A-Z_]+=.*\{" "$R/$name.log"; pack
}
group small --set TWO_STAGE_SPLITS=1000000 --set "PERSISTENT_MAX_KEYS={'H200': 0, 'H100': 0}" \
  --set PACK_MIN_BYTES=0 --set ONE_WAVE_MAX_KEYS=0
group rules --set LONGEST_FIRST_IMBALANCE=0.0 --set STREAMK_MAX_MEAN=1000000000000 --set PAGED_EPILOGUE_WORK=10000
group more --set EPILOGUE_WORK=1000000000000 --set STREAMK_PAGED_MIN_TILES=0 --set PACK_MIN_ROWS=1000000
group cost --set SECOND_PROGRAM=0.0 --set SECOND_PROGRAM=1.0
# the rules not settled on the H100 (results/notes/chooser.md): below 3% there, or parameters of a winning rule not
# timed on their own (no wave cap, no wave minimum, equal rows over pages at the ragged rows' tile count)
group next --set TWO_STAGE_SPLITS=1000000 --set STREAMK_MAX_MEAN=1000000000000 --set ONE_WAVE_WAVES=100 \
  --set PERSISTENT_MIN_WAVES=1 --set STREAMK_PAGED_DENSE_TILES=40
