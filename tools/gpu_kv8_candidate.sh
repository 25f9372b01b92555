#!/usr/bin/env bash
# One call of about 3.5 minutes: the candidate 8-bit tile conversion (results/notes/09_kv8_candidate.patch:
# products in fp16 whatever q's dtype, e4m3 by cvt.rn.f16x2.e4m3x2, int8 by the 0x6400 magic number) tested and
# timed beside the tree, on a copy of fdlib patched in a temporary folder:
# 1. the 8-bit tests compiled, run against the candidate (test_quant, test_quant_range, test_hf_kv8; 60 s);
# 2. the dense grid B 8/32 32:8 L 8192/32768, bf16 queries: a bf16 cache (the tree), then e4m3 with scales per head
#    and int8 with scales per token, auto (stream-K with the lengths on the device) and unified, tree then candidate.
# Packs OUTDIR/cand.tgz after each stage.
#   bash tools/gpu_kv8_candidate.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ROOT=$PWD
start_run "$OUT" cand
CAND=$(mktemp -d)
cp -r fdlib "$CAND/" && (cd "$CAND" && patch -p1 -s < "$ROOT/results/notes/09_kv8_candidate.patch") || exit 1
# `python -m` puts the working folder first on sys.path: the candidate runs from inside its folder
(cd "$CAND" && PYTHONPATH=$CAND timeout 60 python -m pytest -n 14 "$ROOT/tests/test_quant.py" \
  "$ROOT/tests/test_quant_range.py" "$ROOT/tests/test_hf_kv8.py" -q -p no:cacheprovider 2>&1 | tail -6) \
  | tee "$R/candidate-tests.txt"
pack
G="--dtype bfloat16 --B 8,32 --L 8192,32768 --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot
   --no-progress --out $R"
timeout 30 python -m fdlib.bench $G --methods auto --name kv16-bf16 2>&1 | grep -v Warn > "$R/kv16-bf16.log"
for fmt in float8_e4m3fn:head int8:token; do
  set -- ${fmt/:/ }
  timeout 35 python -m fdlib.bench $G --methods auto,unified --kv-dtype $1 --kv-scale $2 --name tree-$1-$2 2>&1 \
    | grep -v Warn > "$R/tree-$1-$2.log"
  (cd "$CAND" && PYTHONPATH=$CAND timeout 35 python -m fdlib.bench $G --methods auto,unified --kv-dtype $1 \
    --kv-scale $2 --name cand-$1-$2 2>&1 | grep -v Warn > "$R/cand-$1-$2.log")
  grep -h -A7 "^Time, µs" "$R/tree-$1-$2.md" "$R/cand-$1-$2.md" 2>/dev/null; pack
done
grep -h -A7 "^Time, µs" "$R/kv16-bf16.md"; pack
