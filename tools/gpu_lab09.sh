#!/usr/bin/env bash
# One call of about 5 minutes (9 with PATCH): the runs notebook 09 reads (results/notes/09_fewer_bytes.md, "What
# notebook 09 reads"), on one machine in one call: auto over a bf16 cache and over e4m3 and int8 caches with scales per tensor,
# per head and per token, B 1/8/32, L 4096-131072, 32:8, D 128, bf16 queries; each bench measures its read ceiling.
# Files in OUTDIR/lab09/ (packed into OUTDIR/lab09.tgz after each run). With PATCH, the runs are of a copy of fdlib
# with that patch applied (e.g. results/notes/09_kv8_candidate.patch), in a temporary folder, after the 8-bit tests
# compiled against it (200 s at most).
#   bash tools/gpu_lab09.sh OUTDIR [PATCH]
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
OUT=${1:?output folder}; PATCH=${2:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start_run "$OUT" lab09
if [ -n "$PATCH" ]; then   # `python -m` puts the working folder first on sys.path: run from inside the copy
  ROOT=$PWD; COPY=$(mktemp -d); cp -r fdlib "$COPY/" && (cd "$COPY" && patch -p1 -s < "$ROOT/$PATCH") || exit 1
  cd "$COPY"; export PYTHONPATH=$COPY; echo "fdlib patched with $PATCH" > "$R/patch.txt"
  # the 8-bit tests compiled against the patched copy, first: a patch lands only where they all pass
  timeout 200 python -m pytest -n 14 "$ROOT/tests/test_quant.py" "$ROOT/tests/test_quant_range.py" \
    "$ROOT/tests/test_hf_kv8.py" -q -p no:cacheprovider > "$R/patch-tests.txt" 2>&1
  echo "rc=$?" >> "$R/patch-tests.txt"; tail -4 "$R/patch-tests.txt"; pack
fi
G="--dtype bfloat16 --methods auto --B 1,8,32 --L 4096,8192,16384,32768,65536,131072 --heads 32:8 --D 128
   --max-kv-gb 40 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out $R"
timeout 60 python -m fdlib.bench $G --name kv16-bf16 > "$R/kv16-bf16.log" 2>&1; pack
for s in head token tensor; do for kv in float8_e4m3fn int8; do   # a run cut short keeps the scales most used
  timeout 50 python -m fdlib.bench $G --kv-dtype $kv --kv-scale $s --name kv8-$kv-$s > "$R/kv8-$kv-$s.log" 2>&1
  grep -h -A4 "^Time, µs" "$R/kv8-$kv-$s.md" 2>/dev/null | head -5; pack
done; done
