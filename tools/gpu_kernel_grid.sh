#!/usr/bin/env bash
# The default's GPU tests through fdlib.hf (DecodeCache plans carry no host lengths: stream-K for B >= 2), then
# every kernel behind auto forced on one grid of ragged and equal-row batches from host lengths (tools/ab_ragged.py:
# unified, two-stage, persistent, balanced, stream-K and auto's pick), contiguous and pages of 16: which kernel wins
# where, and by how much (the chooser's grid). About 6 minutes. Packs OUTDIR/grid.tgz.
#   bash tools/gpu_kernel_grid.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" grid
timeout 150 python -m pytest tests/test_hf.py -m gpu -q -rs -p no:cacheprovider > "$R/gpu-tests-hf.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests-hf.txt"; tail -3 "$R/gpu-tests-hf.txt"; pack
CASES=$(kernel_grid_cases)
timeout 330 python tools/ab_ragged.py "$R/ab-kernel-grid.json" \
  --methods "auto,unified,split,persistent,balanced,streamk" --cases "$CASES" \
  2>&1 | grep -v Warn > "$R/ab-kernel-grid.log"; tail -3 "$R/ab-kernel-grid.log"; pack
