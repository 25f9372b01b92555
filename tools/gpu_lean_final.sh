#!/usr/bin/env bash
# The tree with stream-K's lean loop, measured as tools/gpu_streamk_final.sh measured the one before it, in one call
# of about 8 minutes: the --ragged protocol without host lengths on pages of 16 and contiguous (auto from host
# lengths, the default call, a graph captured before the lengths); auto against stream-K planned without lengths on
# the equal-row batches Lab 06 cites; the serving batches with batch_invariant=True beside the default call; then
# fdlib.hf's GPU tests. Packs OUTDIR/dev16.tgz, OUTDIR/dev0.tgz and OUTDIR/fin.tgz.
#   bash tools/gpu_lean_final.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash tools/gpu_device_ragged.sh "$OUT" 16
bash tools/gpu_device_ragged.sh "$OUT" 0
start_run "$OUT" fin
timeout 60 python tools/ab_ragged.py "$R/ab-equal-rows.json" --methods auto,streamk+device --cases \
  4:32:8:constant:8192:0,16:32:8:constant:8192:0,8:32:8:constant:32768:0,32:32:8:constant:4096:0,32:32:8:constant:32768:0,128:32:8:constant:1024:0,32:32:8:constant:8192:16 \
  2>&1 | grep -v Warn > "$R/ab-equal-rows.log"; tail -2 "$R/ab-equal-rows.log"; pack
timeout 140 python -m fdlib.bench --serving --methods invariant --warmup 10 --rep 30 --graph-rep 10 --budget-s 120 \
  --out "$R" --name serving > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving.log" | head -20; pack
timeout 90 python -m pytest tests/test_hf.py -m gpu -q -rs -p no:cacheprovider > "$R/gpu-tests-hf.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests-hf.txt"; tail -3 "$R/gpu-tests-hf.txt"; rm -f "$R"/*.err; pack
