#!/usr/bin/env bash
# One call of about 8 minutes: first the library's tests that only a GPU ran red (tools/gpu_suite.sh on fdlib.hf,
# the 8-bit cache, unified-max, torch.compile, the persistent choice, the edges, stream-K, and the 8-bit checks
# changed since), with their tracebacks;
# then whether an 8-bit cache without host lengths may take stream-K as a 16-bit one does
# (fdlib.plan.device_schedule_suits keeps 8-bit caches on the plan for L_cap: never timed): tools/ab_ragged.py on
# ragged batches, contiguous and pages of 16, e4m3 per token and int8 per head, methods auto (host lengths),
# auto+device (what the default call runs today) and streamk+device (stream-K planned without lengths).
# Packs OUTDIR/suite.tgz and OUTDIR/kv8dev.tgz.
#   bash tools/gpu_kv8_device.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FILES="test_hf test_hf_kv8 test_unified_max test_compile_contract test_gpu test_edges test_streamk test_quant test_quant_range test_validation" \
  bash "$(dirname "$0")/gpu_suite.sh" "$OUT" 200 14
start_run "$OUT" kv8dev
CASES=8:32:8:zipf:32768:0,32:32:8:uniform:8192:0,128:32:8:zipf:1024:0,8:32:8:zipf:32768:16,32:32:8:uniform:8192:16,128:32:8:zipf:1024:16
for fmt in "float8_e4m3fn token" "int8 head"; do
  set -- $fmt
  timeout 110 python tools/ab_ragged.py "$R/ab-$1-$2.json" --kv-dtype "$1" --kv-scale "$2" \
    --methods auto,auto+device,streamk+device --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-$1-$2.log"
  tail -3 "$R/ab-$1-$2.log"; pack
done
