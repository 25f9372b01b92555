#!/usr/bin/env bash
# batch_invariant=True's schedule at one, two and three waves of programs (fdlib.plan.INVARIANT_WAVES, set by
# FDLIB_INVARIANT_WAVES at import; the bits do not depend on it), in one call of about 8 minutes: the serving
# batches, then the dense shapes of rows fewer than the SMs (B 1/4/16, 32:8, 8192 and 32768 keys, auto against
# invariant), each at W = 1, 2, 3. Packs OUTDIR/waves.tgz after each stage.
#   bash tools/gpu_invariant_waves.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" waves
invariant_at FDLIB_INVARIANT_WAVES w 1 2 3
dense_invariant_at FDLIB_INVARIANT_WAVES w 1,4,16 8192,32768 1 2 3
rm -f "$R"/*.err; pack
