#!/usr/bin/env bash
# One call of about 8 minutes after the batch-invariant kernel read its table rows one tile ahead over pages of
# 8 keys or more (fdlib.kernels.tile.attend_tile_ahead), 8-bit caches without host lengths took stream-K and
# invariant rows that outnumber the SMs launch longest first:
# 1. the library's tests that these touch, and those the last GPU run found red, compiled (tools/gpu_suite.sh);
# 2. the serving batches with batch_invariant=True, the invariant kernel and the work list (fdlib.bench --serving
#    --methods invariant,worklist+invariant: the run Lab 07's table reads);
# 3. per-token 8-bit scales with float16 queries (each tile's weights normalised per row) against bfloat16 (the
#    loop without it), one 8-bit grid (fdlib.bench --kv-dtype int8 --kv-scale token), auto (now stream-K without
#    lengths) against the unified kernel planned for the equal rows.
# 4. tools/probe_nan_kv8.py: what an 8-bit cache stores for a token that is not finite.
# Packs OUTDIR/suite.tgz and OUTDIR/pages.tgz.
#   bash tools/gpu_invariant_pages.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FILES="test_hf test_hf_kv8 test_runtime test_unified_max test_gpu test_invariance test_paged" \
  bash "$(dirname "$0")/gpu_suite.sh" "$OUT" 150 14
start_run "$OUT" pages
timeout 170 python -m fdlib.bench --serving --methods invariant,worklist+invariant --warmup 10 --rep 30 \
  --graph-rep 10 --budget-s 150 --out "$R" --name serving-invariant > "$R/serving-invariant.log" 2>&1
echo "bench rc=$?" >> "$R/serving-invariant.log"; grep -E "^\| [0-9]" "$R/serving-invariant.log" | head -14; pack
timeout 90 python -m fdlib.bench --kv-dtype int8 --kv-scale token --dtype float16,bfloat16 --methods auto,unified \
  --B 1,8,32 --L 8192,32768 --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress \
  --out "$R" --name kv8-token-fp16 > "$R/kv8-token-fp16.log" 2>&1
sed -n '/Effective bandwidth/,/Relative/p' "$R/kv8-token-fp16.log" | head -16
python tools/probe_nan_kv8.py > "$R/probe-nan.txt" 2>&1; tail -20 "$R/probe-nan.txt"
rm -f "$R"/*.err; pack
