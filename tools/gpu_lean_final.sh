#!/usr/bin/env bash
# The tree with stream-K's lean loop, in one call of about 9 minutes: first its GPU tests (a share inside one row
# against float64: pages, several query tokens, 8-bit; the default call's tests) and compute-sanitizer memcheck on
# tools/sanitize_case.py; then, as tools/gpu_streamk_final.sh measured the tree before it, the --ragged protocol
# without host lengths on pages of 16 and contiguous (auto from host lengths, the default call, a graph captured
# before the lengths), auto against stream-K planned without lengths on the equal-row batches Lab 06 cites, and the
# serving batches with batch_invariant=True beside the default call. Packs OUTDIR/fin.tgz, dev16.tgz, dev0.tgz.
#   bash tools/gpu_lean_final.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" fin
timeout 110 python -m pytest tests/test_streamk.py -k "inside_one_row or equal_rows" tests/test_device_lengths.py -q \
  -rs -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
sanitize case 100 sanitize-case memcheck
bash tools/gpu_device_ragged.sh "$OUT" 16
bash tools/gpu_device_ragged.sh "$OUT" 0
timeout 60 python tools/ab_ragged.py "$R/ab-equal-rows.json" --methods auto,streamk+device --cases \
  4:32:8:constant:8192:0,16:32:8:constant:8192:0,8:32:8:constant:32768:0,32:32:8:constant:4096:0,32:32:8:constant:32768:0,128:32:8:constant:1024:0,32:32:8:constant:8192:16 \
  2>&1 | grep -v Warn > "$R/ab-equal-rows.log"; tail -2 "$R/ab-equal-rows.log"; pack
timeout 140 python -m fdlib.bench --serving --methods invariant --warmup 10 --rep 30 --graph-rep 10 --budget-s 120 \
  --out "$R" --name serving > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving.log" | head -20
rm -f "$R"/*.err; pack
