#!/usr/bin/env bash
# Stream-K planned without host lengths on the unified kernel's 128-key tiles against its own 64-key ones, where
# the default call pays on equal long rows (1.07x cuDNN at B=16 32:8, 8192 and 32768 keys). About 3 minutes.
#   bash tools/gpu_streamk_tiles.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" skt
timeout 230 python tools/ab_ragged.py "$R/ab-streamk-tiles.json" \
  --methods "auto,streamk+device,streamk@128x4x3+device,streamk@128x4x2+device" \
  --cases "16:32:8:constant:8192:0,16:32:8:constant:32768:0,4:32:8:constant:8192:0,32:32:8:constant:4096:0,32:32:8:constant:8192:16,32:32:8:uniform:16384:0,32:32:8:uniform:16384:16,128:32:8:zipf:2048:0,128:32:8:zipf:2048:16,256:32:8:uniform:1024:0" \
  2>&1 | grep -v Warn | tee "$R/ab-streamk-tiles.log"; pack
