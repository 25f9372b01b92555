#!/usr/bin/env bash
# Stream-K's whole pieces on rows of equal length (fdlib.kernels.streamk.active_shares, ALIGN_IDLE) measured in
# one call of about 6 minutes: its GPU tests; compute-sanitizer memcheck and racecheck on tools/sanitize_case.py
# (equal rows included); auto from host lengths against stream-K planned without them with the rule on and off
# (tools/ab_ragged.py: auto, auto+device, auto+device+ALIGN_IDLE=0) on equal and short rows, contiguous and pages
# of 16; the dense grid against cuDNN with device lengths (tools/gpu_default_run.sh's dense stage).
# Packs OUTDIR/align.tgz after each stage.
#   bash tools/gpu_streamk_align.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" align
timeout 120 python -m pytest tests/test_streamk.py tests/test_device_lengths.py -q -rs -p no:cacheprovider \
  > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
sanitize case 60 sanitize-case
CASES=""
for page in 0 16; do
  for c in 4:32:8:constant:8192 4:32:8:constant:32768 8:32:8:constant:1024 8:32:8:constant:8192 \
           16:32:8:constant:8192 16:32:8:constant:32768 32:32:8:constant:1024 32:32:8:constant:4096 \
           128:32:8:constant:1024 8:32:32:constant:1024 8:32:8:uniform:1024 32:32:8:uniform:1024; do
    CASES="$CASES${CASES:+,}$c:$page"
  done
done
timeout 200 python tools/ab_ragged.py "$R/ab-align.json" --methods "auto,auto+device,auto+device+ALIGN_IDLE=0" \
  --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-align.log"; tail -2 "$R/ab-align.log"; pack
timeout 60 python -m fdlib.bench --dtype bfloat16 --methods auto,cudnn --B 1,4,16 --L 8192,32768 \
  --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" --name dense \
  > "$R/dense.log" 2>&1; sed -n '/time \/ cuDNN/,/Relative/p' "$R/dense.log"; pack
