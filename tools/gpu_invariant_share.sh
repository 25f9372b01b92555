#!/usr/bin/env bash
# One call of about 6 minutes (at most 8):
# 1. the library's tests these changes touch, compiled (tools/gpu_suite.sh, 90 s): fdlib.hf and its 8-bit cache
#    (a token that is not finite kept NaN), the e4m3 NaN conversion, the tests the last GPU run found red, the
#    batch-invariant kernel (its table rows read a tile ahead over pages; the device share, captured and replayed);
# 2. batch_invariant=True with each row's chunks a program chosen on the device from the lengths where the batch
#    has fewer rows than SMs (fdlib.plan.INVARIANT_SHARE, FDLIB_INVARIANT_SHARE at import; the bits do not change)
#    against the host's rule: the serving batches, then the dense shapes of B 1/4/16 32:8, L 8192 and 32768
#    (auto against invariant), each at share 0 and 1. Share 2 (the share only for the host rule's
#    one-program-a-row plans, SMs/2 < B·H_kv < SMs) runs each batch as 0 or 1 does, so it needs no run of its own;
# 3. an 8-bit grid with per-token scales (fdlib.bench --kv-dtype int8 --kv-scale token), float16 queries (each
#    tile's weights normalised per row) against bfloat16 (the loop without it), auto (stream-K without lengths)
#    against the unified kernel planned for the equal rows;
# 4. tools/probe_nan_kv8.py: what an 8-bit cache stores for a token that is not finite.
# Packs OUTDIR/suite.tgz, then OUTDIR/share.tgz after each stage. A shorter call: SUITE_S (the tests' seconds,
# default 90), SERVING_AT (the serving batches' shares, default "0 1"), NO_KV8=1 (without stage 3), NO_DENSE=1 (without the dense shapes of stage 2).
#   bash tools/gpu_invariant_share.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FILES="test_invariance test_hf_kv8 test_runtime test_hf test_gpu test_unified_max test_paged test_plan test_validation" \
  bash "$(dirname "$0")/gpu_suite.sh" "$OUT" ${SUITE_S:-90} 14
start_run "$OUT" share
invariant_at FDLIB_INVARIANT_SHARE s ${SERVING_AT:-0 1}
[ -n "${NO_DENSE:-}" ] || dense_invariant_at FDLIB_INVARIANT_SHARE s 1,4,16 8192,32768 0 1
[ -n "${NO_KV8:-}" ] || timeout 70 python -m fdlib.bench --kv-dtype int8 --kv-scale token --dtype float16,bfloat16 --methods auto,unified \
  --B 8,32 --L 8192,32768 --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress \
  --out "$R" --name kv8-token-fp16 > "$R/kv8-token-fp16.log" 2>&1
[ -n "${NO_KV8:-}" ] || sed -n '/Effective bandwidth/,/Relative/p' "$R/kv8-token-fp16.log" | head -14; pack
python tools/probe_nan_kv8.py > "$R/probe-nan.txt" 2>&1; tail -12 "$R/probe-nan.txt"
rm -f "$R"/*.err; pack
