#!/usr/bin/env bash
# One GPU call for 8-bit KV caches (Lab 09): correctness on the GPU, the probe of the 8-bit loop, and the dense grid
# of auto over bf16, e4m3 and int8 caches (the files fdlib.course.measured's lab09 view reads). With a second
# argument, a copy of fdlib under that folder (a candidate kernel) is tested and timed beside it, in the same call.
#   bash tools/gpu_kv8_run.sh OUTDIR [CANDIDATE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}; CAND=${2:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT/kv8"
provenance "$OUT/kv8/gpu.txt"
timeout 60 python -m pytest tests/test_quant_range.py -q -p no:cacheprovider 2>&1 | tail -2 | tee "$OUT/kv8/gpu-tests-kv8.txt"
if [ -n "$CAND" ]; then
  ROOT=$PWD   # `python -m` puts the working folder first on sys.path: run the candidate from inside its folder
  (cd "$CAND" && timeout 140 python -m pytest "$ROOT/tests/test_quant_range.py" "$ROOT/tests/test_quant.py" -x -q \
    -p no:cacheprovider 2>&1 | tail -3) | tee "$OUT/kv8/gpu-tests-kv8-candidate.txt"
fi
timeout 100 python tools/kv8_probe.py --out "$OUT/kv8" 2>&1 | grep -v Warn | tee "$OUT/kv8/kv8-probe.log"
G="--dtype bfloat16 --methods auto --B 1,8,32 --L 4096,16384,65536,131072 --heads 32:8 --D 128 --max-kv-gb 9
   --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out $OUT/kv8"
timeout 60 python -m fdlib.bench $G --name kv16-bf16 2>&1 | grep -v Warn | tail -14
for kv in float8_e4m3fn int8; do for s in head token; do
  timeout 50 python -m fdlib.bench $G --kv-dtype $kv --kv-scale $s --name kv8-$kv-$s 2>&1 | grep -v Warn | tail -14
done
  [ -n "$CAND" ] && (cd "$CAND" && timeout 50 python -m fdlib.bench $G --kv-dtype $kv --kv-scale head \
    --name candidate-kv8-$kv-head 2>&1 | grep -v Warn | tail -14)
done
ls "$OUT/kv8"; tar czf "$OUT/kv8.tgz" -C "$OUT" kv8 && rm -rf "$OUT/kv8"
