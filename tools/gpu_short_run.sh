#!/usr/bin/env bash
# The GPU call for a short lease (about 8 minutes): first the GPU tests of what changed (8-bit scales, fdlib.hf's
# padding and 8-bit append, the generate bench), then the 8-bit grid's core (bf16 vs e4m3 and int8 per head),
# then one generate case with its profile, then the 8-bit loop probe. Each stage packs OUTDIR/run.tgz, so what
# finished comes back even if the lease ends mid-call.
#   bash tools/gpu_short_run.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R="$OUT/run"; mkdir -p "$R"
pack() { tar czf "$OUT/run.tgz.tmp" -C "$OUT" run && mv "$OUT/run.tgz.tmp" "$OUT/run.tgz"; }
provenance "$R/gpu.txt"
timeout 170 python -m pytest tests/test_quant_range.py tests/test_hf.py tests/test_hf_padding.py tests/test_hf_kv8.py \
  tests/test_bench_generate.py -q -rs -p no:cacheprovider > "$R/gpu-tests.txt" 2>&1; echo "pytest rc=$?" >> "$R/gpu-tests.txt"
tail -4 "$R/gpu-tests.txt"; pack
G="--dtype bfloat16 --methods auto --B 1,8 --L 16384,131072 --heads 32:8 --D 128 --warmup 10 --rep 30
   --graph-rep 10 --no-plot --no-progress --out $R"
timeout 45 python -m fdlib.bench $G --name kv16-bf16 2>&1 | grep -v Warn | tail -6
for kv in float8_e4m3fn int8; do
  timeout 45 python -m fdlib.bench $G --kv-dtype $kv --kv-scale head --name kv8-$kv-head 2>&1 | grep -v Warn | tail -6
done; pack
timeout 150 python -m fdlib.bench --generate --profile --cases 1:32768 --budget-s 120 --out "$R" --name generate \
  > "$R/generate.log" 2>&1; echo "bench rc=$?" >> "$R/generate.log"; tail -15 "$R/generate.log"; pack
timeout 60 python tools/kv8_probe.py --quick --out "$R" 2>&1 | grep -v Warn | tee "$R/kv8-probe.log"; pack
