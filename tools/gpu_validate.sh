#!/usr/bin/env bash
# Everything the course checks on a GPU, for a machine with torch + triton and no network:
#   bash tools/gpu_validate.sh OUT_DIR [STEPS]
# STEPS: comma-separated, default tests,notebooks,sanitizer,calibrate,bench,sweep
#        ("quick" = tests,sanitizer,calibrate)
#   tests      GPU test suite (tests/test_gpu.py, test_persistent, test_plan, test_paged, test_balanced,
#              test_invariance, test_streamk, test_balance_choice on compiled kernels, or the files in GPU_TESTS;
#              and the bench's GPU tests)
#   notebooks  every notebook under nbval, as shipped and with the reference solutions (tests/test_notebooks.py);
#              nbval, ipykernel and their dependencies come from wheels in .whl/ when that folder exists
#              (installed into /tmp/site, no network)
#   sanitizer  compute-sanitizer memcheck and racecheck on tools/sanitize_case.py (if compute-sanitizer is there)
#   calibrate  cost-model calibration (cached under OUT_DIR/run, also copied as calibration.json)
#   bench      python -m fdlib.bench: fp16 and bf16 full grid (BENCH_DTYPES="float16" for one)
#   sweep      python -m fdlib.bench --sweep-splits, fp16
#   host       python -m fdlib.bench --host-overhead (µs per back-to-back call, cProfile of decode_attention)
#   heads      python -m fdlib.bench --heads-sweep (groups 1..16, D 64..256, L 8k and 64k, fp16; split, unified,
#              auto, cuDNN: the persistent kernel, 20-100x slower at these few rows, is left out)
#   ragged     python -m fdlib.bench --ragged, fp16: contiguous cache (and the whole grid over pages of 16 keys
#              with RAGGED_PAGED=1); issue 13's B=32 batch, contiguous and paged
#   pages      the ragged protocol at B=32, mean 8192, with pages of 1, 4, 8 and 16 keys (auto)
#   qlen       python -m fdlib.bench --qlen: q_len 1, 2, 4, 8 against SDPA cuDNN / FlashAttention
#   timeline   tools/record_timeline.py: per-program (SM, start, end) of Lab 06's ragged batches
#   invariant  python -m fdlib.bench --methods auto,invariant, fp16: the cost of batch_invariant=True
#   unifiedmax python -m fdlib.bench.unified_max, fp16, B 1 and 16, L 2k-128k: FlashDecoding++'s unified max
#              against the unified kernel
#   cp         (2 GPUs) torchrun --nproc-per-node 2 tools/cp_decode_case.py: context-parallel decode at L=2M and 8M,
#              B=64, both merges, eager and captured; then the NCCL test of tests/test_distributed.py
# Writes OUT_DIR/gpu-validate.tar.gz (every file, for machines that return few files; rewritten after each step) and a
# log.
set -uo pipefail
OUT="${1:?usage: tools/gpu_validate.sh OUT_DIR [STEPS]}"
STEPS="${2:-tests,notebooks,sanitizer,calibrate,bench,sweep}"
[ "$STEPS" = quick ] && STEPS=tests,sanitizer,calibrate
has() { [[ ",$STEPS," == *",$1,"* ]]; }
cd "$(dirname "$0")/.."
mkdir -p "$OUT/run"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FDLIB_CACHE="$OUT/run"
LOG="$OUT/run/gpu-validate.log"
# the tarball is rewritten after every step, so that a call cut by its time limit still returns what ran
pack() { tar -czf "$OUT/gpu-validate.tar.gz" -C "$OUT/run" . 2>/dev/null; }
# nbval, ipykernel, nbformat (the test helpers import it) and their dependencies: from wheels in .whl/ when that
# folder exists (installed into /tmp/site, no network)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  python3 -c "import fdlib; print(fdlib.describe())"
  echo "== git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git metadata'); steps: $STEPS"
  if has tests; then
    echo "== GPU tests"
    timeout 480 python3 -m pytest ${GPU_TESTS:-tests/test_gpu.py tests/test_persistent.py tests/test_plan.py tests/test_paged.py tests/test_balanced.py tests/test_invariance.py tests/test_streamk.py tests/test_balance_choice.py} -q -p no:cacheprovider \
      -rfE 2>&1 | tee "$OUT/run/gpu-tests.log" | tail -15
    timeout 200 python3 -m pytest tests/test_bench.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
  fi; pack
  if has notebooks; then
    echo "== notebooks (nbval, shipped and solved)"
    timeout 1500 python3 -m pytest tests/test_notebooks.py -k "as_shipped or solved" \
      -q -p no:cacheprovider -o addopts= 2>&1 | tail -15
  fi; pack
  if has sanitizer && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool"
      timeout 150 compute-sanitizer --tool "$tool" python3 tools/sanitize_case.py 2>&1 | tail -3
    done
  fi; pack
  if has calibrate; then
    echo "== calibration"
    timeout 60 python3 -c "from fdlib.calibration import calibrate; print(calibrate(progress=False))"
    cp "$OUT"/run/calibration-*.json "$OUT/run/calibration.json" 2>/dev/null
  fi; pack
  if has bench; then
    for dt in ${BENCH_DTYPES:-float16 bfloat16}; do
      echo "== bench $dt"
      timeout 300 python3 -m fdlib.bench --dtype "$dt" --out "$OUT/run" --name "bench-$dt" --no-progress \
        --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -3
    done
  fi; pack
  if has host; then
    echo "== host overhead"
    timeout 120 python3 -m fdlib.bench --host-overhead --out "$OUT/run" --name host-overhead --no-progress 2>&1 | head -20
  fi; pack
  if has heads; then
    echo "== heads sweep"
    timeout 200 python3 -m fdlib.bench --heads-sweep --methods split,unified,auto,cudnn --L 8192,65536 --out "$OUT/run" \
      --name heads-sweep --no-progress \
      --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -3
  fi; pack
  if has ragged; then
    echo "== ragged batches"
    timeout 300 python3 -m fdlib.bench --ragged --dtype float16 --methods ${RAGGED_METHODS:-auto,balanced,streamk} --out "$OUT/run" \
      --name ragged-fp16 --no-progress --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -3
    [ -n "${RAGGED_PAGED:-}" ] && timeout 150 python3 -m fdlib.bench --ragged --page-size 16 --dtype float16 \
      --methods auto,balanced --out "$OUT/run" --name ragged-fp16-page16 --no-progress --warmup 10 --rep 30 \
      --graph-rep 10 2>&1 | tail -3
    # issue 13's batch: B=32, 32:8, lengths uniform in 1..32768 (mean 16384), contiguous and pages of 16
    for ps in 0 16; do
      timeout 60 python3 -m fdlib.bench --ragged --B 32 --heads 32:8 --L 16384 --dtype float16 \
        --methods auto,split,balanced,streamk $([ $ps = 0 ] || echo --page-size $ps) --out "$OUT/run" \
        --name ragged-b32-mean16k-page$ps --no-progress --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -2
    done
  fi; pack
  if has pages; then
    echo "== page sizes 1, 4, 8, 16 (B=32, mean 8192)"
    for ps in 1 4 8 16; do
      timeout 60 python3 -m fdlib.bench --ragged --B 32 --L 8192 --page-size $ps --dtype float16 --methods auto \
        --out "$OUT/run" --name ragged-fp16-b32-page$ps --no-progress --warmup 10 --rep 30 --graph-rep 10 \
        2>&1 | tail -2
    done
  fi; pack
  if has qlen; then
    echo "== several query tokens (q_len 1, 2, 4, 8) against SDPA with the bottom-right causal mask"
    timeout 200 python3 -m fdlib.bench --qlen --out "$OUT/run" --name qlen-fp16 --no-progress \
      --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -4
  fi; pack
  if has timeline; then
    echo "== per-program timelines (Lab 06)"
    timeout 120 python3 tools/record_timeline.py --out "$OUT/run" --seed 0 2>&1 | tail -4
  fi; pack
  if has invariant; then
    echo "== batch-invariant cost"
    timeout 150 python3 -m fdlib.bench --methods auto,invariant --dtype float16 --out "$OUT/run" \
      --name invariant-fp16 --no-progress --warmup 10 --rep 30 --graph-rep 10 2>&1 | tail -3
  fi; pack
  if has unifiedmax; then
    echo "== unified-max (FlashDecoding++) against the unified kernel"
    timeout 120 python3 -m fdlib.bench.unified_max --dtype float16 --B 1,16 --L 2048,32768,131072 --out "$OUT/run" \
      --name unified-max 2>&1 | tail -4
  fi; pack
  if has cp; then
    echo "== context-parallel decode on 2 GPUs"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # multicast stays off
    timeout 420 torchrun --nproc-per-node 2 tools/cp_decode_case.py --out "$OUT/run" --iters 100 2>&1 | tail -25
    timeout 320 python3 -m pytest tests/test_distributed.py -k nccl -q -p no:cacheprovider 2>&1 | tail -3   # its own limit: 300 s
  fi; pack
  if has sweep; then
    echo "== sweep"
    timeout 240 python3 -m fdlib.bench --sweep-splits --dtype float16 --out "$OUT/run" --name sweep-fp16 \
      --no-progress --graph-rep 10 2>&1 | tail -5
  fi; pack
} 2>&1 | tee "$LOG"
pack   # once more, with the whole log
echo "wrote $OUT/gpu-validate.tar.gz"
