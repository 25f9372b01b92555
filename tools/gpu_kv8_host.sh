#!/usr/bin/env bash
# One call of about 5 minutes: an 8-bit cache with host lengths, on equal rows.
# 1. the tests of the batch-invariant kernel (the device share now on by default where the host rule gives every
#    row one program) and of the 8-bit caches, compiled (tools/gpu_suite.sh, 100 s);
# 2. tools/ab_ragged.py on equal rows (B 2-64 32:8, contiguous and pages of 16) of three 8-bit formats (e4m3 per
#    tensor and per head, int8 per token): auto (host lengths: stream-K for B >= 2 since device_schedule_suits
#    reads no dtype) against the unified, persistent and stream-K kernels, each planned from the host lengths.
# Packs OUTDIR/suite.tgz, then OUTDIR/kv8host.tgz after each format.
#   bash tools/gpu_kv8_host.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FILES="test_invariance test_quant test_hf_kv8" bash "$(dirname "$0")/gpu_suite.sh" "$OUT" 100 14
start_run "$OUT" kv8host
CASES=2:32:8:constant:8192:0,4:32:8:constant:32768:0,16:32:8:constant:2048:0,8:32:8:constant:8192:16,32:32:8:constant:8192:16,64:32:8:constant:1024:0
for fmt in "float8_e4m3fn tensor" "float8_e4m3fn head" "int8 token"; do
  set -- $fmt
  timeout 70 python tools/ab_ragged.py "$R/ab-$1-$2.json" --kv-dtype "$1" --kv-scale "$2" \
    --methods auto,unified,persistent,streamk --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-$1-$2.log"
  tail -4 "$R/ab-$1-$2.log"; pack
done
