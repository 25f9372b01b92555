#!/usr/bin/env bash
# The default call as it lands with stream-K for calls without host lengths (fdlib.plan.device_schedule_suits):
# its tests on the GPU (the captured graph replayed with ragged lengths, contiguous and paged, against float64;
# stream-K's own), then tools/gpu_default_run.sh (the serving batches and the dense grid against cuDNN). About
# 5 minutes. Packs OUTDIR/sk.tgz and OUTDIR/def.tgz.
#   bash tools/gpu_streamk_default.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" sk
timeout 150 python -m pytest tests/test_device_lengths.py tests/test_streamk.py -q -rs -p no:cacheprovider \
  > "$R/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests.txt"; tail -3 "$R/gpu-tests.txt"; pack
bash tools/gpu_default_run.sh "$OUT"
