#!/usr/bin/env bash
# The tree as it lands for issue 50 (stream-K's whole pieces on equal rows, fdlib.hf freeing a dropped cache),
# measured in one call of about 8 minutes: fdlib.hf's GPU tests; the --ragged protocol without host lengths on
# pages of 16 and contiguous (tools/gpu_device_ragged.sh's bench stage: auto from host lengths, the default call,
# a graph captured before the lengths); auto against stream-K planned without lengths on the equal-row batches
# Lab 06 cites (tools/ab_ragged.py); the serving batches; one Llama-3-8B decode step at B=8.
# Packs OUTDIR/dev16.tgz, OUTDIR/dev0.tgz and OUTDIR/fin.tgz.
#   bash tools/gpu_streamk_final.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" fin
timeout 90 python -m pytest tests/test_hf.py -m gpu -q -rs -p no:cacheprovider > "$R/gpu-tests-hf.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests-hf.txt"; tail -3 "$R/gpu-tests-hf.txt"; pack
bash tools/gpu_device_ragged.sh "$OUT" 16
bash tools/gpu_device_ragged.sh "$OUT" 0
timeout 60 python tools/ab_ragged.py "$R/ab-equal-rows.json" --methods auto,streamk+device --cases \
  4:32:8:constant:8192:0,16:32:8:constant:8192:0,8:32:8:constant:32768:0,32:32:8:constant:4096:0,32:32:8:constant:32768:0,128:32:8:constant:1024:0,32:32:8:constant:8192:16 \
  2>&1 | grep -v Warn > "$R/ab-equal-rows.log"; tail -2 "$R/ab-equal-rows.log"; pack
timeout 120 python -m fdlib.bench --serving --warmup 10 --rep 30 --graph-rep 10 --budget-s 100 --out "$R" \
  --name serving > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"; sed -n '/## Summary/,/## Every row/p' "$R/serving.log" | head -20; pack
timeout 80 python -m fdlib.bench --generate --cases 8:32768 --variants hf_dynamic,fdlib_eager,fdlib_graph \
  --budget-s 60 --out "$R" --name generate-b8 > "$R/generate-b8.log" 2>&1
echo "bench rc=$?" >> "$R/generate-b8.log"; grep -E "^\| 8" "$R/generate-b8.log" | cut -c1-150; rm -f "$R"/*.err; pack
