#!/usr/bin/env bash
# batch_invariant=True with its rows launched longest first (fdlib.plan.INVARIANT_ORDER, FDLIB_INVARIANT_ORDER at
# import; the bits do not change) against b order, in one call of about 5 minutes: the serving batches and the
# dense shapes of B 16/32/64 32:8, L 4096 and 16384 (auto against invariant), each at order 0 and 1. Packs
# OUTDIR/order.tgz after each stage.
#   bash tools/gpu_invariant_order.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" order
invariant_at FDLIB_INVARIANT_ORDER o 0 1
dense_invariant_at FDLIB_INVARIANT_ORDER o 16,32,64 4096,16384 0 1
rm -f "$R"/*.err; pack
