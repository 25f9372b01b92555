#!/usr/bin/env bash
# Everything the course checks on a GPU, in one command, for a machine with torch + triton and no network:
#   bash tools/gpu_validate.sh OUT_DIR [quick]
# 1. GPU test suite (tests/test_gpu.py and the bench's GPU tests)
# 2. compute-sanitizer memcheck and racecheck on tools/sanitize_case.py (if compute-sanitizer is there)
# 3. cost-model calibration (cached under OUT_DIR, also copied as calibration.json)
# 4. python -m fdlib.bench: fp16 and bf16 full grid, and the fp16 splits sweep (skipped with "quick")
# Writes OUT_DIR/gpu-validate.tar.gz (every file, for machines that return few files) and a log.
set -uo pipefail
OUT="${1:?usage: tools/gpu_validate.sh OUT_DIR [quick]}"
MODE="${2:-full}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT/run"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FDLIB_CACHE="$OUT/run"
LOG="$OUT/run/gpu-validate.log"
{
  python3 -c "import fdlib; print(fdlib.describe())"
  echo "== git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git metadata')"
  echo "== GPU tests"
  timeout 300 python3 -m pytest tests/test_gpu.py tests/test_bench.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool"
      timeout 150 compute-sanitizer --tool "$tool" python3 tools/sanitize_case.py 2>&1 | tail -3
    done
  fi
  echo "== calibration"
  timeout 60 python3 -c "from fdlib.costmodel import calibrate; print(calibrate(progress=False))"
  cp "$OUT"/run/calibration-*.json "$OUT/run/calibration.json" 2>/dev/null
  if [ "$MODE" != quick ]; then
    for dt in float16 bfloat16; do
      echo "== bench $dt"
      timeout 300 python3 -m fdlib.bench --dtype "$dt" --out "$OUT/run" --name "bench-$dt" --no-progress \
        --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -3
    done
    echo "== sweep"
    timeout 200 python3 -m fdlib.bench --sweep-splits --dtype float16 --out "$OUT/run" --name sweep-fp16 \
      --no-progress --graph-rep 10 2>&1 | tail -5
  fi
} 2>&1 | tee "$LOG"
tar -czf "$OUT/gpu-validate.tar.gz" -C "$OUT/run" .
echo "wrote $OUT/gpu-validate.tar.gz"
