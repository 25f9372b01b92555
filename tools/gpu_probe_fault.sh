#!/usr/bin/env bash
# One call of about 5 minutes (7 with PROBE_AB=1): the illegal memory access two A/Bs of tools/ab_constants.py met on an H100
# (results/h100/chooser-ab/constants/rules.log, rules2.log, cost.log), most likely on a batch of D = 256 over pages
# of 16: the D=256 GPU tests; each suspect 100 times a plan (unified with and without its block-table entries in
# registers, split); compute-sanitizer memcheck on one suspect (tools/interp_memcheck.py --gpu); with PROBE_AB=1 the
# A/B that faulted at its last batch, each batch named before it runs, with CUDA_LAUNCH_BLOCKING=1.
# Files in OUTDIR/fault/ (packed into OUTDIR/fault.tgz after each stage).
#   bash tools/gpu_probe_fault.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" fault
# the D=256 batches as GPU tests against float64 (-v: each test named before it runs; a fault ends the process)
CUDA_LAUNCH_BLOCKING=1 timeout 100 python -m pytest tests/test_gpu.py -k head_dim_256 -v -p no:cacheprovider \
  > "$R/tests-d256.txt" 2>&1; echo "rc=$?" >> "$R/tests-d256.txt"; tail -4 "$R/tests-d256.txt"; pack
# each suspect 100 times a plan, without a sanitizer: unified with the table entries in registers its plan held
# before TABLE_REGS_MAX_D (128 and 64), with none (today's plan), and split (a fault ends only that process)
for c in "--D 256 --page 16 --B 8 --heads 16:4 --L 8192 --splits 5 --regs 128" \
    "--D 256 --page 16 --B 8 --heads 16:2 --L 8192 --splits 8 --regs 64"; do
  regs=${c##* }; c=${c% --regs *}
  for m in "--methods unified --table-regs $regs" "--methods unified" "--methods split"; do
    CUDA_LAUNCH_BLOCKING=1 timeout 30 python tools/interp_memcheck.py --gpu --repeat 100 $c $m > "$R/q.txt" 2>&1
    rc=$?; cat "$R/q.txt" >> "$R/repeat-full.txt"
    echo "rc=$rc for $c $m: $(grep -E '^(unified|split):|rror' "$R/q.txt" | head -2 | tr '\n' ' ')" >> "$R/repeat.txt"
  done
done; cat "$R/repeat.txt"; pack
command -v compute-sanitizer >/dev/null && \
  for c in "--D 256 --page 16 --B 8 --heads 16:4 --L 8192 --splits 5 --table-regs 128"; do
  timeout 80 compute-sanitizer --tool memcheck python tools/interp_memcheck.py --gpu $c >> "$R/memcheck.txt" 2>&1
  echo "rc=$? for $c" >> "$R/memcheck.txt"; tail -3 "$R/memcheck.txt"; pack
done
if [ "${PROBE_AB:-0}" = 1 ]; then   # PROBE_AB=1: then the A/B that faulted at its last batch, each batch named first
  CUDA_LAUNCH_BLOCKING=1 timeout 110 python tools/ab_constants.py "$R/paged.json" --max-cases 40 --kinds heads \
    --set PAGED_EPILOGUE_WORK=10000 > "$R/paged.log" 2>&1; echo "rc=$?" >> "$R/paged.log"
  grep -B1 -A2 "rror" "$R/paged.log" | head; pack
fi
