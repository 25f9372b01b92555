#!/usr/bin/env bash
# The work list measured against issue 50's targets in one call (about 8 minutes): its GPU tests; the serving
# batches (python -m fdlib.bench --serving: the host-lengths plan, today's default call and captured graph, the
# work list called and captured, batch-invariant plans); a dense grid against cuDNN (auto as called with device
# lengths, the work list); ab_ragged's budget sweep (WORK_WAVES); compute-sanitizer memcheck and racecheck.
# Packs OUTDIR/fin.tgz after each stage.
#   bash tools/gpu_worklist_final.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FDLIB_DEVICE_SCHEDULE=0
start_run "$OUT" fin
timeout 100 python -m pytest tests/test_worklist.py -q -rs -x -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
timeout 230 python -m fdlib.bench --serving --methods worklist,worklist@captured,worklist+invariant,invariant \
  --warmup 10 --rep 30 --graph-rep 10 --budget-s 200 --out "$R" --name serving > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving.log" | head -40; pack
timeout 70 python -m fdlib.bench --dtype bfloat16 --methods auto,worklist,cudnn --B 1,8,32 --L 4096,32768 \
  --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" --name dense \
  2>&1 | grep -v Warn | tail -12; pack
timeout 60 python tools/ab_ragged.py "$R/ab-waves.json" --methods "worklist,worklist+WORK_WAVES=1,worklist+WORK_WAVES=4" \
  --cases "32:32:8:uniform:16384:16,8:32:8:onelong:131072:16,128:32:8:zipf:2048:16,256:32:8:uniform:1024:16,32:32:8:constant:8192:0" \
  2>&1 | grep -v Warn | tail -16; pack
sanitize worklist 45 sanitize
