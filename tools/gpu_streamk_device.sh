#!/usr/bin/env bash
# Stream-K made without host lengths: its launch (P = H_kv·P_h programs, every B length read in registers on the
# device) depends on shapes alone, so the plan made without lengths is the host-lengths plan's kernel wherever
# that plan took stream-K. This call times it as the default call and as a graph captured before the lengths are
# known on the serving batches, and against auto (host lengths), the work list and today's default on constant
# and ragged --ragged shapes (the dense penalty a schedule blind to the lengths pays). The work list here
# launches programs for its list's room only (budget + B sized by the batch, not B·S). About 8 minutes.
#   bash tools/gpu_streamk_device.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" skd
# the work-list tests the last call's 70 s did not reach (36 of 43 passed there): the random lists and 8-bit caches
# (all of them: the work list's grid now holds only the list's room, budget + B where sized by the batch)
timeout 150 python -m pytest tests/test_worklist.py -q -rs -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -2 "$R/gpu-tests.txt"; pack
timeout 200 python -m fdlib.bench --serving --methods streamk,streamk@captured --warmup 10 --rep 30 --graph-rep 10 \
  --budget-s 180 --out "$R" --name serving-streamk > "$R/serving-streamk.log" 2> "$R/serving-streamk.err"
echo "bench rc=$?" >> "$R/serving-streamk.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving-streamk.log" | head -30
rm -f "$R"/*.err; pack
timeout 220 python tools/ab_ragged.py "$R/ab-streamk-device.json" \
  --methods "auto,streamk+device,worklist" \
  --cases "4:32:8:constant:8192:0,16:32:8:constant:8192:0,8:32:8:constant:32768:0,32:32:8:constant:4096:0,32:32:8:constant:32768:0,128:32:8:constant:1024:0,256:32:8:uniform:1024:0,128:32:8:zipf:2048:0,32:32:8:constant:8192:16,8:32:8:uniform:1024:0,8:32:8:zipf:8192:0,32:32:32:zipf:1024:0" \
  2>&1 | grep -v Warn | tee "$R/ab-streamk-device.log"; pack
