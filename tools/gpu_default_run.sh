#!/usr/bin/env bash
# The default call as it lands (FDLIB_DEVICE_SCHEDULE=1: auto without host lengths takes the device schedule where
# fdlib.plan.device_schedule_suits): the serving batches (host-lengths plan, default call, captured graph,
# batch-invariant work list) and a dense grid against cuDNN, in one call of about 3 minutes. Packs OUTDIR/def.tgz.
#   bash tools/gpu_default_run.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FDLIB_DEVICE_SCHEDULE=1
start_run "$OUT" def
timeout 120 python -m fdlib.bench --serving --warmup 10 --rep 30 --graph-rep 10 \
  --budget-s 100 --out "$R" --name serving > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving.log" | head -30; pack
timeout 60 python -m fdlib.bench --dtype bfloat16 --methods auto,cudnn --B 1,4,16 --L 8192,32768 \
  --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" --name dense \
  2>&1 | grep -v Warn | sed -n '/time \/ cuDNN/,/Relative/p'; pack
rm -f "$R"/*.err
