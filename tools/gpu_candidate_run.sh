#!/usr/bin/env bash
# A short GPU call: a candidate copy of fdlib (folder given) tested for 8-bit correctness and timed beside the tree
# on one shape (B=8, L=131072, 32:8, D=128; bf16 q; bf16, e4m3 and int8 per-head caches).
#   bash tools/gpu_candidate_run.sh OUTDIR CANDIDATE_DIR
set -uo pipefail
OUT=${1:?output folder}; CAND=${2:?candidate folder}
export PYTHONUNBUFFERED=1
R="$OUT/cand"; mkdir -p "$R"; pack() { tar czf "$OUT/cand.tgz" -C "$OUT" cand; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
ROOT=$PWD   # `python -m` puts the working folder first on sys.path: run the candidate from inside its folder
(cd "$CAND" && python -c "import fdlib; print('candidate:', fdlib.__file__)" && timeout 70 python -m pytest \
  "$ROOT/tests/test_quant_range.py" -x -q -p no:cacheprovider 2>&1 | tail -2) | tee "$R/candidate-tests.txt"; pack
G="--dtype bfloat16 --methods auto --B 8 --L 131072 --heads 32:8 --D 128 --warmup 5 --rep 20 --graph-rep 5 --no-plot
   --no-progress --no-ceiling --out $R"
for kv in float8_e4m3fn int8; do
  (cd "$CAND" && timeout 30 python -m fdlib.bench $G --kv-dtype $kv --kv-scale head --name candidate-kv8-$kv-head \
    2>&1 | grep "131072" | head -1); pack
done
timeout 30 python -m fdlib.bench $G --name tree-bf16 2>&1 | grep "131072" | head -1; pack
