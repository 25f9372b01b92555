#!/usr/bin/env bash
# One GPU call for the serving targets (balanced without host lengths): the GPU tests of the work list (where
# tests/test_worklist*.py exist) and of the bench's captured protocol, then `python -m fdlib.bench --serving` on the
# seven serving batches, pages of 16 and contiguous: plan_host, default, captured and the METHODS rows, the read
# ceiling measured in the same run. Outputs (logs, serving.json/.md) are packed into OUTDIR/serving.tgz after every
# stage, so what finished comes back even if the call is cut short; the folder goes once the last pack is made.
#   bash tools/gpu_serving_run.sh OUTDIR
# Time on an H100 (estimate, < 8 min in all): the tests at most 90 + 45 s; the bench about 14 batch-caches x 7 rows
# x ~0.6 s of timing plus Triton's compiles, inputs and references (~3 min), guarded by --budget-s (no batch starts
# after it; the ones left are recorded as skipped) and a 320 s timeout (serving.partial.json then holds what ran).
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
# Each may be set in the environment instead (EXTRA=--quick CASES=7 runs the tiny shapes, e.g. on a CPU).
METHODS=${METHODS:-"worklist,worklist+invariant,worklist@captured,invariant"}   # specs NAME[#S][+invariant][@captured]
CASES=${CASES:-"1,2,3,4,5,6,7"}                                                 # the batches to run (1-based)
BUDGET_S=${BUDGET_S:-240}                                                       # no batch starts after this
EXTRA=${EXTRA:-}                                                                # more arguments for the bench
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R="$OUT/serving"; mkdir -p "$R"
pack() { tar czf "$OUT/serving.tgz.tmp" -C "$OUT" serving && mv "$OUT/serving.tgz.tmp" "$OUT/serving.tgz"; }
provenance "$R/gpu.txt"
tests=$(ls tests/test_worklist*.py 2>/dev/null)
if [ -n "$tests" ]; then
  timeout 90 python -m pytest $tests -q -rs -x -p no:cacheprovider > "$R/gpu-tests-worklist.txt" 2>&1
  echo "pytest rc=$?" >> "$R/gpu-tests-worklist.txt"
else
  echo "no tests/test_worklist*.py: skipped" > "$R/gpu-tests-worklist.txt"
fi
tail -4 "$R/gpu-tests-worklist.txt"
timeout 45 python -m pytest tests/test_bench_serving.py -k graph_replays -q -rs -p no:cacheprovider \
  > "$R/gpu-tests-serving.txt" 2>&1; echo "pytest rc=$?" >> "$R/gpu-tests-serving.txt"
tail -3 "$R/gpu-tests-serving.txt"; pack
timeout 320 python -m fdlib.bench --serving --cases "$CASES" --methods "$METHODS" --warmup 10 --rep 40 --graph-rep 20 \
  --budget-s "$BUDGET_S" --out "$R" --name serving $EXTRA > "$R/serving.log" 2> "$R/serving.err"
echo "bench rc=$?" >> "$R/serving.log"
sed -n '/## Summary/,/## Every row/p' "$R/serving.log"; tail -2 "$R/serving.log"
tr '\r' '\n' < "$R/serving.err" | grep -v Warn | tail -4
ls "$R"; pack && rm -rf "$R"
