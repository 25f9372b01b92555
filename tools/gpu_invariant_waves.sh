#!/usr/bin/env bash
# batch_invariant=True's schedule at one, two and three waves of programs (fdlib.plan.INVARIANT_WAVES, set by
# FDLIB_INVARIANT_WAVES at import; the bits do not depend on it), in one call of about 8 minutes: the serving
# batches (python -m fdlib.bench --serving --methods invariant: the host plan, the default call, the captured graph
# and the invariant plan), then the dense shapes of rows fewer than the SMs (B 1/4/16, 32:8, 8192 and 32768 keys,
# auto against invariant), each at W = 1, 2, 3. Packs OUTDIR/waves.tgz after each stage.
#   bash tools/gpu_invariant_waves.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" waves
for W in 1 2 3; do
  FDLIB_INVARIANT_WAVES=$W timeout 130 python -m fdlib.bench --serving --methods invariant --warmup 10 --rep 30 \
    --graph-rep 10 --budget-s 110 --out "$R" --name "serving-w$W" > "$R/serving-w$W.log" 2> "$R/serving-w$W.err"
  echo "bench rc=$?" >> "$R/serving-w$W.log"; grep -E "^\| [0-9]" "$R/serving-w$W.log" | head -14 | cut -c1-40,130-; pack
done
for W in 1 2 3; do
  FDLIB_INVARIANT_WAVES=$W timeout 40 python -m fdlib.bench --dtype bfloat16 --methods auto,invariant --B 1,4,16 \
    --L 8192,32768 --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" \
    --name "dense-w$W" > "$R/dense-w$W.log" 2>&1
  sed -n '/time \/ cuDNN\|Effective bandwidth/,/Relative/p' "$R/dense-w$W.log" | head -12; pack
done
rm -f "$R"/*.err; pack
