#!/usr/bin/env bash
# Issue 50's open checks on the GPU, in one call of about 9 minutes per cache layout:
#   tests     (STAGES has "tests") the work list's, the default call's and the timeline tests on compiled kernels
#   sanitize  (STAGES has "sanitize") compute-sanitizer memcheck and racecheck on tools/sanitize_worklist.py (the
#             work list's grid sized by the batch) and tools/sanitize_case.py (stream-K, every other path)
#   ragged    the --ragged protocol (bf16; B 8/32/128, 32:8 and 32:32, constant/uniform/Zipf of mean 1k/8k/32k)
#             on the cache of PAGE keys a page (0: contiguous): auto from host lengths, the default call with
#             device lengths, and a graph captured before the lengths are known (fdlib.bench.ragged.PROTOCOLS)
# Packs OUTDIR/dev<PAGE>.tgz after each stage.
#   STAGES=tests,sanitize bash tools/gpu_device_ragged.sh OUTDIR PAGE
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}; PAGE=${2:?page size, 0 for a contiguous cache}; STAGES=${STAGES:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" "dev$PAGE"
if [[ $STAGES == *tests* ]]; then
  timeout 140 python -m pytest tests/test_worklist.py tests/test_device_lengths.py tests/test_plan.py -k \
    "worklist or device or timeline or captured or fewer" -q -rs -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1
  echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
fi
if [[ $STAGES == *sanitize* ]]; then
  sanitize worklist 50 sanitize-worklist
  sanitize case 50 sanitize-case
fi
timeout 330 python -m fdlib.bench --ragged --dtype bfloat16 --methods auto,default,captured --page-size "$PAGE" \
  --warmup 10 --rep 30 --graph-rep 10 --no-progress --out "$R" --name ragged > "$R/ragged.log" 2>&1
echo "bench rc=$?" >> "$R/ragged.log"; sed -n '/auto without host lengths/,$p' "$R/ragged.log"; pack
