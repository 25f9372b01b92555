#!/usr/bin/env bash
# One GPU call for Lab 10 (end to end) and the Hugging Face integration: the GPU tests of fdlib.hf (the
# like-with-like logits test, padding, 8-bit append), the append's cost, and the generate table with its profile.
#   bash tools/gpu_e2e_run.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT/gen"
provenance "$OUT/gen/gpu.txt"
timeout 150 python -m pytest tests/test_hf.py tests/test_bench_generate.py tests/test_hf_kv8.py -q -rs -x \
  -p no:cacheprovider > "$OUT/gen/gpu-tests-hf.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/gen/gpu-tests-hf.txt"
tail -3 "$OUT/gen/gpu-tests-hf.txt"
timeout 60 python tools/append_bench.py --B 1,8,64 --L 8192 --dtype bfloat16 --out "$OUT/gen/append.md" 2>&1 | tail -12
timeout 300 python -m fdlib.bench --generate --profile --kv-dtype float8_e4m3fn \
  --cases 1:131072,8:32768,1:32768,1:8192,8:8192,8:131072 --budget-s 230 --out "$OUT/gen" --name generate \
  > "$OUT/gen/generate.log" 2>&1; echo "bench rc=$?" >> "$OUT/gen/generate.log"
tail -25 "$OUT/gen/generate.log"
tar czf "$OUT/gen.tgz" -C "$OUT" gen && rm -rf "$OUT/gen"
