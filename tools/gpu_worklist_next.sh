#!/usr/bin/env bash
# The next GPU call for the work list (about 8 minutes), what this session could not run: the default call as it
# landed (FDLIB_DEVICE_SCHEDULE=1) on the serving batches and a dense grid against cuDNN (tools/gpu_default_run.sh);
# the work list's tiles for batches of many short rows (ab_ragged worklist@NxWxS); the calibration timing the
# unified kernel directly (its test on compiled tiles, then one calibrate()). Packs OUTDIR/next.tgz per stage.
#   bash tools/gpu_worklist_next.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash tools/gpu_default_run.sh "$OUT"
start_run "$OUT" next
timeout 70 python -m pytest tests/test_worklist.py -q -rs -x -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -2 "$R/gpu-tests.txt"; pack
timeout 170 python tools/ab_ragged.py "$R/ab-short-rows.json" \
  --methods "auto,auto+device,worklist,worklist@64x4x3,worklist@64x4x2,worklist@32x4x3" \
  --cases "256:32:8:uniform:1024:0,256:32:8:uniform:1024:16,128:32:8:zipf:2048:0,128:32:8:zipf:2048:16,32:32:8:uniform:16384:0,32:32:8:constant:8192:0" \
  2>&1 | grep -v Warn | tee "$R/ab-short-rows.log"; pack
timeout 60 python -m pytest tests/test_calibration.py -q -rs -p no:cacheprovider > "$R/calibration-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/calibration-tests.txt"; tail -2 "$R/calibration-tests.txt"
timeout 60 python -c "from fdlib import calibration; print(calibration.calibrate(progress=False))" \
  > "$R/calibrate.txt" 2>&1; echo "rc=$?" >> "$R/calibrate.txt"; tail -2 "$R/calibrate.txt"; pack
