#!/usr/bin/env bash
# One call of about 9 minutes (at most 10): the illegal memory access two A/Bs of tools/ab_constants.py met on an H100
# (results/h100/chooser-ab/constants/rules.log, rules2.log, cost.log): the same A/Bs with each case named before it
# runs and CUDA_LAUNCH_BLOCKING=1, so the log's last case is the one that faulted; then compute-sanitizer memcheck
# on the D=256 batches over pages and the two-stage ones (tools/interp_memcheck.py's suspects) one process each.
# Files in OUTDIR/fault/ (packed into OUTDIR/fault.tgz after each stage).
#   bash tools/gpu_probe_fault.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" fault
# the D=256 batches as GPU tests against float64 (-v: each test named before it runs; a fault ends the process)
CUDA_LAUNCH_BLOCKING=1 timeout 120 python -m pytest tests/test_gpu.py -k head_dim_256 -v -p no:cacheprovider \
  > "$R/tests-d256.txt" 2>&1; echo "rc=$?" >> "$R/tests-d256.txt"; tail -4 "$R/tests-d256.txt"; pack
command -v compute-sanitizer >/dev/null && for c in "--D 256 --page 16 --B 8 --heads 16:4 --L 8192 --splits 5" \
    "--D 256 --page 16 --B 8 --heads 16:2 --L 8192 --splits 8" "--D 256 --page 0 --B 1 --heads 16:2 --L 65536 --splits 80"; do
  timeout 80 compute-sanitizer --tool memcheck python tools/interp_memcheck.py --gpu $c >> "$R/memcheck.txt" 2>&1
  echo "rc=$? for $c" >> "$R/memcheck.txt"; tail -3 "$R/memcheck.txt"; pack
done
ab() {   # ab NAME ARGS...: one A/B, each batch named before it runs
  local name=$1; shift
  CUDA_LAUNCH_BLOCKING=1 timeout 110 python tools/ab_constants.py "$R/$name.json" --max-cases 40 --kinds heads "$@" \
    > "$R/$name.log" 2>&1; echo "rc=$?" >> "$R/$name.log"; grep -B1 -A2 "rror" "$R/$name.log" | head; pack
}
ab paged --set PAGED_EPILOGUE_WORK=10000                  # all its 22 batches: the fault was at the last
ab second --set SECOND_PROGRAM=0.0 --match D=256          # the fault was among these, by its place in the list
