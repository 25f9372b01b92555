#!/usr/bin/env bash
# batch_invariant=True with each row's chunks a program chosen on the device from the lengths where the batch has
# fewer rows than SMs (fdlib.plan.INVARIANT_SHARE, FDLIB_INVARIANT_SHARE at import; the bits do not change) against
# the host's rule, in one call of about 6 minutes (at most 9): first the device share's bitwise and float64 tests on
# the GPU (90 s at most), then the serving batches and the dense shapes of B 1/4/16 32:8, L 8192 and 32768
# (auto against invariant), each at share 0 and 1. Share 2 (the share only for the host rule's one-program-a-row
# plans, SMs/2 < B·H_kv < SMs) runs each batch as 0 or 1 does, so it needs no run of its own. Packs
# OUTDIR/share.tgz after each stage.
#   bash tools/gpu_invariant_share.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" share
timeout 90 python -m pytest tests/test_invariance.py -q -x -k "device_share or kernel_chooses" \
  > "$R/tests.txt" 2>&1; echo "pytest rc=$?" >> "$R/tests.txt"; tail -3 "$R/tests.txt"; pack
invariant_at FDLIB_INVARIANT_SHARE s 0 1
dense_invariant_at FDLIB_INVARIANT_SHARE s 1,4,16 8192,32768 0 1
rm -f "$R"/*.err; pack
