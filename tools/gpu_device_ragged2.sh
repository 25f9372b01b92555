#!/usr/bin/env bash
# Issue 50, second call (about 8 minutes): the GPU tests the first call's time limit cut; the --ragged protocol on
# a contiguous cache (tools/gpu_device_ragged.sh's bench stage); the plan made for L_max against stream-K and the
# host plan on every batch of mean 1k and 8k keys, contiguous and pages of 16 (tools/ab_ragged.py: auto from host
# lengths, auto+device+DEVICE_SCHEDULE=0 the L_max plan, auto+device stream-K); host time per call against SDPA's
# at B=1 and B=8; one Llama-3-8B decode step at B=8 (fdlib.hf's DecodeCache runs the stream-K default).
# Packs OUTDIR/dev0.tgz (the ragged stage) and OUTDIR/more.tgz.
#   bash tools/gpu_device_ragged2.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash tools/gpu_device_ragged.sh "$OUT" 0
start_run "$OUT" more
timeout 150 python -m pytest tests/test_plan.py -k "worklist or device or timeline or captured or fewer" -q -rs \
  -p no:cacheprovider > "$R/gpu-tests-plan.txt" 2>&1
echo "pytest rc=$?" >> "$R/gpu-tests-plan.txt"; tail -3 "$R/gpu-tests-plan.txt"; pack
CASES=""
for page in 0 16; do for B in 8 32 128; do for hk in 8 32; do for dist in constant uniform zipf; do
  for mean in 1024 8192; do CASES="$CASES${CASES:+,}$B:32:$hk:$dist:$mean:$page"; done; done; done; done; done
timeout 200 python tools/ab_ragged.py "$R/ab-lmax.json" --methods "auto,auto+device+DEVICE_SCHEDULE=0,auto+device" \
  --cases "$CASES" 2>&1 | grep -v Warn > "$R/ab-lmax.log"; tail -2 "$R/ab-lmax.log"; pack
for B in 1 8; do
  timeout 60 python -m fdlib.bench --host-overhead --B $B --out "$R" --name host-b$B > "$R/host-b$B.log" 2>&1
  echo "bench rc=$?" >> "$R/host-b$B.log"; grep -E "^\|" "$R/host-b$B.log" | head -12
done; pack
timeout 150 python -m fdlib.bench --generate --cases 8:32768 --variants hf_dynamic,hf_static,fdlib_eager,fdlib_graph \
  --budget-s 130 --out "$R" --name generate-b8 > "$R/generate-b8.log" 2>&1
echo "bench rc=$?" >> "$R/generate-b8.log"; grep -E "^\|" "$R/generate-b8.log" | head -12; pack
