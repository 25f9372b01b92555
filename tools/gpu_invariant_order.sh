#!/usr/bin/env bash
# batch_invariant=True with its rows launched longest first (fdlib.plan.INVARIANT_ORDER, FDLIB_INVARIANT_ORDER at
# import; the bits do not change) against b order, in one call of about 5 minutes: the serving batches
# (python -m fdlib.bench --serving --methods invariant) and the dense shapes of B 16/32/64 32:8 (auto against
# invariant), each at order 0 and 1. Packs OUTDIR/order.tgz after each stage.
#   bash tools/gpu_invariant_order.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" order
for O in 0 1; do
  FDLIB_INVARIANT_ORDER=$O timeout 130 python -m fdlib.bench --serving --methods invariant --warmup 10 --rep 30 \
    --graph-rep 10 --budget-s 110 --out "$R" --name "serving-o$O" > "$R/serving-o$O.log" 2> "$R/serving-o$O.err"
  echo "bench rc=$?" >> "$R/serving-o$O.log"; grep -E "^\| [0-9]" "$R/serving-o$O.log" | head -14 | cut -c1-40,130-
  pack
done
for O in 0 1; do
  FDLIB_INVARIANT_ORDER=$O timeout 40 python -m fdlib.bench --dtype bfloat16 --methods auto,invariant --B 16,32,64 \
    --L 4096,16384 --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" \
    --name "dense-o$O" > "$R/dense-o$O.log" 2>&1
  sed -n '/time \/ cuDNN\|Effective bandwidth/,/Relative/p' "$R/dense-o$O.log" | head -12; pack
done
rm -f "$R"/*.err; pack
