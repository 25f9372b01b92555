#!/usr/bin/env bash
# The persistent kernel's own regime (equal short rows, many of them: where fdlib.splits.choose_kernel takes it),
# absent from tools/gpu_kernel_grid.sh's grid: auto, the unified kernel, the persistent kernel and stream-K from
# host lengths on a contiguous cache. About 2 minutes. Packs OUTDIR/pgrid.tgz.
#   bash tools/gpu_persistent_grid.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" pgrid
timeout 150 python tools/ab_ragged.py "$R/ab-persistent-grid.json" --methods "auto,unified,persistent,streamk" \
  --cases "64:32:8:constant:512:0,128:32:8:constant:512:0,256:32:8:constant:1024:0,64:32:32:constant:2048:0,128:32:32:constant:1024:0,64:32:8:constant:4096:0" \
  2>&1 | grep -v Warn > "$R/ab-persistent-grid.log"; tail -30 "$R/ab-persistent-grid.log"; pack
