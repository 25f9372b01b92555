#!/usr/bin/env bash
# The work list's first GPU call: its GPU tests (and the unified kernel's, which it compiles with WORK), then the
# ragged A/B (tools/ab_ragged.py) of the host-lengths plan (auto), the plan made without lengths (auto+device, what
# decode_attention makes from device lengths) and work-list plans of several S and chunk sizes, over pages of 16
# and contiguous caches, fp16, with the read ceiling measured in the same run. Packs OUTDIR/wl.tgz after each stage.
#   bash tools/gpu_worklist_run.sh OUTDIR [METHODS] [CASES]
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
METHODS=${2:-auto,auto+device,worklist,worklist#32,worklist#64,worklist+WORK_CHUNK_TILES=8,worklist#32+WORK_CHUNK_TILES=8}
CASES=${3:-32:32:8:uniform:16384:16,8:32:8:onelong:131072:16,128:32:8:zipf:2048:16,256:32:8:uniform:1024:16,1:32:8:constant:131072:16,48:64:8:uniform:8192:16,32:32:8:uniform:16384:0,8:32:8:onelong:131072:0,32:32:8:constant:8192:0,1:32:8:constant:8192:0}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" wl
timeout 80 python -m pytest tests/test_worklist.py tests/test_invariance.py tests/test_longest_first.py -q -rs -x \
  -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1; echo "pytest rc=$?" >> "$R/gpu-tests.txt"
tail -4 "$R/gpu-tests.txt"
timeout 45 python -m pytest tests/test_graders_lab06.py tests/test_grader_meta_06_worklist.py tests/test_worklist_view.py -q -rs \
  -p no:cacheprovider > "$R/gpu-tests-lab06.txt" 2>&1; echo "pytest rc=$?" >> "$R/gpu-tests-lab06.txt"
tail -3 "$R/gpu-tests-lab06.txt"; pack
timeout 220 python tools/ab_ragged.py "$R/ab-worklist.json" --methods "$METHODS" --cases "$CASES" 2>&1 \
  | grep -v Warn | tee "$R/ab-worklist.log"; pack
sanitize worklist 60 sanitize ${SANITIZERS:-memcheck}
