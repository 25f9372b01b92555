#!/usr/bin/env bash
# Stream-K with its lean loop against the kernels behind auto, every batch planned from its host lengths, in one
# call of about 7 minutes: the 24 batches of results/h100/kernel-grid/ (B 8/32/128, 32:8 and 32:32, constant,
# uniform and Zipf-like lengths of mean 1024-32768, contiguous and pages of 16) with auto, the unified kernel,
# stream-K, and stream-K planned without lengths (what decode_attention runs with device lengths); then the
# persistent kernel's regime (equal rows of 512-4096 keys, B 64-256, contiguous: 662 to 10592 keys a program, where
# fdlib.splits.choose_kernel's limit, set on H200 runs, is 65536). Packs OUTDIR/sgrid.tgz.
#   bash tools/gpu_streamk_grid.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" sgrid
CASES=$(kernel_grid_cases)
timeout 300 python tools/ab_ragged.py "$R/ab-grid.json" --methods "auto,unified,streamk,streamk+device" \
  --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-grid.log"; tail -3 "$R/ab-grid.log"; pack
timeout 120 python tools/ab_ragged.py "$R/ab-persistent.json" --methods "auto,unified,persistent,streamk" \
  --cases "64:32:8:constant:512:0,128:32:8:constant:512:0,128:32:8:constant:768:0,64:32:8:constant:2048:0,96:32:8:constant:2048:0,256:32:8:constant:1024:0,64:32:32:constant:2048:0,128:32:32:constant:1024:0,64:32:8:constant:4096:0" \
  2>&1 | grep -v Warn > "$R/ab-persistent.log"; tail -3 "$R/ab-persistent.log"; pack
