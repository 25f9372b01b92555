#!/usr/bin/env bash
# The library's tests compiled on the GPU (no interpreter), file by file, in one call of at most about 9 minutes:
# the kernels' tests first, then the plan, the caches, fdlib.hf, the checks and the graders of the kernel labs. Each
# file's pytest output (-rfE, short tracebacks) goes to OUTDIR/suite/FILE.txt and one line a file to
# OUTDIR/suite/summary.txt; a file is not started once BUDGET seconds (default 500) have passed. Packs
# OUTDIR/suite.tgz after each file.
#   bash tools/gpu_suite.sh OUTDIR [BUDGET]
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}; BUDGET=${2:-500}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" suite
FILES="test_streamk test_device_lengths test_kernels test_paged test_qlen test_invariance test_plan test_persistent
  test_balanced test_worklist test_edges test_nan_safety test_numerics test_quant test_quant_range test_replay
  test_unified_max test_unified_max_entry test_longest_first test_pack test_validation test_hf test_hf_kv8
  test_hf_padding test_hf_positions test_gpu test_timeline test_balance_choice test_interpreter_masks
  test_online_softmax test_reference test_runtime test_calibration test_readbound test_live test_compile_contract
  test_graders_lab05 test_graders_lab06 test_graders_lab07 test_graders_lab08 test_graders_lab09 test_graders_lab10"
t0=$SECONDS
for f in $FILES; do
  left=$((BUDGET - (SECONDS - t0)))
  if (( left < 20 )); then echo "$f: not started (budget)" >> "$R/summary.txt"; continue; fi
  timeout $((left < 150 ? left : 150)) python -m pytest -p no:cacheprovider -q -rfE --tb=short "tests/$f.py" \
    > "$R/$f.txt" 2>&1
  rc=$?; echo "$f: rc=$rc $(grep -E '(passed|failed|error|skipped|no tests ran)' "$R/$f.txt" | tail -1)" \
    | tee -a "$R/summary.txt"; pack
done
