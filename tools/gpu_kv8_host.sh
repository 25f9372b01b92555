#!/usr/bin/env bash
# One call of about 3 minutes: an 8-bit cache with host lengths, on equal rows.
# 1. the tests of the batch-invariant kernel (the device share now on by default where the host rule gives every
#    row one program), compiled (tools/gpu_suite.sh, SUITE_S seconds, default 60);
# 2. tools/ab_ragged.py on equal rows (B 4-32 32:8, contiguous and pages of 16) of 8-bit formats (FORMATS, default
#    "float8_e4m3fn:tensor float8_e4m3fn:head"; int8 per token's equal rows are in results/h200/invariant-share/):
#    auto (host lengths: stream-K for an 8-bit cache of B >= 2) against the unified and stream-K kernels, each
#    planned from the host lengths.
# Packs OUTDIR/suite.tgz, then OUTDIR/kv8host.tgz after each format.
#   bash tools/gpu_kv8_host.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FILES="test_invariance" bash "$(dirname "$0")/gpu_suite.sh" "$OUT" ${SUITE_S:-60} 14
start_run "$OUT" kv8host
CASES=4:32:8:constant:32768:0,16:32:8:constant:2048:0,8:32:8:constant:8192:16,32:32:8:constant:8192:16
for fmt in ${FORMATS:-"float8_e4m3fn:tensor" "float8_e4m3fn:head"}; do
  set -- ${fmt/:/ }
  timeout 50 python tools/ab_ragged.py "$R/ab-$1-$2.json" --kv-dtype "$1" --kv-scale "$2" \
    --methods auto,unified,streamk --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-$1-$2.log"
  tail -4 "$R/ab-$1-$2.log"; pack
done
