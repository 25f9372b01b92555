#!/usr/bin/env bash
# Stream-K's lean loop (a share inside one row: the unified kernel's loop over one split) measured in one short
# call: auto with device lengths against cuDNN on the dense shapes where it runs stream-K (B 4 and 16, 8192 and
# 32768 keys, 32:8, bf16), then auto from host lengths against stream-K planned without them on equal rows,
# contiguous and pages of 16 (tools/ab_ragged.py); then its GPU tests and compute-sanitizer memcheck and racecheck
# on tools/sanitize_case.py (equal rows of 300 keys: three shares of 44 a head, the lean loop). About 5 minutes.
# Every timed output is checked against float64 by the benches. Packs OUTDIR/lean.tgz after each stage.
#   bash tools/gpu_streamk_lean.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" lean
timeout 50 python -m fdlib.bench --dtype bfloat16 --methods auto,cudnn --B 4,16 --L 8192,32768 --heads 32:8 --D 128 \
  --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" --name dense > "$R/dense.log" 2>&1
sed -n '/time \/ cuDNN/,/Relative/p' "$R/dense.log"; pack
timeout 50 python tools/ab_ragged.py "$R/ab-lean.json" --methods auto,auto+device --cases \
  4:32:8:constant:8192:0,16:32:8:constant:8192:0,32:32:8:constant:1024:0,8:32:8:constant:1024:0,4:32:8:constant:8192:16,16:32:8:constant:8192:16,32:32:8:constant:1024:16,8:32:8:constant:1024:16 \
  2>&1 | grep -v Warn > "$R/ab-lean.log"; tail -18 "$R/ab-lean.log"; pack
timeout 120 python -m pytest tests/test_streamk.py tests/test_device_lengths.py -q -rs -p no:cacheprovider \
  > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
sanitize case 60 sanitize-case
