#!/usr/bin/env bash
# One call of about 6 minutes: batch_invariant=True with 64-key tiles (FDLIB_INVARIANT_BLOCK_N=64, the keys the
# stream-K and unified kernels read pages in) against today's 128 (0), on both layouts alike:
# 1. the invariance tests compiled at 64 (tests/test_invariance.py, TESTS_S seconds, default 100);
# 2. the serving batches (python -m fdlib.bench --serving --methods invariant: the host plan, the default call, the
#    captured graph and the invariant plan), at 0 and 64;
# 3. the dense shapes B 1/4/16 32:8, L 8192 and 32768, auto against invariant, at 0 and 64.
# Packs OUTDIR/tile.tgz after each stage.
#   bash tools/gpu_invariant_tile.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" tile
FDLIB_INVARIANT_BLOCK_N=64 timeout ${TESTS_S:-100} python -m pytest tests/test_invariance.py -q -x -n 14 -p no:cacheprovider \
  > "$R/tests-bn64.txt" 2>&1; tail -3 "$R/tests-bn64.txt"; pack
invariant_at FDLIB_INVARIANT_BLOCK_N bn 64 0
dense_invariant_at FDLIB_INVARIANT_BLOCK_N bn 1,4,16 8192,32768 64 0
rm -f "$R"/*.err; pack
